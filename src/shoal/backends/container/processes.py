"""Background processes and sessions of the container backend, over init's control protocol.

Both hold a `initclient.Process`: a control connection plus pipes the host reads itself, so output
never passes through init. A background process pumps its pipes into ring buffers from a thread;
a session writes each command to a long-lived shell and reads until a random end marker.
"""
from __future__ import annotations

import errno
import os
import secrets
import select
import selectors
import socket
import threading
import time
from collections.abc import Callable

from ...core.contract import Cursor, ExecResult, ProcessHandle, ProcessOutput, SessionHandle
from ...core.errors import CommandTimeout, InvalidArgument, SessionClosed
from ..shell import MarkedCommand
from . import initclient

STDIN_WRITE_TIMEOUT_S = 5.0  # a write to a full pipe waits this long for the process to read


def _partial_utf8(data: bytes) -> int:
    """Bytes at the end of `data` that start a UTF-8 character but do not finish it (0-3)."""
    for back in range(1, min(4, len(data)) + 1):
        b = data[-back]
        if b & 0xC0 != 0x80:  # a lead byte (or ASCII): does its sequence fit in what follows it?
            need = 2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4 if b & 0xF8 == 0xF0 else 1
            return back if need > back else 0
    return 0


def _read(fd: int) -> bytes | None:
    """A read of a pipe or a PTY master: b"" at the end (a master answers EIO once the terminal's last
    holder closed it), None when nothing is there yet (the master is non-blocking)."""
    try:
        return os.read(fd, 65536)
    except BlockingIOError:
        return None
    except OSError as e:
        if e.errno == errno.EIO:
            return b""
        raise


