"""A TCP connection from the host to a port inside a sandbox's own network namespace.

A sandbox has no route to the host (its netns holds only `lo`), so the host goes to it: a short-lived
thread joins the sandbox's netns (setns on a pidfd of its init), creates and connects a socket to
127.0.0.1:PORT there and exits. A socket stays in the namespace it was created in, so the caller gets
a connection into the sandbox while every other thread stays in the host's namespace.
"""
from __future__ import annotations

import ctypes
import errno
import os
import socket
import threading

from ...core.contract import check_port
from ...core.errors import PortClosed, SandboxError, SandboxNotFound
from ..pids import starttime
from .portguard import MARK

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def connect_in_netns(sandbox_id: str, pid: int, start: int | None, port: int, timeout: float) -> socket.socket:
    """A socket connected to 127.0.0.1:`port` in the network namespace of process (pid, start)."""
    check_port(port)
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        raise SandboxNotFound(f"sandbox {sandbox_id} has ended") from None
    try:
        # the pidfd names one process for good: checked after opening, a reused pid cannot slip in
        if start is None or starttime(pid) != start:
            raise SandboxNotFound(f"sandbox {sandbox_id} has ended")
        out: list[socket.socket | BaseException] = []

        def join_and_connect() -> None:
            # this thread only: setns(CLONE_NEWNET) moves the calling thread, and the thread ends here
            if _libc.setns(pidfd, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                out.append(OSError(err, f"setns into sandbox {sandbox_id}'s network: {os.strerror(err)}"))
                return
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                # the host's mark: a guarded port (portguard.py) resets connections without it, and the
                # sandbox cannot set it (SO_MARK needs CAP_NET_ADMIN or CAP_NET_RAW, both dropped there)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, MARK)
                s.settimeout(timeout)
                s.connect(("127.0.0.1", port))
                s.settimeout(None)
                out.append(s)
            except BaseException as e:
                s.close()
                out.append(e)

        t = threading.Thread(target=join_and_connect, name=f"netns-{sandbox_id}", daemon=True)
        t.start()
        t.join()
    finally:
        os.close(pidfd)
    got = out[0] if out else SandboxError(f"connecting to port {port} in sandbox {sandbox_id} failed")
    if isinstance(got, socket.socket):
        return got
    if isinstance(got, ConnectionRefusedError) or getattr(got, "errno", None) == errno.ECONNREFUSED:
        raise PortClosed(f"nothing listens on port {port} in sandbox {sandbox_id}") from None
    if isinstance(got, TimeoutError):
        raise PortClosed(f"port {port} in sandbox {sandbox_id} did not accept within {timeout:g} s") from None
    raise SandboxError(f"connecting to port {port} in sandbox {sandbox_id}: {got}") from got
