"""The SDK: `shoal.Sandbox`, with `commands`, `files` and `sessions` sub-objects, over any backend.

    with Sandbox.create("python:3.11", memory_mb=256, ttl=600) as sb:
        r = sb.commands.run("echo hi")
        sb.files.write("/work/x.py", "print(1)")
        with sb.sessions.create() as sh:
            sh.run("cd /work"); sh.run("python3 x.py")

Where sandboxes run: through shoald by default (`url=` or $SHOAL_URL, else the host daemon's socket
/run/shoal/shoald.sock; no root needed), or in this process with `url="local"` / `backend="local"`
(root only; for tests and benchmarks). Every method maps to one call of the backend contract
(`shoal.core.contract.SandboxBackend`), so the SDK behaves the same over every backend.

`shoal.AsyncSandbox` (async_sandbox.py) is generated from this file: `python -m shoal.sdk.codegen`.
"""
from __future__ import annotations

import io
import os
import queue
import socket
import tarfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from ..backends import LOCAL, open_backend
from ..core.contract import (
    DEFAULT_DOWNLOAD_MAX,
    DEFAULT_READ_MAX,
    PORT_CONNECT_TIMEOUT,
    CreateRequest,
    ExecRequest,
    ExecResult,
    FileEntry,
    ForkRequest,
    MemoryCgroup,
    NetworkPolicy,
    NetworkRequest,
    OomKill,
    OutputCallback,
    OutputEvent,
    PortSocket,
    Priority,
    ProcessHandle,
    ReclaimRequest,
    ReclaimResult,
    SandboxBackend,
    SandboxInfo,
    SandboxState,
    SessionHandle,
    SessionRequest,
    SnapshotInfo,
    SnapshotRequest,
    StartRequest,
    TimeoutRequest,
    UpperKind,
    WatchHandle,
)
from ..core.errors import CommandTimeout, FileOpError, InvalidArgument, SandboxError, ShoalError
from .desktop import Desktop

Cmd = str | list[str]


def _argv(cmd: Cmd) -> list[str]:
    if isinstance(cmd, str):
        if not cmd.strip():
            raise InvalidArgument("empty command")
        return ["/bin/sh", "-c", cmd]
    if not cmd:
        raise InvalidArgument("empty argv")
    return list(cmd)


def _model(cls, **kw):
    """Build a request model; a bad value becomes InvalidArgument naming the field."""
    try:
        return cls(**kw)
    except ValidationError as e:
        from ..host import describe

        raise InvalidArgument(describe(e)) from None


# ---------------------------------------------------------------------------------------- commands
class Commands:
    def __init__(self, sb: Sandbox):
        self._sb = sb

    def run(self, cmd: Cmd, *, cwd: str | None = None, env: dict[str, str] | None = None,
            timeout: float | None = 60.0, stdin: bytes | str | None = None, on_stdout: OutputCallback | None = None,
            on_stderr: OutputCallback | None = None, output_cap: int | None = None,
            check: bool = False) -> ExecResult:
        """Run a command to completion. A string runs under /bin/sh -c; a list is an argv.

        On timeout the command's process group is killed and the result has timed_out=True (or
        CommandTimeout is raised with check=True); check=True also raises SandboxError on a non-zero exit."""
        req = _model(ExecRequest, argv=_argv(cmd), cwd=cwd, env=env or {}, timeout=timeout,
                     stdin=stdin.encode() if isinstance(stdin, str) else stdin, output_cap=output_cap)
        result = self._sb._backend.exec(self._sb.id, req, on_stdout, on_stderr)
        if check and result.timed_out:
            raise CommandTimeout(f"{cmd!r} timed out after {timeout} s in sandbox {self._sb.id}", result)
        if check and result.exit_code != 0:
            raise SandboxError(f"{cmd!r} exited with {result.exit_code} in sandbox {self._sb.id}: "
                               f"{result.stderr[-500:]}")
        return result

    def start(self, cmd: Cmd, *, cwd: str | None = None, env: dict[str, str] | None = None,
              timeout: float | None = None, ring_bytes: int = 1 << 20) -> ProcessHandle:
        """Start a background command; output is kept in a ring buffer of `ring_bytes` per stream."""
        req = _model(StartRequest, argv=_argv(cmd), cwd=cwd, env=env or {}, timeout=timeout, ring_bytes=ring_bytes)
        return self._sb._backend.start(self._sb.id, req)

    def stream(self, cmd: Cmd, *, cwd: str | None = None, env: dict[str, str] | None = None,
               timeout: float | None = 60.0, stdin: bytes | str | None = None,
               output_cap: int | None = None) -> Iterator[OutputEvent | ExecResult]:
        """Yield OutputEvents as the command writes, then its ExecResult last."""
        q: queue.Queue = queue.Queue()
        box: dict = {}

        def work() -> None:
            try:
                box["r"] = self.run(cmd, cwd=cwd, env=env, timeout=timeout, stdin=stdin, output_cap=output_cap,
                                    on_stdout=lambda t: q.put(OutputEvent(stream="stdout", text=t)),
                                    on_stderr=lambda t: q.put(OutputEvent(stream="stderr", text=t)))
            except BaseException as e:  # re-raised in the consumer
                box["e"] = e
            q.put(None)

        threading.Thread(target=work, daemon=True).start()
        while (ev := q.get()) is not None:
            yield ev
        if "e" in box:
            raise box["e"]
        yield box["r"]