class ContainerProcess(ProcessHandle):
    """A background command: output since a cursor, wait, kill; a pump thread reads its pipes."""

    def __init__(self, proc: initclient.Process, ring_bytes: int, argv: list[str],
                 oom_kills: Callable[[], int | None] | None = None, on_oom: Callable[[], None] | None = None):
        self._proc = proc
        # the sandbox's OOM-kill count now and at the end tells an OOM kill from any other SIGKILL
        self._oom_kills = oom_kills
        self._oom_before = oom_kills() if oom_kills else None
        self._oom_killed: bool | None = None
        # called (on a thread of its own) once an OOM kill ended the process, whether or not anyone
        # waits for it: the backend ends the sandbox there under oom_kill="sandbox"
        self._on_oom = on_oom
        self._signalled = False  # SIGKILL through kill(): never taken for the OOM killer's
        self.id = "proc-" + secrets.token_hex(6)
        self.argv = argv
        self._out, self._err = initclient.RingLog(ring_bytes), initclient.RingLog(ring_bytes)
        self._done = threading.Event()
        self._changed = threading.Condition()  # wakes wait_output: new output or the exit
        self._pump = threading.Thread(target=self._run, name=f"shoal-bg-{proc.sandbox_id}", daemon=True)
        self._pump.start()
        deadline = time.monotonic() + 5
        while self._proc.pid is None and not self._done.is_set() and time.monotonic() < deadline:
            time.sleep(0.0005)

    def _run(self) -> None:
        p = self._proc
        sel = selectors.PollSelector()  # no epoll descriptor per process
        sel.register(p.sock, selectors.EVENT_READ, None)
        sel.register(p.out_r, selectors.EVENT_READ, self._out)
        streams = 1
        if p.err_r >= 0:  # a PTY has one stream: stderr goes to the same terminal
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
                    data = _read(key.fd)
                    if data is None:
                        continue
                    if not data:
                        sel.unregister(key.fd)
                        streams -= 1
                    else:
                        key.data.add(data)
                        self._notify()
                if p.status is not None and streams:
                    # exited; give a lingering daemon's pipes 200 ms, then stop reading
                    for key, _ in sel.select(0.2):
                        if key.data is not None:
                            data = _read(key.fd)
                            if data:
                                key.data.add(data)
                    break
        finally:
            sel.close()
            p.close_pipes()  # a finished command keeps only its control socket
            self._decide_oom()
            self._done.set()
            self._notify()
        if self._oom_killed and self._on_oom is not None:
            threading.Thread(target=self._on_oom, name=f"shoal-oom-{p.sandbox_id}", daemon=True).start()

    def _decide_oom(self) -> None:
        """oom_killed: ended by SIGKILL, neither by its timeout nor through kill(), while the sandbox's
        OOM-kill count grew (the kernel counts before it signals). In a pooled memory cgroup a
        neighbour's kill at the same moment cannot be told apart (docs/density.md)."""
        if self._proc.status is None or self._oom_kills is None or self._oom_before is None:
            self._oom_killed = False
            return
        code, _ = initclient.decode_status(self._proc.status)
        if code != 137 or self._proc.timed_out or self._signalled:
            self._oom_killed = False
            return
        after = self._oom_kills()
        self._oom_killed = after is not None and after > self._oom_before

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    @property
    def pid(self) -> int | None:  # type: ignore[override]  # read live: set once init reports the start
        return self._proc.pid

    def _exit_code(self) -> int | None:
        if not self._done.is_set() or self._proc.status is None:
            return None
        return initclient.decode_status(self._proc.status)[0]

    def output(self, since: Cursor = (0, 0)) -> ProcessOutput:
        code = self._exit_code()  # read before the output: a finished process's output is complete
        out, c1, l1 = self._out.since(since[0])
        err, c2, l2 = self._err.since(since[1])
        if code is None:  # still writing: a character split across reads waits for its last bytes
            cut1, cut2 = _partial_utf8(out), _partial_utf8(err)
            out, c1, err, c2 = out[:len(out) - cut1], c1 - cut1, err[:len(err) - cut2], c2 - cut2
        return ProcessOutput(stdout=out.decode("utf-8", "replace"), stderr=err.decode("utf-8", "replace"),
                             cursor=(c1, c2), lost_bytes=l1 + l2, exit_code=code)

    def poll(self) -> int | None:
        return self._exit_code()

    def wait_output(self, since: Cursor, timeout: float) -> ProcessOutput:
        deadline = time.monotonic() + timeout
        with self._changed:  # checked under the lock the pump notifies under: no wake-up is missed
            while True:
                out = self.output(since)
                left = deadline - time.monotonic()
                if out.stdout or out.stderr or out.exit_code is not None or left <= 0:
                    return out
                self._changed.wait(left)

    def write_stdin(self, data: bytes) -> None:
        """Blocks at most STDIN_WRITE_TIMEOUT_S: a process that does not read its stdin must not hold the
        caller's thread (a server's worker) nor, through the lock, close() and kill, for ever."""
        p = self._proc
        with p._close_lock:  # never write to an fd the pump has closed (and the number reused)
            if p.stdin_w < 0:
                raise InvalidArgument("the process's stdin is closed (or it was started without stdin=True)")
            os.set_blocking(p.stdin_w, False)
            deadline = time.monotonic() + STDIN_WRITE_TIMEOUT_S
            view, total = memoryview(data), len(data)
            try:
                while view:
                    try:
                        view = view[os.write(p.stdin_w, view):]
                    except BlockingIOError:
                        left = deadline - time.monotonic()
                        poller = select.poll()  # not select(): fds past 1024 are common on a dense host
                        poller.register(p.stdin_w, select.POLLOUT)
                        if left <= 0 or not poller.poll(left * 1000):
                            raise CommandTimeout(
                                f"the process did not read its stdin for {STDIN_WRITE_TIMEOUT_S:g} s: "
                                f"{total - len(view)} of {total} bytes written") from None
            except BrokenPipeError:
                raise InvalidArgument("the process no longer reads its stdin") from None

    def resize(self, rows: int, cols: int) -> None:
        self._proc.resize(rows, cols)

    def close_stdin(self) -> None:
        p = self._proc
        if p.pty_fd >= 0:  # a terminal's end of input is ^D; its master stays open for the output
            self.write_stdin(b"\x04")
            return
        with p._close_lock:
            if p.stdin_w >= 0:
                os.close(p.stdin_w)
                p.stdin_w = -1

    def wait(self, timeout: float | None = None) -> ExecResult:
        if not self._done.wait(timeout):
            raise CommandTimeout(f"background command {self.argv!r} still running after {timeout} s")
        assert self._proc.status is not None  # the pump sets it before _done
        code, sig = initclient.decode_status(self._proc.status)
        o = self.output()
        return ExecResult(exit_code=code, signal=sig, stdout=o.stdout, stderr=o.stderr,
                          stdout_bytes=self._out.end, stderr_bytes=self._err.end,
                          stdout_truncated=self._out.start > 0, stderr_truncated=self._err.start > 0,
                          timed_out=self._proc.timed_out, duration_s=time.monotonic() - self._proc.started,
                          oom_killed=self._oom_killed)

    def kill(self, signal: int = 9) -> None:
        if signal == 9:
            self._signalled = True
        self._proc.signal(signal)

    def close(self) -> None:
        # The pump thread polls the pipes and the control socket: closing them under it would have it
        # read closed, or already reused, descriptors (another command's pipe). Shutting the socket down
        # is enough: init kills the command (kill-on-close), the pump sees the end, closes the pipes itself
        # and stops within its 200 ms linger; the socket is closed once the pump is done.
        try:
            self._proc.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if threading.current_thread() is not self._pump:
            self._pump.join(5.0)
        if not self._pump.is_alive():
            self._proc.close()


