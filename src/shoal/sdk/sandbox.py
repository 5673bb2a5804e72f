"""The synchronous SDK: `shoal.Sandbox` with `commands`, `files` and `sessions` sub-objects.

    with Sandbox.create("demo:latest", memory_mb=256, ttl=600) as sb:
        r = sb.commands.run("echo hi")
        sb.files.write("/work/x.py", "print(1)")
        with sb.sessions.create() as sh:
            sh.run("cd /work"); sh.run("python3 x.py")

`shoal.AsyncSandbox` (async_sandbox.py) mirrors this class method for method.
"""
from __future__ import annotations

import io
import os
import queue
import re
import secrets
import selectors
import tarfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from ..core.errors import CommandTimeout, InvalidArgument, SessionClosed
from ..host import Host
from ..core.contract import ExecRequest, ExecResult, FileEntry, SandboxInfo, SandboxState, SnapshotInfo
from ..backends.container import initclient
from .args import BACKEND_ARGS, BackendArgs, ContainerArgs

Cmd = str | list[str]


def _argv(cmd: Cmd) -> list[str]:
    if isinstance(cmd, str):
        if not cmd.strip():
            raise InvalidArgument("empty command")
        return ["/bin/sh", "-c", cmd]
    if not cmd:
        raise InvalidArgument("empty argv")
    return list(cmd)


# ---------------------------------------------------------------------------------------- commands
@dataclass
class OutputEvent:
    stream: str  # "stdout" | "stderr"
    text: str


@dataclass
class BackgroundOutput:
    stdout: str
    stderr: str
    cursor: tuple[int, int]  # pass back as `since` to get only newer output
    lost_bytes: int  # output that fell out of the ring buffer before it was read


class CommandHandle:
    """A background command: poll it, read its output since a cursor, wait for it, kill it."""

    def __init__(self, proc: initclient.Process, ring_bytes: int, argv: list[str]):
        self._proc = proc
        self.argv = argv
        self._out, self._err = initclient.RingLog(ring_bytes), initclient.RingLog(ring_bytes)
        self._done = threading.Event()
        self._pump = threading.Thread(target=self._run, name=f"shoal-bg-{proc.sandbox_id}", daemon=True)
        self._pump.start()
        deadline = time.monotonic() + 5
        while self._proc.pid is None and not self._done.is_set() and time.monotonic() < deadline:
            time.sleep(0.0005)

    def _run(self) -> None:
        p = self._proc
        sel = selectors.DefaultSelector()
        sel.register(p.sock, selectors.EVENT_READ, None)
        sel.register(p.out_r, selectors.EVENT_READ, self._out)
        sel.register(p.err_r, selectors.EVENT_READ, self._err)
        streams = 2
        try:
            while streams or p.status is None:
                for key, _ in sel.select(0.2 if p.status is not None else None):
                    if key.data is None:
                        if not p.handle_control():
                            sel.unregister(p.sock)
                            if p.status is None:
                                p.status = 137 << 8
                        continue
                    data = os.read(key.fd, 65536)
                    if not data:
                        sel.unregister(key.fd)
                        streams -= 1
                    else:
                        key.data.add(data)
                if p.status is not None and streams:
                    # exited; give a lingering daemon's pipes 200 ms, then stop reading
                    for key, _ in sel.select(0.2):
                        if key.data is not None:
                            data = os.read(key.fd, 65536)
                            if data:
                                key.data.add(data)
                    break
        finally:
            sel.close()
            p.close_pipes()  # a finished command keeps only its control socket
            self._done.set()

    @property
    def pid(self) -> int | None:
        """The pid inside the sandbox."""
        return self._proc.pid

    def poll(self) -> int | None:
        """Exit code, or None while running."""
        if not self._done.is_set():
            return None
        return initclient._decode_status(self._proc.status)[0]  # type: ignore[arg-type]

    def output(self, since: tuple[int, int] = (0, 0)) -> BackgroundOutput:
        out, c1, l1 = self._out.since(since[0])
        err, c2, l2 = self._err.since(since[1])
        return BackgroundOutput(out.decode("utf-8", "replace"), err.decode("utf-8", "replace"), (c1, c2), l1 + l2)

    def wait(self, timeout: float | None = None) -> ExecResult:
        if not self._done.wait(timeout):
            raise CommandTimeout(f"background command {self.argv!r} still running after {timeout} s")
        code, sig = initclient._decode_status(self._proc.status)  # type: ignore[arg-type]
        o = self.output()
        return ExecResult(exit_code=code, signal=sig, stdout=o.stdout, stderr=o.stderr,
                          stdout_bytes=self._out.end, stderr_bytes=self._err.end,
                          stdout_truncated=self._out.start > 0, stderr_truncated=self._err.start > 0,
                          timed_out=self._proc.timed_out, duration_s=time.monotonic() - self._proc.started)

    def kill(self, sig: int = 9) -> None:
        self._proc.signal(sig)

    def close(self) -> None:
        """Stop tracking; the command is killed if still running."""
        self._proc.close()


