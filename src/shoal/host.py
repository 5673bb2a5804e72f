"""This machine as a sandbox backend: the layer store plus the local backends (container, gvisor).

`Host` implements the whole contract (`SandboxBackend`): it resolves images into layers, mounts them,
hands a create to the backend it names, and routes every later request by the sandbox id's prefix.
What all local backends share lives here once: capturing a sandbox's writable upper as a layer
(snapshots, image builds, SWE task layers) and fork.

Everything is embedded (SQLite + files under the root). Running sandboxes in this process needs
root; a normal user talks to shoald (`shoal.backends.http`) instead.
"""
from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pydantic import ValidationError

from .backends import LOCAL_BACKENDS, load_local_backend
from .backends.local import LocalBackend
from .config import Settings, load_settings
from .core.contract import (
    DEFAULT_DOWNLOAD_MAX,
    DEFAULT_READ_MAX,
    PORT_CONNECT_TIMEOUT,
    CreateRequest,
    ExecRequest,
    ExecResult,
    FileEntry,
    ForkFailure,
    ForkReply,
    ForkRequest,
    ImageSummary,
    Limits,
    NetworkPolicy,
    NetworkRequest,
    OutputCallback,
    PortSocket,
    ProcessHandle,
    ReclaimRequest,
    ReclaimResult,
    SandboxBackend,
    SandboxInfo,
    SandboxSpec,
    SandboxState,
    SessionHandle,
    SessionRequest,
    SnapshotInfo,
    SnapshotRequest,
    StartRequest,
    TimeoutRequest,
    WatchHandle,
)
from .core.errors import (
    BackendUnavailable,
    ImageNotFound,
    InvalidArgument,
    LayerNotFound,
    SandboxError,
    SandboxNotFound,
    ShoalError,
)
from .layers.store import LayerInfo, LayerStore

_hosts: dict[Path, Host] = {}
_hosts_lock = threading.Lock()

DEFAULT_BACKEND = "container"


