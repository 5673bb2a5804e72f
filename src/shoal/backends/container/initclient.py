"""Client side of the shoal-init control protocol (see native/shoal_init.c for the wire format).

Each command gets its own SOCK_SEQPACKET connection to the sandbox's init. The host creates the
pipes, passes one end of each to init with SCM_RIGHTS and reads output itself, so a command's
output never goes through init and never lands on disk. Output kept in memory is capped per
stream (head and tail kept, the middle counted and dropped), so `yes` cannot blow up the host.
"""
from __future__ import annotations

import errno
import fcntl
import os
import selectors
import socket
import struct
import termios
import threading
import time
from array import array
from collections.abc import Callable

from ...core.contract import ExecResult, check_seconds, to_ms
from ...core.errors import CommandTimeout, InvalidArgument, SandboxError, SandboxNotFound

MAX_REQUEST = 200 * 1024
FLAG_KILL_ON_CLOSE = 1
FLAG_BUSY = 2
FLAG_EXT = 4  # the exec header is followed by the PTY size and the user ids (init's `struct exec_ext`)
MAX_GROUPS = 64
SIG_MODE_GROUP = 0
SIG_MODE_EXCEPT_LEADER = 1


class SandboxGone(SandboxError):
    """The control connection closed before the command's exit was reported (sandbox ended)."""


class CappedBuffer:
    """Keeps the first and last `cap/2` bytes of a stream and counts everything."""

    def __init__(self, cap: int):
        self.cap = max(cap, 2)
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        half = self.cap // 2
        room = half - len(self.head) if self.total - len(data) < half else 0
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > self.cap - half:
                del self.tail[: len(self.tail) - (self.cap - half)]

    @property
    def truncated(self) -> bool:
        return self.total > len(self.head) + len(self.tail)

    def value(self) -> bytes:
        if not self.truncated:
            return bytes(self.head + self.tail)
        dropped = self.total - len(self.head) - len(self.tail)
        return bytes(self.head) + f"\n[... {dropped} bytes truncated by shoal ...]\n".encode() + bytes(self.tail)


class RingLog:
    """A bounded log with absolute byte cursors, for background commands (`output(since=...)`)."""

    def __init__(self, cap: int):
        self.cap = cap
        self.buf = bytearray()
        self.start = 0  # absolute offset of buf[0]
        self.lock = threading.Lock()

    def add(self, data: bytes) -> None:
        with self.lock:
            self.buf += data
            if len(self.buf) > self.cap:
                cut = len(self.buf) - self.cap
                del self.buf[:cut]
                self.start += cut

    @property
    def end(self) -> int:
        return self.start + len(self.buf)

    def since(self, cursor: int) -> tuple[bytes, int, int]:
        """(data from cursor, new cursor, bytes lost before the window because the log wrapped)."""
        with self.lock:
            lost = max(0, self.start - cursor)
            off = max(cursor, self.start) - self.start
            return bytes(self.buf[off:]), self.end, lost


class Ids:
    """Who a command runs as: uid, primary gid and supplementary groups (resolved by the caller)."""

    def __init__(self, uid: int, gid: int, groups: list[int] | None = None):
        if not (0 <= uid < 1 << 31 and 0 <= gid < 1 << 31):
            raise InvalidArgument(f"uid and gid must be in [0, 2^31), got {uid}:{gid}")
        groups = sorted(set(groups or [gid]))
        if len(groups) > MAX_GROUPS or any(not 0 <= g < 1 << 31 for g in groups):
            raise InvalidArgument(f"at most {MAX_GROUPS} groups in [0, 2^31)")
        self.uid, self.gid, self.groups = uid, gid, groups


def encode_ext(pty: tuple[int, int] | None, ids: Ids | None) -> bytes:
    rows, cols = pty or (0, 0)
    if not (0 <= rows < 1 << 16 and 0 <= cols < 1 << 16) or (rows == 0) != (cols == 0):
        raise InvalidArgument(f"bad PTY size {rows}x{cols}")
    uid, gid, groups = (ids.uid, ids.gid, ids.groups) if ids else (-1, -1, [])
    return struct.pack(f"<HHiiI{len(groups)}I", rows, cols, uid, gid, len(groups), *groups)