class Commands:
    def __init__(self, sb: "Sandbox"):
        self._sb = sb

    def run(self, cmd: Cmd, *, cwd: str | None = None, env: dict[str, str] | None = None, timeout: float | None = 60.0,
            stdin: bytes | str | None = None, on_stdout: Callable[[str], None] | None = None,
            on_stderr: Callable[[str], None] | None = None, output_cap: int | None = None,
            check: bool = False, background: bool = False) -> ExecResult:
        """Run a command to completion. A string runs under /bin/sh -c; a list is an argv.

        On timeout the command's process group is killed and the result has timed_out=True
        (or CommandTimeout is raised with check=True). `background=True` is `start()` (E2B style)
        and returns a CommandHandle instead."""
        if background:
            return self.start(cmd, cwd=cwd, env=env, timeout=timeout)  # type: ignore[return-value]
        try:
            req = ExecRequest(argv=_argv(cmd), cwd=cwd or self._sb._info.workdir, env=env or {}, timeout=timeout,
                              stdin=stdin.encode() if isinstance(stdin, str) else stdin,
                              output_cap=output_cap or self._sb._host.settings.output_cap_bytes)
        except ValidationError as e:
            from ..host import _describe

            raise InvalidArgument(_describe(e)) from None
        result = self._sb._rt.exec(self._sb.id, req, on_stdout=on_stdout, on_stderr=on_stderr)
        if check and result.timed_out:
            raise CommandTimeout(f"{cmd!r} timed out after {timeout} s in sandbox {self._sb.id}", result)
        if check and result.exit_code != 0:
            from ..core.errors import SandboxError

            raise SandboxError(f"{cmd!r} exited with {result.exit_code} in sandbox {self._sb.id}: "
                               f"{result.stderr[-500:]}")
        return result

    def start(self, cmd: Cmd, *, cwd: str | None = None, env: dict[str, str] | None = None,
              timeout: float | None = None, ring_bytes: int = 1 << 20) -> CommandHandle:
        """Start a background command; output is kept in a ring buffer of `ring_bytes` per stream."""
        argv = _argv(cmd)
        proc = self._sb._rt.spawn(self._sb.id, argv, env=env, cwd=cwd or self._sb._info.workdir, timeout=timeout)
        return CommandHandle(proc, ring_bytes, argv)

    def stream(self, cmd: Cmd, **kw) -> Iterator[OutputEvent | ExecResult]:
        """Yield OutputEvents as the command writes, then its ExecResult last."""
        q: queue.Queue = queue.Queue()
        box: dict = {}

        def work():
            try:
                box["r"] = self.run(cmd, on_stdout=lambda t: q.put(OutputEvent("stdout", t)),
                                    on_stderr=lambda t: q.put(OutputEvent("stderr", t)), **kw)
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
class Session:
    """A long-lived shell in the sandbox: cwd, env and shell variables persist between run() calls.

    Each command is sent as `command eval '<cmd>'` followed by a random end marker, so a syntax
    error in one command cannot kill the shell; stdin of the command is /dev/null."""

    def __init__(self, sb: "Sandbox", shell: str | None = None, cwd: str | None = None,
                 env: dict[str, str] | None = None, output_cap: int | None = None):
        self._sb = sb
        if shell is None:
            shell = "/bin/bash" if sb.files.exists("/bin/bash") else "/bin/sh"
        self.shell = shell
        self._cap = output_cap or sb._host.settings.output_cap_bytes
        self._proc = sb._rt.spawn(sb.id, [shell], env=env, cwd=cwd or sb._info.workdir, stdin_pipe=True)
        self._touch = bool(sb._info.idle_ttl)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._proc.out_r, selectors.EVENT_READ, "out")
        self._sel.register(self._proc.err_r, selectors.EVENT_READ, "err")
        self._sel.register(self._proc.sock, selectors.EVENT_READ, "ctl")
        self.closed = False
        self.exit_code: int | None = None

    def _write(self, data: bytes) -> None:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._proc.stdin_w, view):]
        except BrokenPipeError:
            self._mark_closed()
            raise SessionClosed(f"session shell in sandbox {self._sb.id} has exited") from None

    def _mark_closed(self) -> None:
        self.closed = True

    def run(self, cmd: str, timeout: float | None = 60.0) -> ExecResult:
        if self.closed:
            raise SessionClosed(f"session in sandbox {self._sb.id} is closed")
        if not isinstance(cmd, str):
            raise InvalidArgument("session commands are shell strings")
        nonce = secrets.token_hex(8)
        out_marker = re.compile(rb"__SHOAL_" + nonce.encode() + rb"_(\d+)__\n")
        err_marker = b"__SHOAL_" + nonce.encode() + b"__\n"
        quoted = "'" + cmd.replace("'", "'\\''") + "'"
        script = (f"command eval {quoted} </dev/null\n__shoal_rc=$?\n"
                  f"printf '__SHOAL_{nonce}_%d__\\n' \"$__shoal_rc\"\nprintf '__SHOAL_{nonce}__\\n' >&2\n")
        self._sb._rt.ensure_running(self._sb.id)  # a paused sandbox resumes, as for any request
        if self._touch:
            self._proc.touch(True)
        started = time.monotonic()
        self._write(script.encode("utf-8", "surrogateescape"))
        bufs = {"out": initclient.CappedBuffer(self._cap), "err": initclient.CappedBuffer(self._cap)}
        wins = {"out": b"", "err": b""}
        done = {"out": None, "err": False}
        timed_out = False
        deadline = None if timeout is None else started + timeout
        try:
            while done["out"] is None or not done["err"]:
                now = time.monotonic()
                if deadline is not None and now > deadline:
                    if timed_out:  # the shell itself is stuck: give up on this session
                        self.close()
                        raise CommandTimeout(f"session command {cmd!r} timed out and the shell did not recover")
                    timed_out = True
                    self._proc.signal(9, initclient.SIG_MODE_EXCEPT_LEADER)
                    deadline = now + 5.0
                events = self._sel.select(None if deadline is None else max(0.0, deadline - now))
                for key, _ in events:
                    if key.data == "ctl":
                        if not self._proc.handle_control() or self._proc.status is not None:
                            if self._proc.status is not None:
                                self.exit_code = initclient._decode_status(self._proc.status)[0]
                            self.closed = True
                            self._sel.unregister(self._proc.sock)
                        continue
                    data = os.read(key.fd, 65536)
                    if not data:
                        self.closed = True
                        raise SessionClosed(f"session shell in sandbox {self._sb.id} exited "
                                            f"(did the command run `exit`?)")
                    tag = key.data
                    bufs[tag].add(data)
                    wins[tag] = (wins[tag] + data)[-256:]
                    if tag == "out":
                        m = out_marker.search(wins[tag])
                        if m:
                            done["out"] = int(m.group(1))
                    elif err_marker in wins[tag]:
                        done["err"] = True
        finally:
            if self._touch:
                self._proc.touch(False)
        stdout = out_marker.sub(b"", bufs["out"].value(), count=1)
        stderr = bufs["err"].value().replace(err_marker, b"", 1)
        marker_len = len(b"__SHOAL_") + len(nonce) + len(b"_") + len(b"__\n")
        result = ExecResult(
            exit_code=137 if timed_out else done["out"], signal=9 if timed_out else None, timed_out=timed_out,
            stdout=stdout.decode("utf-8", "replace"), stderr=stderr.decode("utf-8", "replace"),
            stdout_bytes=bufs["out"].total - marker_len - len(str(done["out"])),
            stderr_bytes=bufs["err"].total - len(err_marker),
            stdout_truncated=bufs["out"].truncated, stderr_truncated=bufs["err"].truncated,
            duration_s=time.monotonic() - started)
        return result

    def close(self) -> None:
        if not self.closed:
            self.closed = True
        try:
            self._sel.close()
        finally:
            self._proc.close()  # kill-on-close: the shell and its process group go away

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Sessions:
    def __init__(self, sb: "Sandbox"):
        self._sb = sb

    def create(self, shell: str | None = None, cwd: str | None = None, env: dict[str, str] | None = None) -> Session:
        return Session(self._sb, shell=shell, cwd=cwd, env=env)


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

    def __init__(self, sb: "Sandbox"):
        self._sb = sb

    def _f(self):
        sb = self._sb
        if sb._info.idle_ttl:
            sb._rt.touch(sb.id)
        return sb._rt.files(sb.id)

    def read(self, path: str, encoding: str = "utf-8") -> str:
        return self._f().read(path).decode(encoding, "replace")

    def read_bytes(self, path: str, max_bytes: int = 64 << 20) -> bytes:
        return self._f().read(path, max_bytes=max_bytes)

    def write(self, path: str, data: str | bytes, mode: int = 0o644) -> int:
        return self._f().write(path, data, mode=mode)

    def list(self, path: str = "/") -> list[FileEntry]:
        return self._f().list(path)

    def stat(self, path: str) -> FileEntry:
        return self._f().stat(path)

    def exists(self, path: str) -> bool:
        return self._f().exists(path)

    def mkdir(self, path: str) -> None:
        self._f().mkdir(path, parents=True)

    def remove(self, path: str) -> None:
        self._f().remove(path)

    def upload(self, dest_dir: str, src: str | os.PathLike | bytes) -> int:
        """Upload a local file/directory (or raw tar bytes) into `dest_dir`; returns entries written."""
        return self._f().upload(dest_dir, tar_of(src))

    def download(self, path: str, dest: str | os.PathLike | None = None, max_bytes: int = 1 << 30) -> bytes:
        """A tar of `path` (at most `max_bytes` of file content); extracted into local `dest` when given."""
        data = self._f().download(path, max_bytes=max_bytes)
        if dest is not None:
            with tarfile.open(fileobj=io.BytesIO(data)) as tf:
                tf.extractall(dest, filter="data")
        return data