# ---------------------------------------------------------------------------------------- sessions
class Sessions:
    def __init__(self, sb: Sandbox):
        self._sb = sb

    def create(self, shell: str | None = None, cwd: str | None = None, env: dict[str, str] | None = None,
               output_cap: int | None = None) -> SessionHandle:
        """A long-lived shell (default /bin/bash if present, else /bin/sh) whose cwd, env and variables
        persist between run() calls. Close it (or use `with`) when done."""
        req = _model(SessionRequest, shell=shell, cwd=cwd, env=env or {}, output_cap=output_cap)
        return self._sb._backend.open_session(self._sb.id, req)


# ---------------------------------------------------------------------------------------- files
def tar_of(src: str | os.PathLike | bytes) -> bytes:
    """Raw tar bytes as given, or a tar of a local file or directory (named by its basename)."""
    if isinstance(src, bytes):
        return src
    p = Path(src)
    if not p.exists():
        raise InvalidArgument(f"upload source {p} does not exist")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        tf.add(str(p), arcname=p.name)
    return buf.getvalue()


class Files:
    """Paths are resolved inside the sandbox root; `..` and symlinks cannot reach the host."""

    def __init__(self, sb: Sandbox):
        self._sb = sb

    def read(self, path: str, encoding: str = "utf-8") -> str:
        return self.read_bytes(path).decode(encoding, "replace")

    def read_bytes(self, path: str, max_bytes: int = DEFAULT_READ_MAX) -> bytes:
        return self._sb._backend.read_file(self._sb.id, path, max_bytes)

    def write(self, path: str, data: str | bytes, mode: int = 0o644) -> int:
        raw = data.encode() if isinstance(data, str) else data
        return self._sb._backend.write_file(self._sb.id, path, raw, mode)

    def list(self, path: str = "/") -> list[FileEntry]:
        return self._sb._backend.list_files(self._sb.id, path)

    def stat(self, path: str) -> FileEntry:
        return self._sb._backend.stat_file(self._sb.id, path)

    def exists(self, path: str) -> bool:
        try:
            self.stat(path)
            return True
        except FileOpError:
            return False

    def mkdir(self, path: str) -> None:
        self._sb._backend.mkdir(self._sb.id, path)

    def remove(self, path: str) -> None:
        self._sb._backend.remove_file(self._sb.id, path)

    def watch(self, path: str, recursive: bool = False) -> WatchHandle:
        """Watch a directory: `read()` the changes (create, write, remove, rename, chmod) as they happen;
        close the handle when done. Backends that cannot watch raise NotSupported."""
        return self._sb._backend.watch_dir(self._sb.id, path, recursive)

    def upload(self, dest_dir: str, src: str | os.PathLike | bytes) -> int:
        """Upload a local file/directory (or raw tar bytes) into `dest_dir`; returns entries written."""
        return self._sb._backend.upload_tar(self._sb.id, dest_dir, tar_of(src))

    def download(self, path: str, dest: str | os.PathLike | None = None,
                 max_bytes: int = DEFAULT_DOWNLOAD_MAX) -> bytes:
        """A tar of `path` (at most `max_bytes` of file content); extracted into local `dest` when given."""
        data = self._sb._backend.download_tar(self._sb.id, path, max_bytes)
        if dest is not None:
            with tarfile.open(fileobj=io.BytesIO(data)) as tf:
                tf.extractall(dest, filter="data")
        return data


# ---------------------------------------------------------------------------------------- sandbox
def _backend_for(backend: str, url: str | None, api_key: str | None,
                 root: str | os.PathLike | None) -> tuple[SandboxBackend, str | None]:
    """(where the sandbox runs, the isolation backend named in the create request)."""
    if backend == LOCAL:  # in this process, default isolation
        return open_backend(LOCAL, api_key, root), None
    return open_backend(url, api_key, root), backend