def encode_exec(argv: list[str], env: dict[str, str], cwd: str, timeout: float | None, flags: int,
                pty: tuple[int, int] | None = None, ids: Ids | None = None) -> bytes:
    strs = [cwd] + argv + [f"{k}={v}" for k, v in env.items()]
    for s in strs:
        if "\0" in s:
            raise InvalidArgument("command, cwd and env may not contain NUL bytes")
    for k in env:
        if not k or "=" in k:
            raise InvalidArgument(f"invalid environment variable name {k!r}")
    timeout_ms = to_ms(check_seconds("timeout", timeout))
    try:
        body = b"".join(s.encode("utf-8", "surrogateescape") + b"\0" for s in strs)
    except UnicodeEncodeError as e:
        raise InvalidArgument(f"command, cwd and env must be valid Unicode: {e}") from None
    ext = b""
    if pty is not None or ids is not None:
        flags |= FLAG_EXT
        ext = encode_ext(pty, ids)
    msg = struct.pack("<BBHIII", ord("E"), flags, 0, timeout_ms, len(argv), len(env)) + ext + body
    if len(msg) > MAX_REQUEST:
        raise InvalidArgument(f"command too large ({len(msg)} bytes > {MAX_REQUEST}); upload a script file instead")
    return msg


def connect(sock_path: str, sandbox_id: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        s.connect(sock_path)
    except (FileNotFoundError, ConnectionRefusedError) as e:
        s.close()
        raise SandboxNotFound(f"sandbox {sandbox_id} is not running (no control socket)") from e
    return s


def decode_status(status: int) -> tuple[int, int | None]:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return 128 + sig, sig
    return os.WEXITSTATUS(status), None


class Process:
    """One command running in a sandbox, with its pipes and its control connection."""

    def __init__(self, sock_path: str, sandbox_id: str, argv: list[str], env: dict[str, str], cwd: str,
                 timeout: float | None, flags: int, stdin_pipe: bool, merge_stderr: bool = False,
                 pty: tuple[int, int] | None = None, ids: Ids | None = None):
        self.sandbox_id = sandbox_id
        self._close_lock = threading.Lock()
        self.pty_fd = -1  # the PTY master, when the command runs on one (init opens it in the sandbox)
        self.started = time.monotonic()
        self.pid: int | None = None
        self.status: int | None = None
        self.timed_out = False
        self.error: str | None = None
        msg = encode_exec(argv, env, cwd, timeout, flags, pty, ids)
        self.sock = connect(sock_path, sandbox_id)
        if pty is not None:
            self._start_on_pty(msg)
            return
        if stdin_pipe:
            in_r, self.stdin_w = os.pipe2(os.O_CLOEXEC)
        else:
            in_r, self.stdin_w = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC), -1
        self.out_r, out_w = os.pipe2(os.O_CLOEXEC)
        if merge_stderr:
            self.err_r, err_w = -1, out_w
        else:
            self.err_r, err_w = os.pipe2(os.O_CLOEXEC)
        try:
            self.sock.sendmsg([msg], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array("i", [in_r, out_w, err_w]))])
        except OSError as e:
            self.close()
            raise SandboxError(f"sandbox {sandbox_id}: could not send command: {e}") from e
        finally:
            os.close(in_r)
            os.close(out_w)
            if err_w != out_w:
                os.close(err_w)

    def _start_on_pty(self, msg: bytes) -> None:
        """Send the request with no fds and wait for 'S' with the master (or 'F'): the master is the
        process's stdout (reads), stdin (a dup, for writes) and where resize() applies. stderr is the
        same terminal, so there is no second stream."""
        self.err_r = -1
        try:
            self.sock.send(msg)
            self.sock.settimeout(10.0)
            try:
                self.handle_control()
            finally:
                self.sock.settimeout(None)
        except OSError as e:
            self.sock.close()
            raise SandboxError(f"sandbox {self.sandbox_id}: could not start a command on a PTY: {e}") from e
        if self.pty_fd < 0:
            self.sock.close()
            if self.status is None:
                raise SandboxError(f"sandbox {self.sandbox_id}: no PTY came back for the command")
            raise SandboxError(f"sandbox {self.sandbox_id}: {self.error or 'could not start the command on a PTY'}")
        self.out_r = self.pty_fd
        self.stdin_w = os.dup(self.pty_fd)
        os.set_inheritable(self.stdin_w, False)

    def _recv(self) -> bytes:
        """One control message; a PTY master passed with it is kept as pty_fd, any other fd closed."""
        data, anc, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(4 * 4))
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array("i")
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
                for fd in fds:
                    if self.pty_fd < 0 and data[:1] == b"S":
                        self.pty_fd = fd
                        os.set_inheritable(fd, False)
                    else:
                        os.close(fd)
        return data

    def handle_control(self) -> bool:
        """Read one control message; returns False when the connection closed."""
        try:
            data = self._recv()
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            data = b""
        if not data:
            if self.status is None:
                self.error = "the sandbox went away while the command ran"
                self.status = 137 << 8
            return False
        kind = data[:1]
        if kind == b"S":
            self.pid = struct.unpack_from("<i", data, 4)[0]
        elif kind == b"X":
            self.timed_out = bool(data[1])
            self.status = struct.unpack_from("<i", data, 4)[0]
        elif kind == b"F":
            err = struct.unpack_from("<i", data, 4)[0]
            self.error = f"{data[8:].decode(errors='replace')} ({os.strerror(err)})"
            self.status = 127 << 8
        return True

    def signal(self, sig: int, mode: int = SIG_MODE_GROUP) -> None:
        try:
            self.sock.send(struct.pack("<BBHi", ord("K"), mode, 0, sig))
        except OSError:
            pass

    def touch(self, busy: bool) -> None:
        try:
            self.sock.send(struct.pack("<BB", ord("T"), 1 if busy else 0))
        except OSError:
            pass

    def resize(self, rows: int, cols: int) -> None:
        """Set the PTY's size; the kernel sends SIGWINCH to its foreground process group."""
        if not (1 <= rows <= 1000 and 1 <= cols <= 1000):
            raise InvalidArgument(f"a PTY is 1..1000 rows and columns, got {rows}x{cols}")
        with self._close_lock:
            if self.stdin_w < 0 or self.pty_fd < 0:
                raise InvalidArgument("the command has no PTY (or it has ended)")
            fcntl.ioctl(self.stdin_w, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    def close_pipes(self) -> None:
        """Release the stdio pipes once output is drained; the control socket stays (kill-on-close)."""
        with self._close_lock:  # the reader thread and the owner may both close; never close an fd twice
            self.pty_fd = -1  # it is out_r: closed below
            for attr in ("stdin_w", "out_r", "err_r"):
                fd = getattr(self, attr, -1)
                if fd is not None and fd >= 0:
                    setattr(self, attr, -1)
                    try:
                        os.close(fd)
                    except OSError:
                        pass

    def close(self) -> None:
        self.close_pipes()
        self.sock.close()


def run(sock_path: str, sandbox_id: str, argv: list[str], env: dict[str, str], cwd: str = "/",
        timeout: float | None = 60.0, stdin: bytes | None = None, output_cap: int = 1 << 20,
        on_stdout: Callable[[str], None] | None = None, on_stderr: Callable[[str], None] | None = None,
        raise_on_timeout: bool = False, ids: Ids | None = None) -> ExecResult:
    """Run a command to completion, capturing (capped) output and optionally streaming it."""
    proc = Process(sock_path, sandbox_id, argv, env, cwd, timeout, FLAG_KILL_ON_CLOSE | FLAG_BUSY,
                   stdin_pipe=stdin is not None, ids=ids)
    out, err = CappedBuffer(output_cap), CappedBuffer(output_cap)
    decoders = {}
    sel = selectors.DefaultSelector()
    try:
        import codecs

        sel.register(proc.sock, selectors.EVENT_READ, "ctl")
        sel.register(proc.out_r, selectors.EVENT_READ, "out")
        sel.register(proc.err_r, selectors.EVENT_READ, "err")
        decoders = {"out": codecs.getincrementaldecoder("utf-8")("replace"),
                    "err": codecs.getincrementaldecoder("utf-8")("replace")}
        pending_in = memoryview(stdin or b"")
        if stdin is not None:
            os.set_blocking(proc.stdin_w, False)
            if pending_in:
                sel.register(proc.stdin_w, selectors.EVENT_WRITE, "in")
            else:
                os.close(proc.stdin_w)
                proc.stdin_w = -1
        open_streams = 2
        # a host-side backstop in case init cannot deliver the exit (it enforces `timeout` itself)
        backstop = None if timeout is None else time.monotonic() + timeout + 10
        drain_until = None
        while open_streams or proc.status is None:
            now = time.monotonic()
            if proc.status is not None and drain_until is None:
                # the command exited; a daemon it left behind may hold the pipes open: stop soon
                drain_until = now + 0.2
            if drain_until is not None and now > drain_until:
                break
            if backstop is not None and now > backstop and proc.status is None:
                proc.signal(9)
                proc.timed_out = True
                proc.status = 137 << 8
                break
            wait = None if drain_until is None else max(0.0, drain_until - now)
            if backstop is not None:
                wait = min(wait if wait is not None else 1e9, max(0.0, backstop - now))
            for key, _ in sel.select(wait):
                tag = key.data
                if tag == "ctl":
                    if not proc.handle_control():
                        sel.unregister(proc.sock)
                        if proc.status is None:
                            proc.status = 137 << 8
                elif tag == "in":
                    try:
                        n = os.write(proc.stdin_w, pending_in[:65536])
                        pending_in = pending_in[n:]
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:
                        pending_in = pending_in[:0]
                    if not pending_in:
                        sel.unregister(proc.stdin_w)
                        os.close(proc.stdin_w)
                        proc.stdin_w = -1
                else:
                    data = os.read(key.fd, 65536)
                    if not data:
                        sel.unregister(key.fd)
                        open_streams -= 1
                        continue
                    buf, cb = (out, on_stdout) if tag == "out" else (err, on_stderr)
                    buf.add(data)
                    if cb:
                        text = decoders[tag].decode(data)
                        if text:
                            cb(text)
    finally:
        sel.close()
        proc.close()
    if proc.error and proc.pid is not None and not proc.timed_out and proc.error.startswith("the sandbox went away"):
        raise SandboxGone(f"sandbox {sandbox_id} went away while {argv!r} ran")
    code, sig = decode_status(proc.status if proc.status is not None else 137 << 8)
    stderr_bytes = err.value()
    if proc.error and not stderr_bytes:
        stderr_bytes = proc.error.encode()
    result = ExecResult(
        exit_code=code, signal=sig, timed_out=proc.timed_out,
        stdout=out.value().decode("utf-8", "replace"), stderr=stderr_bytes.decode("utf-8", "replace"),
        stdout_bytes=out.total, stderr_bytes=err.total,
        stdout_truncated=out.truncated, stderr_truncated=err.truncated,
        duration_s=time.monotonic() - proc.started,
    )
    if result.timed_out and raise_on_timeout:
        raise CommandTimeout(f"command {argv!r} in sandbox {sandbox_id} timed out after {timeout} s", result)
    return result


def control(sock_path: str, sandbox_id: str, msg: bytes, timeout: float = 5.0) -> bytes:
    """Send one control request on a fresh connection and return the reply."""
    s = connect(sock_path, sandbox_id)
    try:
        s.settimeout(timeout)
        s.send(msg)
        try:
            return s.recv(4096)
        except TimeoutError as e:
            raise SandboxError(f"sandbox {sandbox_id} did not answer within {timeout} s (paused?)") from e
    finally:
        s.close()


def ping(sock_path: str, sandbox_id: str, timeout: float = 5.0) -> int:
    reply = control(sock_path, sandbox_id, b"P", timeout)
    if reply[:1] != b"P":
        raise SandboxError(f"sandbox {sandbox_id}: unexpected ping reply {reply[:8]!r}")
    return struct.unpack_from("<I", reply, 4)[0]


def set_lifetimes(sock_path: str, sandbox_id: str, ttl_ms: int, idle_ms: int) -> None:
    reply = control(sock_path, sandbox_id, struct.pack("<B7xqq", ord("L"), ttl_ms, idle_ms))
    if reply[:1] != b"L":
        raise SandboxError(f"sandbox {sandbox_id}: could not set TTL")


def is_epipe(e: OSError) -> bool:
    return e.errno in (errno.EPIPE, errno.ECONNRESET)