class ContainerSession(SessionHandle):
    """A long-lived shell: cwd, env and shell variables persist between run() calls.

    Each command is sent as `command eval '<cmd>'` followed by a random end marker, so a syntax
    error in one command cannot kill the shell; stdin of the command is /dev/null."""

    def __init__(self, proc: initclient.Process, shell: str, output_cap: int, sandbox_id: str,
                 before_run: Callable[[], object], idle_ttl: bool):
        self.id = "ses-" + secrets.token_hex(6)
        self.shell = shell
        self.closed = False
        self.exit_code: int | None = None
        self._proc = proc
        self._sandbox_id = sandbox_id
        self._cap = output_cap
        self._before_run = before_run  # resumes a paused sandbox, as any request does
        self._touch = idle_ttl
        # poll, not epoll: an epoll instance is one more descriptor per open session, and a host of
        # idle sandboxes holds a session each (the fill's RLIMIT_NOFILE); three fds need no epoll
        self._sel = selectors.PollSelector()
        self._sel.register(proc.out_r, selectors.EVENT_READ, "out")
        self._sel.register(proc.err_r, selectors.EVENT_READ, "err")
        self._sel.register(proc.sock, selectors.EVENT_READ, "ctl")

    def _write(self, data: bytes) -> None:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._proc.stdin_w, view):]
        except BrokenPipeError:
            self.closed = True
            raise SessionClosed(f"session shell in sandbox {self._sandbox_id} has exited") from None

    def run(self, cmd: str, timeout: float | None = 60.0) -> ExecResult:
        if self.closed:
            raise SessionClosed(f"session in sandbox {self._sandbox_id} is closed")
        if not isinstance(cmd, str):
            raise InvalidArgument("session commands are shell strings")
        mc = MarkedCommand(cmd, self._cap)
        self._before_run()
        if self._touch:
            self._proc.touch(True)
        self._write(mc.script)
        timed_out = False
        deadline = None if timeout is None else mc.started + timeout
        try:
            while not mc.done:
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
                                self.exit_code = initclient.decode_status(self._proc.status)[0]
                            self.closed = True
                            self._sel.unregister(self._proc.sock)
                        continue
                    data = os.read(key.fd, 65536)
                    if not data:
                        self.closed = True
                        raise SessionClosed(f"session shell in sandbox {self._sandbox_id} exited "
                                            f"(did the command run `exit`?)")
                    mc.feed(key.data, data)
        finally:
            if self._touch:
                self._proc.touch(False)
        return mc.result(timed_out)

    def close(self) -> None:
        self.closed = True
        try:
            self._sel.close()
        finally:
            self._proc.close()  # kill-on-close: the shell and its process group go away
