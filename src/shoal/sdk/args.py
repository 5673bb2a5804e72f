"""Typed per-backend creation arguments (DSec style): one class per backend, one `backend=` switch.

The SDK does not pretend every backend has the same knobs; each class lists what its backend
honours. Only `container` runs today; the others are declared so code can be written against them
and fails with a clear BackendUnavailable on this host.
"""
from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..core.contract import Limits


class BackendArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    backend: ClassVar[str]

    def limits(self) -> Limits:
        raise NotImplementedError


class ContainerArgs(BackendArgs):
    """Linux namespaces + cgroups + overlayfs over EROFS layers."""

    backend: ClassVar[str] = "container"
    cpu: float = Field(1.0, gt=0, description="CPU cores (CFS quota)")
    memory_mb: int = Field(512, gt=0, description="memory limit in MiB (writable upper counts too)")
    disk_mb: int = Field(1024, gt=0, description="size cap of the writable upper in MiB")
    pids: int = Field(512, gt=0, description="max processes + threads")
    upper: Literal["tmpfs", "disk"] = Field(
        "tmpfs", description="writable upper on a tmpfs (memory-backed) or on disk (ext4 on a loop device)")
    hostname: str | None = Field(None, max_length=64)

    def limits(self) -> Limits:
        return Limits(cpu=self.cpu, memory_mb=self.memory_mb, disk_mb=self.disk_mb, pids=self.pids,
                      upper=self.upper)


class FnCallArgs(BackendArgs):
    """Function-call warm pools (planned)."""

    backend: ClassVar[str] = "fncall"
    cpu: float = Field(1.0, gt=0)
    memory_mb: int = Field(512, gt=0)
    gpu: bool = False


class MicroVMArgs(BackendArgs):
    """QEMU/KVM microVMs with virtio-pmem layers (planned)."""

    backend: ClassVar[str] = "microvm"
    vcpus: int = Field(1, gt=0)
    memory_mb: int = Field(512, gt=0)
    disk_mb: int = Field(1024, gt=0)


BACKEND_ARGS: dict[str, type[BackendArgs]] = {c.backend: c for c in (ContainerArgs, FnCallArgs, MicroVMArgs)}
