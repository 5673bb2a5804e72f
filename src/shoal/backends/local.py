"""What every backend that runs sandboxes on this host shares (container, gvisor).

A local backend launches a resolved `SandboxSpec` on mounted layers and exposes its sandbox's
writable upper; the host (`shoal.host.Host`) does the rest once for all of them: resolving images
to layers, mounting them, capturing an upper as a snapshot layer, and forking.
"""
from __future__ import annotations

import abc
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from ..core.contract import (
    CreateRequest,
    ForkReply,
    ForkRequest,
    Limits,
    SandboxBackend,
    SandboxInfo,
    SandboxSpec,
    SnapshotInfo,
    SnapshotRequest,
)

if TYPE_CHECKING:
    from ..host import Host


class LocalBackend(SandboxBackend):
    """A backend on this host's layer store. Subclasses launch and manage; the host resolves and captures."""

    # Sandbox ids are `<id_prefix>-<host tag>-<hex>`: the host routes a request by this prefix alone
    id_prefix: ClassVar[str]

    def __init__(self, host: Host):
        self.host = host
        self.settings = host.settings

    def create(self, req: CreateRequest) -> SandboxInfo:
        spec, lower_dirs = self.host.prepare(req)
        return self.launch(spec, lower_dirs)

    @abc.abstractmethod
    def launch(self, spec: SandboxSpec, lower_dirs: list[Path]) -> SandboxInfo:
        """Start a sandbox whose root is an overlay of `lower_dirs` (mounted layers, bottom -> top)
        under a fresh writable upper."""

    @abc.abstractmethod
    def upper_dir(self, sandbox_id: str) -> Path:
        """Host path of the sandbox's writable upper: its whole diff against its layers."""

    def snapshot(self, sandbox_id: str, req: SnapshotRequest) -> SnapshotInfo:
        return self.host.capture(self, sandbox_id, req)

    def fork(self, sandbox_id: str, req: ForkRequest) -> ForkReply:
        return self.host.fork(sandbox_id, req)

    # ---------------------------------------------------------------- housekeeping (host-side only)
    @abc.abstractmethod
    def sweep(self) -> list[str]:
        """Reap sandboxes whose supervising process died; returns their ids."""

    @abc.abstractmethod
    def live_ids(self) -> set[str]:
        """Ids of sandboxes that hold resources on this host (cheap: no per-sandbox probing)."""

    @abc.abstractmethod
    def committed(self) -> list[Limits]:
        """Limits of every sandbox holding resources (cheap), for admission decisions."""

    def live_layers(self) -> set[str]:
        return {digest for info in self.list() for digest in info.layers}
