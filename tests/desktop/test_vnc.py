"""A VNC stream of a desktop sandbox: Shoal's own x11vnc (its own layer) on the sandbox's loopback,
reached through shoald's port tunnel by a local forward. The server asks for VNC authentication:
no password and a wrong one are refused by x11vnc itself, the forward's password opens the
session (ServerInit with the screen's size, a framebuffer update). A server the agent puts on the
port after killing x11vnc never gets the viewer. A sandbox without the layer says so."""
from __future__ import annotations

import re
import socket
import struct
import time

import pytest
from cryptography.hazmat.decrepit.ciphers.algorithms import TripleDES
from cryptography.hazmat.primitives.ciphers import Cipher, modes

from shoal.core.errors import DesktopUnavailable
from shoal.desktop.vnc import VncForward, start_vnc
from shoal.envs.desktop import DESKTOP_IMAGE, desktop_layers, ensure_desktop
from shoal.sdk.sandbox import Sandbox

pytestmark = pytest.mark.slow


def _recv(c: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = c.recv(n - len(out))
        if not chunk:
            raise AssertionError(f"connection closed after {len(out)} of {n} bytes")
        out += chunk
    return out


def vnc_response(password: str, challenge: bytes) -> bytes:
    """RFB's VNC authentication: DES-ECB of the 16-byte challenge, keyed by the password's first 8
    bytes with each byte's bits reversed (RFC 6143 7.2.2 and the errata). TripleDES with the key
    three times is single DES."""
    key = bytes(int(f"{b:08b}"[::-1], 2) for b in password.encode()[:8].ljust(8, b"\0"))
    enc = Cipher(TripleDES(key * 3), modes.ECB()).encryptor()
    return enc.update(challenge) + enc.finalize()


def _handshake(port: int, password: str | None) -> tuple[socket.socket, int]:
    """Connect, agree on 3.8 and answer the VNC challenge with `password` (None: ask for security
    type None instead); the connection and the SecurityResult (0: OK)."""
    c = socket.create_connection(("127.0.0.1", port), timeout=20)
    assert re.fullmatch(rb"RFB 003\.00[378]\n", _recv(c, 12))
    c.sendall(b"RFB 003.008\n")
    types = _recv(c, _recv(c, 1)[0])
    assert list(types) == [2], f"x11vnc must offer only VNC authentication, offered {list(types)}"
    if password is None:
        c.sendall(b"\x01")  # "None", not offered
        try:
            return c, struct.unpack(">I", _recv(c, 4))[0]
        except (AssertionError, ConnectionResetError):
            return c, -1  # closed without a result: refused too
    c.sendall(b"\x02")
    c.sendall(vnc_response(password, _recv(c, 16)))
    return c, struct.unpack(">I", _recv(c, 4))[0]


def test_vnc_asks_for_the_forwards_password_and_serves_only_shoals_server(host, desktop_images, daemon):
    ensure_desktop(host, apps=("editor",), vnc=True)
    sb = Sandbox.create(DESKTOP_IMAGE, layers=desktop_layers(["editor"], vnc=True), memory_mb=1024, disk_mb=256,
                        url=daemon["url"], api_key=daemon["admin_key"])
    try:
        sb.desktop.start()
        with VncForward(sb) as fwd:
            assert fwd.command == f"vncviewer 127.0.0.1::{fwd.port}"
            assert re.fullmatch(r"[A-Za-z0-9]{8}", fwd.password) and fwd.password not in repr(fwd.server)
            # no password, a wrong one: refused by x11vnc
            c, result = _handshake(fwd.port, None)
            c.close()
            assert result != 0
            wrong = "x" + fwd.password[1:] if fwd.password[0] != "x" else "y" + fwd.password[1:]
            c, result = _handshake(fwd.port, wrong)
            c.close()
            assert result == 1
            # the right one: the session
            c, result = _handshake(fwd.port, fwd.password)
            with c:
                assert result == 0
                c.sendall(b"\x01")  # ClientInit: shared
                assert struct.unpack(">HH", _recv(c, 4)) == (1280, 800)
                _recv(c, 16)  # pixel format
                (n,) = struct.unpack(">I", _recv(c, 4))
                _recv(c, n)  # desktop name
                c.sendall(struct.pack(">BBHHHH", 3, 0, 0, 0, 32, 32))  # FramebufferUpdateRequest
                assert _recv(c, 1) == b"\x00"  # FramebufferUpdate
            # the password is on no command line and in no file of the sandbox (x11vnc deleted it)
            pw = fwd.password
            pattern = f"{pw[:4]}[{pw[4]}]{pw[5:]}"  # grep's own argv must not match
            r = sb.commands.run(["sh", "-c", f"grep -rl '{pattern}' /proc/[0-9]*/cmdline /tmp /root 2>/dev/null"])
            assert r.stdout.strip() == ""
            for log in daemon["root"].glob("*.log"):
                assert pw not in log.read_text(errors="replace"), f"the VNC password is in {log}"
            # the agent kills x11vnc and serves its own "VNC" (no authentication) on the same port
            sb.commands.run(["pkill", "-x", "x11vnc"], check=True)
            fake = ("import socket\ns=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
                    f"s.bind(('127.0.0.1', {fwd.server.port})); s.listen()\n"
                    "while True:\n c,_=s.accept(); c.sendall(b'RFB 003.008\\n\\x01\\x01')\n")
            sb.files.write("/tmp/fake.py", fake)
            sb.commands.run(["setsid", "-f", "python3", "/tmp/fake.py"], check=True)
            deadline = time.monotonic() + 10
            while not any(s.state == "listen" for s in sb.port_sockets(fwd.server.port)):
                assert time.monotonic() < deadline, "the stand-in did not listen"
                time.sleep(0.1)
            with socket.create_connection(("127.0.0.1", fwd.port), timeout=20) as c:
                assert c.recv(64) == b"", "the forward carried a viewer to a server Shoal did not start"
            assert fwd.refused == 1
    finally:
        sb.kill()


def test_vnc_needs_its_layer(desk):
    with pytest.raises(DesktopUnavailable, match="desktop-vnc"):
        start_vnc(desk)