# ---------------------------------------------------------------------------------------- sandbox
class Sandbox:
    """A running sandbox on this host."""

    def __init__(self, host: Host, info: SandboxInfo):
        self._host = host
        self._rt = host.runtime
        self._info = info
        self.id = info.id
        self.commands = Commands(self)
        self.files = Files(self)
        self.sessions = Sessions(self)

    @classmethod
    def create(cls, image: str | None = None, *, layers: list[str] | None = None, cpu: float | None = None,
               memory_mb: int | None = None, disk_mb: int | None = None, pids: int | None = None,
               ttl: float | None = None, idle_ttl: float | None = None, env: dict[str, str] | None = None,
               backend: str = "container", args: BackendArgs | None = None,
               from_snapshot: "str | SnapshotInfo | None" = None,
               root: str | os.PathLike | None = None, url: str | None = None,
               api_key: str | None = None) -> "Sandbox":
        """Create a sandbox from an image (name[:tag]) and/or layers composed on top, bottom -> top,
        or restore a snapshot (`from_snapshot=` id or SnapshotInfo) as a new sandbox.

        ttl: absolute lifetime in seconds from now; idle_ttl: seconds without any request (a
        running foreground command counts as activity). Either ends the sandbox and frees it.

        url / api_key (or $SHOAL_URL / $SHOAL_API_KEY): create it through a shoald instead of
        in-process; "local" means this host's daemon socket. The result has the same methods."""
        client = _client(url, api_key, root)
        if client is not None:
            from .remote import RemoteSandbox

            if args is not None or backend != "container":
                raise InvalidArgument("through shoald, give limits as keywords (cpu=, memory_mb=, ...)")
            return RemoteSandbox.create_remote(client, image=image, layers=layers, from_snapshot=from_snapshot,
                                               cpu=cpu, memory_mb=memory_mb, disk_mb=disk_mb, pids=pids, ttl=ttl,
                                               idle_ttl=idle_ttl, env=env)
        host = Host.get(root)
        if from_snapshot is not None:
            if image is not None:
                raise InvalidArgument("give either image= or from_snapshot=, not both")
            image = _snapshot_image(from_snapshot)
        args = _merge_args(backend, args, cpu=cpu, memory_mb=memory_mb, disk_mb=disk_mb, pids=pids,
                           settings=host.settings)
        info = host.create_sandbox(image, layers, args.limits(), ttl=ttl, idle_ttl=idle_ttl, env=env,
                                   hostname=getattr(args, "hostname", None), backend=backend)
        return cls(host, info)

    @classmethod
    def connect(cls, sandbox_id: str, root: str | os.PathLike | None = None, url: str | None = None,
                api_key: str | None = None) -> "Sandbox":
        client = _client(url, api_key, root)
        if client is not None:
            from .remote import connect_remote

            return connect_remote(sandbox_id, client)
        host = Host.get(root)
        return cls(host, host.runtime.info(sandbox_id))

    @classmethod
    def list(cls, root: str | os.PathLike | None = None, url: str | None = None,
             api_key: str | None = None) -> list[SandboxInfo]:
        client = _client(url, api_key, root)
        if client is not None:
            from .remote import list_remote

            return list_remote(client)
        return Host.get(root).runtime.list()

    def info(self) -> SandboxInfo:
        self._info = self._rt.info(self.id)
        return self._info

    def is_running(self) -> bool:
        try:
            return self.info().state != SandboxState.DEAD
        except Exception:
            return False

    def pause(self) -> None:
        """Freeze every process (cgroup freezer). Any later request resumes transparently."""
        self._rt.pause(self.id)

    def resume(self) -> None:
        self._rt.resume(self.id)

    def set_timeout(self, ttl: float | None = None, idle_ttl: float | None = None) -> None:
        """Replace both lifetimes (ttl counts from now; None clears)."""
        self._rt.set_ttl(self.id, ttl, idle_ttl)
        self._info = self._rt.info(self.id)

    def kill(self) -> None:
        self._rt.kill(self.id)

    def set_network(self, allow: list[str] | None = None, presets: dict[str, bool] | None = None) -> dict:
        """Replace the egress allow rules ("CIDR", "IP[:port]", "host:port", presets like
        {"pypi": True}); anything left out is cleared. With no rules the sandbox has no egress."""
        return self._rt.set_network(self.id, allow, presets)

    def get_network(self) -> dict:
        return self._rt.get_network(self.id)

    def snapshot(self, exclude: list[str] | None = None) -> SnapshotInfo:
        """pack_diff: capture the writable upper (processes frozen meanwhile) as a new layer on top of
        this sandbox's stack. Restore with `Sandbox.create(from_snapshot=snap)` or `fork()`.
        Filesystem state only: running processes are not captured."""
        return self._host.snapshot(self.id, exclude=exclude)

    def fork(self, n: int, *, copy_env: bool = False, inherit_ttl: bool = False,
             exclude: list[str] | None = None, **create_kw) -> "ForkResult":
        """n new sandboxes sharing one snapshot of this one read-only, each with its own upper.

        Children get new ids, hostnames and /etc/machine-id; this sandbox's env only if copy_env,
        its TTLs only if inherit_ttl; processes are not carried over. Failures are per child."""
        if not isinstance(n, int) or n <= 0:
            raise InvalidArgument(f"fork needs n >= 1, got {n!r}")
        snap = self.snapshot(exclude=exclude)
        info = self._info
        kw = dict(create_kw)
        if copy_env:
            kw["env"] = {**info.env, **kw.get("env", {})}
        if inherit_ttl:
            remaining = None if info.ttl is None else max(0.001, info.created + info.ttl - time.time())
            kw.setdefault("ttl", remaining)
            kw.setdefault("idle_ttl", info.idle_ttl)
        kw.setdefault("memory_mb", info.limits.memory_mb)
        kw.setdefault("cpu", info.limits.cpu)
        kw.setdefault("disk_mb", info.limits.disk_mb)
        kw.setdefault("pids", info.limits.pids)
        if info.limits.upper != "tmpfs" and kw.get("args") is None:  # children keep a disk upper
            kw["args"] = ContainerArgs(upper=info.limits.upper)
        result = ForkResult(snapshot=snap)
        for i in range(n):
            try:
                child = Sandbox.create(from_snapshot=snap, root=self._host.settings.root, url=EMBEDDED, **kw)
                child.files.write("/etc/machine-id", secrets.token_hex(16) + "\n", mode=0o444)
                result.sandboxes.append(child)
            except Exception as e:  # reported per child, the others are kept
                result.failed.append((i, e))
        return result

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.kill()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"Sandbox({self.id}, image={self._info.image!r})"