class Host(SandboxBackend):
    name = "local"

    def __init__(self, settings: Settings):
        self.settings = settings
        self.store = LayerStore(settings)
        self._backends: dict[str, LocalBackend] = {}
        self._lock = threading.Lock()
        self._execd: set[str] = set()  # sandboxes whose first exec finished (lazy start-up marks)

    @classmethod
    def get(cls, root: str | os.PathLike | None = None) -> Host:
        """The shared Host for a root (one per process and root)."""
        settings = load_settings(root)
        with _hosts_lock:
            host = _hosts.get(settings.root)
            if host is None:
                host = _hosts[settings.root] = cls(settings)
            return host

    # ---------------------------------------------------------------- backends
    def backend(self, name: str | None = None) -> LocalBackend:
        """The local backend `name` (default: container); created, and its orphans swept, on first use."""
        name = name or DEFAULT_BACKEND
        with self._lock:
            be = self._backends.get(name)
            if be is None:
                if name not in LOCAL_BACKENDS:
                    raise InvalidArgument(f"unknown backend {name!r}; this host runs: {', '.join(LOCAL_BACKENDS)}")
                if os.geteuid() != 0:
                    raise SandboxError(f"backend {name!r} runs sandboxes in this process, which needs root "
                                       "(mounts, namespaces, cgroups); as a normal user, talk to shoald instead "
                                       "(the default: start it with `sudo shoal serve`)")
                be = load_local_backend(name)(self)
                be.sweep()
                self._backends[name] = be
            return be

    def backends(self) -> list[LocalBackend]:
        """Every local backend this host can run (each started on first use); ones whose tools are
        not installed here (e.g. no runsc) are left out."""
        out = []
        for name in LOCAL_BACKENDS:
            try:
                out.append(self.backend(name))
            except (BackendUnavailable, ImportError):
                continue
        return out

    def _route(self, sandbox_id: str) -> LocalBackend:
        if not isinstance(sandbox_id, str):
            raise SandboxNotFound(f"invalid sandbox id {sandbox_id!r}")
        prefix = sandbox_id.split("-", 1)[0]
        for name, (id_prefix, _) in LOCAL_BACKENDS.items():
            if prefix == id_prefix:
                return self.backend(name)
        raise SandboxNotFound(f"sandbox {sandbox_id} not found")

    # ---------------------------------------------------------------- resolving a create
    def resolve_layers(self, image: str | None, layers: list[str] | None) -> tuple[str, list[str], dict]:
        """An image name[:tag] and/or extra layers (composed on top at creation)
        -> (label, digests bottom -> top, image config)."""
        digests: list[str] = []
        label_parts = []
        config: dict = {}
        if image:
            info = self.store.get_image(image)
            digests += info.layers
            label_parts.append(info.ref)
            config = info.config
        for ref in layers or []:
            # a layer (digest, prefix or name), or an image whose layers compose on top (workspace, toolkit)
            try:
                digests.append(self.store.resolve(ref))
                label_parts.append(digests[-1].split(":")[1][:12])
                continue
            except LayerNotFound:
                pass
            try:
                img = self.store.get_image(ref)
            except (ImageNotFound, InvalidArgument):
                raise LayerNotFound(f"{ref!r} is neither a layer nor an image") from None
            digests += img.layers
            label_parts.append(img.ref)
            config = {"env": {**config.get("env", {}), **img.config.get("env", {})},
                      "workdir": img.config.get("workdir") if img.config.get("workdir", "/") != "/"
                      else config.get("workdir", "/")}
        if not digests:
            raise InvalidArgument("give an image (name[:tag]) or a list of layers to create a sandbox")
        return "+".join(label_parts), digests, config

    def prepare(self, req: CreateRequest) -> tuple[SandboxSpec, list[Path]]:
        """A create request -> the resolved spec (host defaults filled in) and the mounted layers."""
        image = req.image
        if req.from_snapshot is not None:
            if image is not None:
                raise InvalidArgument("give either image or from_snapshot, not both")
            image = snapshot_image(req.from_snapshot)
        label, digests, config = self.resolve_layers(image, req.layers)
        s = self.settings
        try:
            limits = Limits(cpu=req.cpu or s.default_cpu, memory_mb=req.memory_mb or s.default_memory_mb,
                            disk_mb=req.disk_mb or s.default_disk_mb, pids=req.pids or s.default_pids,
                            upper=req.upper or "tmpfs", oom_kill=req.oom_kill or s.oom_kill,
                            memory_cgroup=req.memory_cgroup or s.memory_cgroup, memory_pool=req.memory_pool or "")
            spec = SandboxSpec(image=label, layers=digests, limits=limits, ttl=req.ttl, idle_ttl=req.idle_ttl,
                               env={**config.get("env", {}), **(req.env or {})}, base_env=config.get("env", {}),
                               hostname=req.hostname, workdir=req.workdir or config.get("workdir", "/"),
                               network=req.network, ksm=req.ksm, aslr=req.aslr, priority=req.priority)
        except ValidationError as e:
            raise InvalidArgument(describe(e)) from None
        return spec, self.store.ensure_mounted(digests)

    # ---------------------------------------------------------------- capture: the one copy
    @contextmanager
    def frozen(self, sandbox_id: str) -> Iterator[LocalBackend]:
        """The sandbox's processes frozen for the block (left paused if they already were)."""
        be = self._route(sandbox_id)
        was_paused = be.info(sandbox_id).state == SandboxState.PAUSED
        if not was_paused:
            be.pause(sandbox_id)
        try:
            yield be
        finally:
            if not was_paused:
                be.resume(sandbox_id)

    def capture_layer(self, sandbox_id: str, *, source: str, exclude: list[str] | None = None) -> LayerInfo:
        """The sandbox's writable upper as a layer, its processes frozen meanwhile so it is consistent.
        `exclude` lists sandbox paths (e.g. build residue) left out."""
        exclude = list(self.settings.snapshot_exclude if exclude is None else exclude)
        for path in exclude:
            if not isinstance(path, str) or not path.strip("/") or "\0" in path:
                raise InvalidArgument(f"snapshot exclude entries are non-empty sandbox paths without NUL, got {path!r}")
        with self.frozen(sandbox_id) as be, be.upper_view(sandbox_id) as upper:
            return self.store.build_from_dir(upper, source=source, exclude=exclude)

    def capture(self, be: SandboxBackend, sandbox_id: str, req: SnapshotRequest) -> SnapshotInfo:
        """pack_diff: the captured upper on top of the sandbox's stack, registered as `snapshots/<id>`."""
        info = be.info(sandbox_id)
        layer = self.capture_layer(sandbox_id, source=f"snapshot:{sandbox_id}", exclude=req.exclude)
        stack = list(info.layers) + [layer.digest]
        depth = req.max_depth or self.settings.max_stack_depth
        if len(stack) > depth:
            stack = self.store.fold_to_depth(stack, depth)
        snap_id = "snap-" + secrets.token_hex(6)
        img = self.store.create_image(f"snapshots/{snap_id}", stack,
                                      config={"env": info.base_env, "workdir": info.workdir,
                                              "source_sandbox": sandbox_id, "parent_layers": list(info.layers)})
        return SnapshotInfo(id=snap_id, image=img.ref, layers=list(img.layers), layer=layer.digest,
                            source_sandbox=sandbox_id, created=img.created, size=layer.size)

    def fork(self, sandbox_id: str, req: ForkRequest) -> ForkReply:
        """n children of one snapshot, each with its own upper, id, hostname and /etc/machine-id."""
        be = self._route(sandbox_id)
        info = be.info(sandbox_id)
        snap = be.snapshot(sandbox_id, SnapshotRequest(exclude=req.exclude))
        env = {**info.env, **(req.env or {})} if req.copy_env else req.env
        ttl, idle_ttl = req.ttl, req.idle_ttl
        if req.inherit_ttl:
            if ttl is None and info.ttl is not None:
                ttl = max(0.001, info.created + info.ttl - time.time())
            idle_ttl = idle_ttl if idle_ttl is not None else info.idle_ttl
        child = CreateRequest(from_snapshot=snap.id, backend=be.name, cpu=req.cpu or info.limits.cpu,
                              memory_mb=req.memory_mb or info.limits.memory_mb,
                              disk_mb=req.disk_mb or info.limits.disk_mb, pids=req.pids or info.limits.pids,
                              upper=req.upper or info.limits.upper, oom_kill=info.limits.oom_kill,
                              memory_cgroup=info.limits.memory_cgroup,
                              memory_pool=info.limits.memory_pool or None, ttl=ttl,
                              idle_ttl=idle_ttl, env=env,
                              ksm=info.ksm, aslr=info.aslr, priority=info.priority)  # as the parent
        reply = ForkReply(snapshot=snap, sandboxes=[])
        for i in range(req.n):
            try:
                c = be.create(child)
                be.write_file(c.id, "/etc/machine-id", (secrets.token_hex(16) + "\n").encode(), mode=0o444)
                reply.sandboxes.append(c)
            except Exception as e:  # reported per child, the others are kept
                reply.failed.append(ForkFailure(index=i, type=type(e).__name__, message=str(e)))
        return reply

    # ---------------------------------------------------------------- the contract, routed by id
    def create(self, req: CreateRequest) -> SandboxInfo:
        return self.backend(req.backend).create(req)

    def info(self, sandbox_id: str) -> SandboxInfo:
        return self._route(sandbox_id).info(sandbox_id)

    def kill(self, sandbox_id: str) -> None:
        self._route(sandbox_id).kill(sandbox_id)

    def kill_many(self, sandbox_ids: list[str]) -> list[str]:
        """Kill many sandboxes; a backend that can end them together does (the container backend:
        all signalled first, then waited for at once). Returns the ids that were already gone."""
        groups: dict[str, list[str]] = {}
        gone: list[str] = []
        for sid in sandbox_ids:
            try:
                groups.setdefault(self._route(sid).name, []).append(sid)
            except SandboxNotFound:
                gone.append(sid)
        for name, ids in groups.items():
            be = self.backend(name)
            many = getattr(be, "kill_many", None)
            if many is not None:
                gone += many(ids)
                continue
            for sid in ids:
                try:
                    be.kill(sid)
                except SandboxNotFound:
                    gone.append(sid)
        return gone

    def pause(self, sandbox_id: str) -> None:
        self._route(sandbox_id).pause(sandbox_id)

    def resume(self, sandbox_id: str) -> None:
        self._route(sandbox_id).resume(sandbox_id)

    def set_ttl(self, sandbox_id: str, req: TimeoutRequest) -> SandboxInfo:
        return self._route(sandbox_id).set_ttl(sandbox_id, req)

    def reclaim(self, sandbox_id: str, req: ReclaimRequest) -> ReclaimResult:
        return self._route(sandbox_id).reclaim(sandbox_id, req)

    def exec(self, sandbox_id: str, req: ExecRequest, on_stdout: OutputCallback | None = None,
             on_stderr: OutputCallback | None = None) -> ExecResult:
        res = self._route(sandbox_id).exec(sandbox_id, req, on_stdout, on_stderr)
        if sandbox_id not in self._execd:
            self._first_exec_done(sandbox_id)
        return res

    def _first_exec_done(self, sandbox_id: str) -> None:
        """A sandbox's first command finished: its lazy layers that record a prefetch list note where
        their start-up ends (shoal.lazy.prefetch; what a later cold start prefetches)."""
        if len(self._execd) > 100_000:  # only "seen recently" matters; a long-lived server forgets
            self._execd.clear()
        self._execd.add(sandbox_id)
        try:
            layers = self.info(sandbox_id).layers
        except ShoalError:
            return
        from .lazy import prefetch as lazy_prefetch

        lazy_prefetch.mark_startup(self.settings.root, list(layers))

    def start(self, sandbox_id: str, req: StartRequest) -> ProcessHandle:
        return self._route(sandbox_id).start(sandbox_id, req)

    def open_session(self, sandbox_id: str, req: SessionRequest) -> SessionHandle:
        return self._route(sandbox_id).open_session(sandbox_id, req)

    def read_file(self, sandbox_id: str, path: str, max_bytes: int = DEFAULT_READ_MAX) -> bytes:
        return self._route(sandbox_id).read_file(sandbox_id, path, max_bytes)

    def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> int:
        return self._route(sandbox_id).write_file(sandbox_id, path, data, mode)

    def list_files(self, sandbox_id: str, path: str = "/") -> list[FileEntry]:
        return self._route(sandbox_id).list_files(sandbox_id, path)

    def stat_file(self, sandbox_id: str, path: str) -> FileEntry:
        return self._route(sandbox_id).stat_file(sandbox_id, path)

    def mkdir(self, sandbox_id: str, path: str) -> None:
        self._route(sandbox_id).mkdir(sandbox_id, path)

    def chown(self, sandbox_id: str, path: str, uid: int, gid: int) -> None:
        self._route(sandbox_id).chown(sandbox_id, path, uid, gid)

    def set_xattrs(self, sandbox_id: str, path: str, attrs: dict[str, str]) -> None:
        self._route(sandbox_id).set_xattrs(sandbox_id, path, attrs)

    def remove_file(self, sandbox_id: str, path: str) -> None:
        self._route(sandbox_id).remove_file(sandbox_id, path)

    def upload_tar(self, sandbox_id: str, dest_dir: str, tar: bytes) -> int:
        return self._route(sandbox_id).upload_tar(sandbox_id, dest_dir, tar)

    def download_tar(self, sandbox_id: str, path: str, max_bytes: int = DEFAULT_DOWNLOAD_MAX) -> bytes:
        return self._route(sandbox_id).download_tar(sandbox_id, path, max_bytes)

    def snapshot(self, sandbox_id: str, req: SnapshotRequest) -> SnapshotInfo:
        return self._route(sandbox_id).snapshot(sandbox_id, req)

    def get_network(self, sandbox_id: str) -> NetworkPolicy:
        return self._route(sandbox_id).get_network(sandbox_id)

    def connect_port(self, sandbox_id: str, port: int, timeout: float = PORT_CONNECT_TIMEOUT) -> socket.socket:
        return self._route(sandbox_id).connect_port(sandbox_id, port, timeout)

    def port_sockets(self, sandbox_id: str, port: int) -> list[PortSocket]:
        return self._route(sandbox_id).port_sockets(sandbox_id, port)

    def guard_port(self, sandbox_id: str, port: int) -> None:
        self._route(sandbox_id).guard_port(sandbox_id, port)

    def port_guarded(self, sandbox_id: str, port: int) -> bool:
        return self._route(sandbox_id).port_guarded(sandbox_id, port)

    def written_under(self, sandbox_id: str, paths: list[str], limit: int = 20) -> list[str]:
        return self._route(sandbox_id).written_under(sandbox_id, paths, limit)

    def set_network(self, sandbox_id: str, req: NetworkRequest) -> NetworkPolicy:
        return self._route(sandbox_id).set_network(sandbox_id, req)

    def watch_dir(self, sandbox_id: str, path: str, recursive: bool = False) -> WatchHandle:
        return self._route(sandbox_id).watch_dir(sandbox_id, path, recursive)

    # ---------------------------------------------------------------- housekeeping
    def sweep(self) -> list[str]:
        return [sid for be in self.backends() for sid in be.sweep()]

    def live_ids(self) -> set[str]:
        return {sid for be in self.backends() for sid in be.live_ids()}

    def committed(self) -> list[Limits]:
        return [lim for be in self.backends() for lim in be.committed()]

    def live_layers(self) -> set[str]:
        return {d for be in self.backends() for d in be.live_layers()}

    def gc(self) -> dict:
        reaped = self.sweep()
        result = self.store.gc(live=self.live_layers())
        result["sandboxes_reaped"] = reaped
        return result

    def remove_layer(self, ref: str) -> LayerInfo:
        self.backend()
        return self.store.remove_layer(ref, live=self.live_layers())

    def images(self) -> list[ImageSummary]:
        return local_images(self.store)

    @property
    def address(self) -> str:
        return f"local:{self.settings.root}"

    def list(self) -> list[SandboxInfo]:
        return [info for be in self.backends() for info in be.list()]


def local_images(store: LayerStore) -> list[ImageSummary]:
    """Every image of a local store (in-process callers are the host's operator: all are theirs)."""
    return [ImageSummary(ref=i.ref, layers=list(i.layers), created=i.created, config=i.config)
            for i in store.list_images()]


def snapshot_image(snap: str) -> str:
    """The image holding a snapshot's stack."""
    import re

    if not isinstance(snap, str) or not re.fullmatch(r"snap-[0-9a-f]{12}", snap):
        raise InvalidArgument(f"not a snapshot id: {snap!r} (expected snap-<12 hex>)")
    return f"snapshots/{snap}:latest"


def describe(e: ValidationError) -> str:
    """One line per problem, naming the field: 'ttl: must be > 0 seconds, got -1'."""
    return "; ".join(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg'].removeprefix('Value error, ')}"
                     for err in e.errors())
