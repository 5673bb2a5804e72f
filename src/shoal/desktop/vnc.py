"""A VNC stream of a desktop sandbox, for a person to watch (or take over).

x11vnc (its own toolkit layer, `desktop-vnc:1`: `desktop_layers(..., vnc=True)`) serves the sandbox's
X display on 127.0.0.1:5900 *inside* the sandbox's network namespace: no other sandbox and no
network reaches it. The viewer gets there through the backend contract's `connect_port` (in
process, or shoald's port tunnel, which only the sandbox's tenant and the admin may open): `VncForward`
listens on this machine's loopback and carries each viewer connection over its own `connect_port`
stream. x11vnc runs without a password because the tunnel is the access check.

    with VncForward(sb) as fwd:      # starts x11vnc in the sandbox if it is not running
        print(fwd.command)           # vncviewer 127.0.0.1::40123
        fwd.serve_forever()

`shoal desktop vnc SANDBOX` does the same from the command line.
"""
from __future__ import annotations

import socket
import threading
import time
from typing import TYPE_CHECKING

from ..core.errors import DesktopUnavailable, PortClosed, SandboxError

if TYPE_CHECKING:
    from ..sdk.sandbox import Sandbox

VNC_PORT = 5900
_ARGV = ["setsid", "-f", "x11vnc", "-display", ":0", "-localhost", "-rfbport", str(VNC_PORT), "-forever",
         "-shared", "-nopw", "-quiet", "-o", "/tmp/.shoal-desktop/x11vnc.log"]


def start_vnc(sb: Sandbox, timeout: float = 15.0) -> int:
    """x11vnc serving the sandbox's display on its loopback (started once; a second call finds it);
    returns the port inside the sandbox."""
    try:
        sb.connect_port(VNC_PORT, timeout=0.5).close()
        return VNC_PORT
    except PortClosed:
        pass
    r = sb.commands.run(["sh", "-c", "command -v x11vnc"], timeout=10)
    if r.exit_code != 0:
        raise DesktopUnavailable(f"sandbox {sb.id} has no x11vnc: compose the desktop-vnc:1 layer "
                                 f"(desktop_layers(..., vnc=True))")
    sb.desktop.start()
    r = sb.commands.run(_ARGV, timeout=10)
    if r.exit_code != 0:
        raise SandboxError(f"x11vnc did not start in {sb.id}: {r.stderr.strip()[-300:]}")
    deadline = time.monotonic() + timeout
    while True:
        try:
            sb.connect_port(VNC_PORT, timeout=0.5).close()
            return VNC_PORT
        except PortClosed:
            if time.monotonic() > deadline:
                log = sb.commands.run(["sh", "-c", "tail -c 1000 /tmp/.shoal-desktop/x11vnc.log"], timeout=10)
                raise SandboxError(f"x11vnc did not listen in {sb.id} within {timeout} s: {log.stdout}") from None
            time.sleep(0.1)


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
    """127.0.0.1:`port` on this machine (0: a free one) -> x11vnc in the sandbox, one tunnel per viewer."""

    def __init__(self, sb: Sandbox, port: int = 0, host: str = "127.0.0.1"):
        self.sb = sb
        start_vnc(sb)
        self.listener = socket.create_server((host, port))
        self.host, self.port = host, self.listener.getsockname()[1]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def command(self) -> str:
        """What to run on this machine to watch (TigerVNC's and RealVNC's `host::port` form)."""
        return f"vncviewer {self.host}::{self.port}"

    def _handle(self, client: socket.socket) -> None:
        try:
            remote = self.sb.connect_port(VNC_PORT)
        except Exception:  # noqa: BLE001 - the viewer sees the connection close
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
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)
        self.listener.close()

    def __enter__(self) -> VncForward:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