class Sandbox:
    """A sandbox, on whichever backend holds it."""

    id: str
    commands: Commands
    files: Files
    sessions: Sessions
    desktop: Desktop

    def __init__(self, backend: SandboxBackend, info: SandboxInfo):
        self._backend = backend
        self._info = info
        self.id = info.id
        self.commands = Commands(self)
        self.files = Files(self)
        self.sessions = Sessions(self)
        self.desktop = Desktop(self)  # computer use: sdk/desktop.py

    @classmethod
    def create(cls, image: str | None = None, *, layers: list[str] | None = None, cpu: float | None = None,
               memory_mb: int | None = None, disk_mb: int | None = None, pids: int | None = None,
               upper: UpperKind | None = None, ttl: float | None = None, idle_ttl: float | None = None,
               env: dict[str, str] | None = None, hostname: str | None = None, workdir: str | None = None,
               from_snapshot: str | SnapshotInfo | None = None, backend: str = "container",
               root: str | os.PathLike | None = None, url: str | None = None,
               api_key: str | None = None, oom_kill: OomKill | None = None, ksm: bool = False, aslr: bool = True,
               priority: Priority = "normal", memory_cgroup: MemoryCgroup | None = None,
               memory_pool: str | None = None) -> Sandbox:
        """Create a sandbox from an image (name[:tag]) and/or layers composed on top, bottom -> top,
        or restore a snapshot (`from_snapshot=` id or SnapshotInfo) as a new sandbox.

        ttl: absolute lifetime in seconds from now; idle_ttl: seconds without any request (a running
        foreground command counts as activity). Either ends the sandbox and frees it. Limits left
        out take the host's defaults. backend: the isolation ("container", "gvisor"), or "local" for
        a container in this process (root only). url / api_key (or $SHOAL_URL / $SHOAL_API_KEY):
        which shoald; url="local" runs in this process. oom_kill: what running out of memory ends,
        "command" (it reports oom_killed) or "sandbox" (later calls raise SandboxOutOfMemory).

        Density (docs/ksm-and-scheduling.md): ksm=True merges identical pages with other ksm
        sandboxes (a side channel between them: opt in only among sandboxes that may share one);
        aslr=False lays identical programs out identically, which is what lets KSM merge them;
        priority="idle" runs the sandbox only on CPU time no normal sandbox wants; memory_cgroup="pooled"
        shares a memory cgroup with other pooled sandboxes of the same `memory_pool` key (docs/density.md,
        "Pooled memory cgroups"; shoald sets the key to the calling tenant)."""
        be, isolation = _backend_for(backend, url, api_key, root)
        snap = from_snapshot.id if isinstance(from_snapshot, SnapshotInfo) else from_snapshot
        req = _model(CreateRequest, image=image, layers=layers, from_snapshot=snap, backend=isolation, cpu=cpu,
                     memory_mb=memory_mb, disk_mb=disk_mb, pids=pids, upper=upper, ttl=ttl, idle_ttl=idle_ttl,
                     env=env, hostname=hostname, workdir=workdir, oom_kill=oom_kill, ksm=ksm, aslr=aslr,
                     priority=priority, memory_cgroup=memory_cgroup, memory_pool=memory_pool)
        return cls(be, be.create(req))

    @classmethod
    def connect(cls, sandbox_id: str, *, root: str | os.PathLike | None = None, url: str | None = None,
                api_key: str | None = None) -> Sandbox:
        be = open_backend(url, api_key, root)
        return cls(be, be.info(sandbox_id))

    @property
    def backend(self) -> SandboxBackend:
        """The backend this sandbox lives on (a client of shoald, or this host in-process)."""
        return self._backend

    def info(self) -> SandboxInfo:
        self._info = self._backend.info(self.id)
        return self._info

    def is_running(self) -> bool:
        try:
            return self.info().state != SandboxState.DEAD
        except ShoalError:
            return False

    def pause(self) -> None:
        """Freeze every process. Any later request resumes transparently."""
        self._backend.pause(self.id)

    def resume(self) -> None:
        self._backend.resume(self.id)

    def reclaim(self, target: float = 0.75) -> ReclaimResult:
        """Push `target` (a fraction in (0, 1]) of the sandbox's anonymous memory to compressed swap;
        it comes back on demand. Frozen meanwhile; a paused sandbox stays paused."""
        return self._backend.reclaim(self.id, _model(ReclaimRequest, target=target))

    def set_timeout(self, ttl: float | None = None, idle_ttl: float | None = None) -> None:
        """Replace both lifetimes (ttl counts from now; None clears)."""
        self._info = self._backend.set_ttl(self.id, _model(TimeoutRequest, ttl=ttl, idle_ttl=idle_ttl))

    def kill(self) -> None:
        self._backend.kill(self.id)

    def set_network(self, allow: list[str] | None = None, presets: dict[str, bool] | None = None) -> NetworkPolicy:
        """Replace the egress allow rules ("CIDR", "IP[:port]", "host:port", presets like
        {"pypi": True}); anything left out is cleared. With no rules the sandbox has no egress."""
        return self._backend.set_network(self.id, _model(NetworkRequest, allow=allow, presets=presets))

    def get_network(self) -> NetworkPolicy:
        return self._backend.get_network(self.id)

    def connect_port(self, port: int, timeout: float = PORT_CONNECT_TIMEOUT) -> socket.socket:
        """A TCP connection to 127.0.0.1:`port` inside the sandbox (a server it runs), though the
        sandbox has no network: yours to use and close. Nothing listening is a SandboxError."""
        return self._backend.connect_port(self.id, port, timeout)

    def port_sockets(self, port: int) -> list[PortSocket]:
        """The TCP sockets on local `port` inside the sandbox that its processes hold, and which
        programs hold them (SandboxBackend.port_sockets)."""
        return self._backend.port_sockets(self.id, port)

    def guard_port(self, port: int) -> None:
        """Only `connect_port` reaches `port` from now on; the sandbox's own processes are refused."""
        self._backend.guard_port(self.id, port)

    def port_guarded(self, port: int) -> bool:
        return self._backend.port_guarded(self.id, port)

    def written_under(self, paths: list[str], limit: int = 20) -> list[str]:
        """Paths at or below `paths` that the sandbox wrote, replaced or removed (no longer its image's)."""
        return self._backend.written_under(self.id, paths, limit)

    def snapshot(self, exclude: list[str] | None = None) -> SnapshotInfo:
        """pack_diff: capture the writable upper (processes frozen meanwhile) as a new layer on top of
        this sandbox's stack. Restore with `Sandbox.create(from_snapshot=snap)` or `fork()`.
        Filesystem state only: running processes are not captured."""
        return self._backend.snapshot(self.id, _model(SnapshotRequest, exclude=exclude))

    def fork(self, n: int, *, copy_env: bool = False, inherit_ttl: bool = False, exclude: list[str] | None = None,
             cpu: float | None = None, memory_mb: int | None = None, disk_mb: int | None = None,
             pids: int | None = None, upper: UpperKind | None = None, ttl: float | None = None,
             idle_ttl: float | None = None, env: dict[str, str] | None = None) -> ForkResult:
        """n new sandboxes sharing one snapshot of this one read-only, each with its own upper.

        Children get new ids, hostnames and /etc/machine-id, this sandbox's limits unless given, its
        env only if copy_env, its TTLs only if inherit_ttl; processes are not carried over.
        Failures are per child."""
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise InvalidArgument(f"fork needs n >= 1, got {n!r}")
        req = _model(ForkRequest, n=n, copy_env=copy_env, inherit_ttl=inherit_ttl, exclude=exclude, cpu=cpu,
                     memory_mb=memory_mb, disk_mb=disk_mb, pids=pids, upper=upper, ttl=ttl, idle_ttl=idle_ttl,
                     env=env)
        from ..core import errors as E

        reply = self._backend.fork(self.id, req)
        return ForkResult(snapshot=reply.snapshot,
                          sandboxes=[Sandbox(self._backend, info) for info in reply.sandboxes],
                          failed=[(f.index, E.from_wire(f.model_dump())) for f in reply.failed])

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.kill()
        except ShoalError:
            pass

    def __repr__(self) -> str:
        return f"Sandbox({self.id}, image={self._info.image!r}, backend={self._backend.name})"

    # last in the class body: a method named `list` shadows the builtin in the annotations after it
    @classmethod
    def list(cls, *, root: str | os.PathLike | None = None, url: str | None = None,
             api_key: str | None = None) -> list[SandboxInfo]:
        """Live sandboxes on the backend (a tenant sees only its own)."""
        return open_backend(url, api_key, root).list()


@dataclass
class ForkResult:
    """What fork(n) produced: the shared snapshot, the children that started, the ones that did not."""

    snapshot: SnapshotInfo
    sandboxes: list[Sandbox] = field(default_factory=list)
    failed: list[tuple[int, BaseException]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failed

    def kill_all(self) -> None:
        for sb in self.sandboxes:
            try:
                sb.kill()
            except ShoalError:
                pass
