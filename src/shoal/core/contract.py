"""The runtime contract: request/response models and the abstract Runtime every backend implements.

A backend (container today; function-call pools and microVMs later) is a sibling module that
subclasses `Runtime`. The SDK (`shoal.sdk`) only talks to this interface.
"""
from __future__ import annotations

import abc
import enum
import math
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .errors import InvalidArgument

# The longest TTL, idle TTL or command timeout: 7 days. They travel as milliseconds in 32-bit fields
# (init's protocol, epoll/poll timeouts: at most 24.8 days), so an unbounded float would overflow.
MAX_SECONDS = 7 * 24 * 3600.0


def check_seconds(name: str, v: float | None) -> float | None:
    """A lifetime or timeout: None (none) or a finite number of seconds in (0, MAX_SECONDS]."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v <= MAX_SECONDS):
        raise InvalidArgument(f"{name} must be > 0 and <= {MAX_SECONDS:.0f} seconds (7 days) or null, got {v!r}")
    return float(v)


def to_ms(v: float | None) -> int:
    """Seconds -> whole milliseconds for init, never rounding a real duration down to 0 (= none)."""
    return 0 if v is None else max(1, math.ceil(v * 1000))


class Limits(BaseModel):
    """Resources of one sandbox. All must be positive."""

    model_config = ConfigDict(frozen=True)
    cpu: float = Field(1.0, description="CPU cores (CFS quota); fractional allowed")
    memory_mb: int = Field(512, description="memory limit, MiB (a tmpfs upper's pages count too)")
    disk_mb: int = Field(1024, description="size cap of the writable upper, MiB (ENOSPC past it)")
    pids: int = Field(512, description="maximum number of processes/threads")
    upper: Literal["tmpfs", "disk"] = Field(
        "tmpfs", description="where the writable upper lives: 'tmpfs' (memory-backed, size=disk_mb) or "
                             "'disk' (an ext4 file system of disk_mb on a loop device, on the Shoal root's disk)")

    @field_validator("cpu", "memory_mb", "disk_mb", "pids")
    @classmethod
    def _positive(cls, v, info):
        if v is None or v <= 0:
            raise ValueError(f"{info.field_name} must be > 0, got {v}")
        return v


class SandboxSpec(BaseModel):
    image: str = Field(description="image reference name[:tag] (or a layer-stack label)")
    layers: list[str] = Field(description="layer digests, bottom -> top")
    limits: Limits = Limits()
    ttl: float | None = Field(None, description="absolute lifetime in seconds from creation")
    idle_ttl: float | None = Field(None, description="seconds without any request before the sandbox ends")
    env: dict[str, str] = Field(default_factory=dict)
    base_env: dict[str, str] = Field(default_factory=dict, description="the part of env that came from the image")
    hostname: str | None = None
    workdir: str = Field("/", description="default working directory of commands")
    network: Literal["none", "host"] = Field(
        "none", description="'none': own network namespace with only lo (every task sandbox); "
                            "'host': the host's network, for image builds that fetch packages")

    @field_validator("ttl", "idle_ttl")
    @classmethod
    def _ttl_positive(cls, v, info):
        try:
            return check_seconds(info.field_name, v)
        except InvalidArgument as e:
            raise ValueError(str(e)) from None


class SandboxState(str, enum.Enum):
    RUNNING = "running"
    PAUSED = "paused"
    DEAD = "dead"


class SandboxInfo(BaseModel):
    id: str
    image: str
    layers: list[str]
    limits: Limits
    state: SandboxState
    created: float
    ttl: float | None = None
    idle_ttl: float | None = None
    init_pid: int | None = None
    memory_bytes: int | None = None
    env: dict[str, str] = Field(default_factory=dict)
    base_env: dict[str, str] = Field(default_factory=dict)
    workdir: str = "/"
    network: str = "none"


class ExecRequest(BaseModel):
    argv: list[str]
    cwd: str = "/"
    env: dict[str, str] = Field(default_factory=dict)
    stdin: bytes | None = None
    timeout: float | None = Field(60.0, description="seconds; the process group is killed on expiry")
    output_cap: int = Field(1 << 20, description="bytes kept per stream; the rest is counted, not kept")

    @field_validator("argv")
    @classmethod
    def _argv(cls, v):
        if not v or not v[0]:
            raise ValueError("argv must name a program")
        if any("\0" in a for a in v):
            raise ValueError("argv may not contain NUL bytes")
        return v

    @field_validator("timeout")
    @classmethod
    def _timeout(cls, v):
        try:
            return check_seconds("timeout", v)
        except InvalidArgument as e:
            raise ValueError(str(e)) from None


class ExecResult(BaseModel):
    exit_code: int = Field(description="exit status; 128+N when killed by signal N")
    stdout: str
    stderr: str
    stdout_bytes: int = Field(description="bytes the command wrote to stdout (kept or not)")
    stderr_bytes: int
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    timed_out: bool = False
    duration_s: float
    signal: int | None = None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


class SnapshotInfo(BaseModel):
    """A pack_diff snapshot: the source sandbox's writable upper as a layer on top of its stack."""

    id: str
    image: str = Field(description="image ref holding the full stack: snapshots/<id>:latest")
    layers: list[str] = Field(description="full stack, bottom -> top (possibly folded)")
    layer: str = Field(description="the layer captured from the writable upper")
    source_sandbox: str
    created: float
    size: int = Field(description="bytes of file content in the captured layer")


class FileEntry(BaseModel):
    name: str
    path: str
    type: Literal["file", "dir", "symlink", "other"]
    size: int
    mode: int
    mtime: float


OutputCallback = Callable[[str], None]


class Runtime(abc.ABC):
    """What every backend provides. Sandbox ids are strings unique on the host."""

    name: str

    @abc.abstractmethod
    def create(self, spec: SandboxSpec) -> SandboxInfo: ...

    @abc.abstractmethod
    def info(self, sandbox_id: str) -> SandboxInfo: ...

    @abc.abstractmethod
    def list(self) -> list[SandboxInfo]: ...

    @abc.abstractmethod
    def exec(self, sandbox_id: str, req: ExecRequest, on_stdout: OutputCallback | None = None,
             on_stderr: OutputCallback | None = None) -> ExecResult: ...

    @abc.abstractmethod
    def pause(self, sandbox_id: str) -> None: ...

    @abc.abstractmethod
    def resume(self, sandbox_id: str) -> None: ...

    @abc.abstractmethod
    def kill(self, sandbox_id: str) -> None: ...

    @abc.abstractmethod
    def set_ttl(self, sandbox_id: str, ttl: float | None = None, idle_ttl: float | None = None) -> None: ...
