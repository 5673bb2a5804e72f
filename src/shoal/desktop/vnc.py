"""A VNC stream of a desktop sandbox, for a person to watch (or take over).

x11vnc (its own toolkit layer, `desktop-vnc:1`: `desktop_layers(..., vnc=True)`) serves the sandbox's
X display on the sandbox's own loopback (127.0.0.1:5900 or the next free port up to 5909), *inside*
its network namespace: no other sandbox and no network reaches it. The viewer gets there through the
backend contract's `connect_port` (in process, or shoald's port tunnel, which only the sandbox's
tenant and the admin may open): `VncForward` listens on this machine's loopback and carries each
viewer connection over its own `connect_port` stream.

Two more locks, because the forward's local port is open to every user of this machine and the
sandbox's port is in the agent's hands:

- **A password.** Each `VncForward` starts its own x11vnc with a fresh random password (VNC
  authentication; x11vnc reads it from a file that it deletes at once, `-passwdfile rm:`), so a
  viewer without it is refused by x11vnc itself. It is `VncForward.password`, printed by `shoal
  desktop vnc` for the person watching; Shoal never logs it.
- **Shoal's own server.** When x11vnc listens, the forward pins the listening process (host pid and
  kernel start time, read from the host through `port_sockets`). Before carrying each viewer, it
  checks that every socket on the port is held by that very process, so a server the agent started
  on the port (after killing x11vnc, or before it) never gets a viewer or the password's answer.

    with VncForward(sb) as fwd:      # starts x11vnc in the sandbox
        print(fwd.command, fwd.password)   # vncviewer 127.0.0.1::40123
        fwd.serve_forever()

`shoal desktop vnc SANDBOX` does the same from the command line.
"""
from __future__ import annotations

import secrets
import socket
import string
import threading
import time
from typing import TYPE_CHECKING

from ..core.errors import DesktopUnavailable, PortClosed, SandboxError, ShoalError

if TYPE_CHECKING:
    from ..sdk.sandbox import Sandbox

VNC_PORT = 5900
VNC_PORTS = range(VNC_PORT, VNC_PORT + 10)  # one x11vnc per forward: the first free port of these
_STATE = "/tmp/.shoal-desktop"
# VNC authentication uses the first 8 characters of a password (a DES key): 8 random ones
_ALPHABET = string.ascii_letters + string.digits


class VncServer:
    """An x11vnc that Shoal started: its port in the sandbox, password and pinned process."""

    def __init__(self, port: int, password: str, pid: int, start: int):
        self.port, self.password, self.pid, self.start = port, password, pid, start

    def __repr__(self) -> str:  # never the password
        return f"VncServer(port={self.port}, pid={self.pid})"


def _listening(sb: Sandbox, port: int) -> bool:
    try:
        sb.connect_port(port, timeout=0.5).close()
        return True
    except PortClosed:
        return False


def _pin(sb: Sandbox, port: int) -> tuple[int, int] | None:
    """(host pid, start ticks) of the one process holding `port`'s listening sockets (IPv4 and IPv6
    loopback), or None."""
    holders = {(p, st) for s in sb.port_sockets(port) if s.state == "listen"
               for p, st in zip(s.pids, s.starts, strict=False)}
    return holders.pop() if len(holders) == 1 else None


