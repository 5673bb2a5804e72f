"""connect_port on gVisor: a relay process inside the sandbox, since the host cannot reach its network.

A gVisor sandbox's loopback lives in the Sentry's own network stack, not in a host network namespace,
and this runsc (2022) has no port-forward command. So the host runs, with `runsc exec`, the host's
static busybox (bind-mounted read-only at RELAY_TOOL in every gVisor sandbox; the image needs no tool
of its own) as `nc 127.0.0.1 PORT -e ...`: once connected, nc starts a shell that says so on stderr
and copies between the socket and the relay's stdin/stdout (saved on fds 3 and 4 before nc took them).
The caller gets one end of a socketpair; two host threads copy between its other end and the
relay's pipes. Differs from the container backend: a half-close by the caller (shutdown SHUT_WR) is
not passed on to the sandbox's server (busybox has no shutdown), and each connection costs a
`runsc exec` (tens of milliseconds on ptrace).
"""
from __future__ import annotations

import contextlib
import os
import select
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ...core.errors import PortClosed, SandboxError

if TYPE_CHECKING:
    from .backend import _Exec

HOST_BUSYBOX = "/bin/busybox"  # Debian's busybox-static: statically linked, runs inside any image
# named busybox (so its applet comes from argv[1]); on the sandbox's /dev tmpfs, so the mount point
# lands in neither its disk nor its snapshots
RELAY_TOOL = "/dev/.shoal/busybox"
_OK = b"shoal-relay-connected\n"
CHUNK = 64 << 10


def relay_mount() -> dict | None:
    """The OCI mount of the host's busybox at RELAY_TOOL, or None without a static one."""
    if not os.path.isfile(HOST_BUSYBOX):
        return None
    return {"destination": RELAY_TOOL, "type": "bind", "source": HOST_BUSYBOX, "options": ["bind", "ro"]}


def relay_argv(port: int, timeout: float) -> list[str]:
    bb = RELAY_TOOL
    # each cat holds only its own end of the relay's pipes: the server's close ends the relay's stdout
    inner = f"echo {_OK.decode().strip()} >&2; {bb} cat <&3 4>&- & exec {bb} cat >&4 3<&-"
    return [bb, "sh", "-c", f'exec 3<&0 4>&1; exec {bb} nc -w {max(1, round(timeout))} 127.0.0.1 {port} '
                            f'-e {bb} sh -c "{inner}"']


def open_relay(spawn: Callable[[list[str]], _Exec], sandbox_id: str, port: int, timeout: float) -> socket.socket:
    """Start the relay, wait until it has connected (or failed), and hand back a socket to it."""
    x = spawn(relay_argv(port, timeout))
    err = b""
    deadline = time.monotonic() + timeout + 10  # + runsc exec's own start
    assert x.proc.stderr is not None and x.proc.stdout is not None and x.proc.stdin is not None  # PIPEs
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(x.proc.stderr, selectors.EVENT_READ)
            while _OK not in err:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PortClosed(f"port {port} in sandbox {sandbox_id} did not accept within {timeout:g} s")
                if sel.select(min(left, 0.5)):
                    data = os.read(x.proc.stderr.fileno(), 4096)
                    if not data:
                        break
                    err += data
                elif x.proc.poll() is not None and _OK not in err:
                    break
        if _OK not in err:
            text = err.decode("utf-8", "replace").strip()
            if "refused" in text.lower() or "timed out" in text.lower() or not text:
                raise PortClosed(f"nothing listens on port {port} in sandbox {sandbox_id} ({text or 'no answer'})")
            raise SandboxError(f"port relay in sandbox {sandbox_id}: {text[-300:]}")
    except BaseException:
        x.close()
        raise
    mine, theirs = socket.socketpair()
    _pump(x, mine)
    return theirs


def _pump(x: _Exec, sock: socket.socket) -> None:
    """Copy sock -> relay stdin and relay stdout -> sock until either side ends; then end the relay."""
    stdin, stdout = x.proc.stdin, x.proc.stdout
    assert stdin is not None and stdout is not None
    done = threading.Event()

    def up() -> None:  # the caller's writes -> the sandbox's port
        try:
            while data := sock.recv(CHUNK):
                stdin.write(data)
                stdin.flush()
        except (OSError, ValueError):
            pass
        finally:
            with contextlib.suppress(OSError, ValueError):
                stdin.close()

    def down() -> None:  # the sandbox's port -> the caller
        try:
            while data := os.read(stdout.fileno(), CHUNK):
                sock.sendall(data)
        except (OSError, ValueError):
            pass
        finally:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_WR)
            done.set()

    def reap() -> None:
        t_up.join()  # the caller closed or half-closed its end (or the relay its stdin)
        hup = select.poll()
        hup.register(sock, select.POLLHUP)
        # the relay ends when the server closes; or when the caller has closed its end entirely
        # (a half-close alone leaves the answer coming)
        while not done.wait(0.2):
            if hup.poll(0):
                break
        x.close()
        sock.close()

    t_up = threading.Thread(target=up, daemon=True, name="gv-relay-up")
    for t in (t_up, threading.Thread(target=down, daemon=True, name="gv-relay-down"),
              threading.Thread(target=reap, daemon=True, name="gv-relay-reap")):
        t.start()
