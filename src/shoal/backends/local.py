"""What every backend that runs sandboxes on this host shares (container, gvisor).

A local backend launches a resolved `SandboxSpec` on mounted layers and exposes its sandbox's
writable upper; the host (`shoal.host.Host`) does the rest once for all of them: resolving images
to layers, mounting them, capturing an upper as a snapshot layer, and forking.
"""
from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from ..core.contract import (
    DEFAULT_DOWNLOAD_MAX,
    DEFAULT_READ_MAX,
    CreateRequest,
    FileEntry,
    ForkReply,
    ForkRequest,
    ImageSummary,
    Limits,
    SandboxBackend,
    SandboxInfo,
    SandboxSpec,
    SnapshotInfo,
    SnapshotRequest,
)
from .files import SandboxFiles

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

    def images(self) -> list[ImageSummary]:
        return self.host.images()

    @property
    def address(self) -> str:
        return f"{self.host.address}/{self.name}"

    @abc.abstractmethod
    def launch(self, spec: SandboxSpec, lower_dirs: list[Path]) -> SandboxInfo:
        """Start a sandbox whose root is an overlay of `lower_dirs` (mounted layers, bottom -> top)
        under a fresh writable upper."""

    @abc.abstractmethod
    def upper_dir(self, sandbox_id: str) -> Path:
        """Host path of the sandbox's writable upper: its whole diff against its layers."""

    @contextlib.contextmanager
    def upper_view(self, sandbox_id: str) -> Iterator[Path]:
        """The upper at a plain host path for the duration of the block, for tools that resolve
        their arguments (mkfs.erofs realpath()s its source: /proc/<pid>/fd/<n>/... would not do)."""
        yield self.upper_dir(sandbox_id)

    # ---------------------------------------------------------------- files, on the host's view of the root
    @abc.abstractmethod
    def root_files(self, sandbox_id: str) -> SandboxFiles:
        """The files API over the sandbox's root as the host sees it (resolved inside it); getting it
        counts as activity for the idle TTL."""

    def read_file(self, sandbox_id: str, path: str, max_bytes: int = DEFAULT_READ_MAX) -> bytes:
        return self.root_files(sandbox_id).read(path, max_bytes=max_bytes)

    def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> int:
        return self.root_files(sandbox_id).write(path, data, mode=mode)

    def list_files(self, sandbox_id: str, path: str = "/") -> list[FileEntry]:
        return self.root_files(sandbox_id).list(path)

    def stat_file(self, sandbox_id: str, path: str) -> FileEntry:
        return self.root_files(sandbox_id).stat(path)

    def mkdir(self, sandbox_id: str, path: str) -> None:
        self.root_files(sandbox_id).mkdir(path, parents=True)

    def chown(self, sandbox_id: str, path: str, uid: int, gid: int) -> None:
        self.root_files(sandbox_id).chown(path, uid, gid)

    def set_xattrs(self, sandbox_id: str, path: str, attrs: dict[str, str]) -> None:
        self.root_files(sandbox_id).set_xattrs(path, attrs)

    def remove_file(self, sandbox_id: str, path: str) -> None:
        self.root_files(sandbox_id).remove(path)

    def upload_tar(self, sandbox_id: str, dest_dir: str, tar: bytes) -> int:
        return self.root_files(sandbox_id).upload(dest_dir, tar)

    def download_tar(self, sandbox_id: str, path: str, max_bytes: int = DEFAULT_DOWNLOAD_MAX) -> bytes:
        return self.root_files(sandbox_id).download(path, max_bytes=max_bytes)

    # ---------------------------------------------------------------- snapshots: the host's one capture
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