def start_vnc(sb: Sandbox, timeout: float = 15.0) -> VncServer:
    """A new x11vnc serving the sandbox's display on its loopback, with a fresh password, pinned."""
    r = sb.commands.run(["sh", "-c", "command -v x11vnc"], timeout=10)
    if r.exit_code != 0:
        raise DesktopUnavailable(f"sandbox {sb.id} has no x11vnc: compose the desktop-vnc:1 layer "
                                 f"(desktop_layers(..., vnc=True))")
    sb.desktop.start()
    port = next((p for p in VNC_PORTS if not _listening(sb, p)), None)
    if port is None:
        raise SandboxError(f"sandbox {sb.id}: every VNC port {VNC_PORTS.start}-{VNC_PORTS.stop - 1} is taken")
    password = "".join(secrets.choice(_ALPHABET) for _ in range(8))
    pwfile = f"{_STATE}/vnc-{secrets.token_hex(8)}"
    sb.files.write(pwfile, password + "\n")
    # rm: x11vnc deletes the file once read; the password is never on a command line
    argv = ["setsid", "-f", "x11vnc", "-display", ":0", "-localhost", "-rfbport", str(port), "-forever",
            "-shared", "-passwdfile", f"rm:{pwfile}", "-quiet", "-o", f"{_STATE}/x11vnc-{port}.log"]
    r = sb.commands.run(argv, timeout=10)
    if r.exit_code != 0:
        sb.commands.run(["rm", "-f", pwfile], timeout=10)
        raise SandboxError(f"x11vnc did not start in {sb.id}: {r.stderr.strip()[-300:]}")
    deadline = time.monotonic() + timeout
    while True:
        pin = _pin(sb, port) if _listening(sb, port) else None
        if pin is not None:
            return VncServer(port, password, *pin)
        if time.monotonic() > deadline:
            sb.commands.run(["rm", "-f", pwfile], timeout=10)
            log = sb.commands.run(["sh", "-c", f"tail -c 1000 {_STATE}/x11vnc-{port}.log"], timeout=10)
            raise SandboxError(f"x11vnc did not listen in {sb.id} within {timeout} s: {log.stdout}")
        time.sleep(0.1)


def verify_server(sb: Sandbox, server: VncServer) -> None:
    """Raise SandboxError unless the port's every socket is held by the pinned x11vnc alone."""
    socks = sb.port_sockets(server.port)
    if not any(s.state == "listen" for s in socks):
        raise SandboxError(f"nothing listens on the sandbox's VNC port {server.port}")
    for s in socks:
        if s.state == "listen" or s.pids:  # an accepted socket held by nobody is one just closed
            if s.pids != [server.pid] or s.starts != [server.start]:
                raise SandboxError(f"the sandbox's VNC port {server.port} is held by pids {s.pids}, "
                                   f"not the x11vnc Shoal started (pid {server.pid})")


def _pipe(a: socket.socket, b: socket.socket) -> None:
    try:
        while data := a.recv(65536):
            b.sendall(data)
    except OSError:
        pass
    finally:
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class VncForward:
    """127.0.0.1:`port` on this machine (0: a free one) -> Shoal's own x11vnc in the sandbox, one
    tunnel per viewer; `password` is what the viewer asks for."""

    def __init__(self, sb: Sandbox, port: int = 0, host: str = "127.0.0.1"):
        self.sb = sb
        self.server = start_vnc(sb)
        self.listener = socket.create_server((host, port))
        self.host, self.port = host, self.listener.getsockname()[1]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.refused = 0  # viewer connections not carried: the port was not Shoal's server's

    @property
    def password(self) -> str:
        return self.server.password

    @property
    def command(self) -> str:
        """What to run on this machine to watch (TigerVNC's and RealVNC's `host::port` form)."""
        return f"vncviewer {self.host}::{self.port}"

    def _handle(self, client: socket.socket) -> None:
        try:
            verify_server(self.sb, self.server)
            remote = self.sb.connect_port(self.server.port)
            # and again with our connection open: the socket that accepted it is the pinned server's
            verify_server(self.sb, self.server)
        except (ShoalError, OSError):
            self.refused += 1
            client.close()
            return
        t = threading.Thread(target=_pipe, args=(remote, client), daemon=True)
        t.start()
        _pipe(client, remote)
        t.join()
        client.close()
        remote.close()

    def serve_forever(self) -> None:
        self.listener.settimeout(0.2)
        while not self._stop.is_set():
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            threading.Thread(target=self._handle, args=(client,), daemon=True).start()

    def start(self) -> VncForward:
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop listening and stop this forward's x11vnc (if it is still the pinned one)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)
        self.listener.close()
        try:
            verify_server(self.sb, self.server)
            # the pinned process's pid inside the sandbox: the one whose argv names this port
            self.sb.commands.run(["pkill", "-f", f"x11vnc .*-rfbport {self.server.port} "], timeout=10)
        except ShoalError:
            pass

    def __enter__(self) -> VncForward:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