EMBEDDED = "embedded"  # url value that forces in-process use even when $SHOAL_URL is set


_clients: dict[tuple, object] = {}
_clients_lock = threading.Lock()


def _client(url: str | None, api_key: str | None, root):
    """A shoald client when a URL is given (or $SHOAL_URL is set), else None (in-process).
    Clients are shared per (url, key, root) so sandboxes reuse one connection pool."""
    url = url or os.environ.get("SHOAL_URL")
    if not url or url == EMBEDDED:
        return None
    from .remote import Client

    key = (url, api_key or os.environ.get("SHOAL_API_KEY"), str(root))
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            client = _clients[key] = Client(url, api_key, root)
        return client


def close_clients() -> None:
    """Close the shared shoald connection pools (the next remote call opens a fresh one)."""
    with _clients_lock:
        clients = list(_clients.values())
        _clients.clear()
    for c in clients:
        c.http.close()  # type: ignore[attr-defined]


@dataclass
class ForkResult:
    """What fork(n) produced: the shared snapshot, the children that started, the ones that did not."""

    snapshot: SnapshotInfo
    sandboxes: list["Sandbox"] = field(default_factory=list)
    failed: list[tuple[int, BaseException]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failed

    def kill_all(self) -> None:
        for sb in self.sandboxes:
            try:
                sb.kill()
            except Exception:
                pass


def _snapshot_image(snap: "str | SnapshotInfo") -> str:
    sid = snap.id if isinstance(snap, SnapshotInfo) else snap
    if not isinstance(sid, str) or not re.fullmatch(r"snap-[0-9a-f]{12}", sid):
        raise InvalidArgument(f"not a snapshot id: {sid!r} (expected snap-<12 hex>)")
    return f"snapshots/{sid}:latest"


def _merge_args(backend: str, args: BackendArgs | None, settings, **kw) -> BackendArgs:
    cls = BACKEND_ARGS.get(backend)
    if cls is None:
        raise InvalidArgument(f"unknown backend {backend!r}; choose one of: {', '.join(BACKEND_ARGS)}")
    if args is not None and not isinstance(args, cls):
        raise InvalidArgument(f"backend {backend!r} takes {cls.__name__}, got {type(args).__name__}")
    if backend != "container":
        from ..core.errors import BackendUnavailable

        raise BackendUnavailable(f"backend {backend!r} is not available on this host yet; use backend='container'")
    base = args or ContainerArgs(cpu=settings.default_cpu, memory_mb=settings.default_memory_mb,
                                 disk_mb=settings.default_disk_mb, pids=settings.default_pids)
    if not isinstance(base, ContainerArgs):
        raise InvalidArgument(f"backend {backend!r} takes ContainerArgs, got {type(base).__name__}")
    overrides = {k: v for k, v in kw.items() if v is not None}
    bad = {k: v for k, v in overrides.items() if v <= 0}
    if bad:
        raise InvalidArgument(", ".join(f"{k} must be > 0, got {v}" for k, v in bad.items()))
    return base.model_copy(update=overrides)
