"""A VNC stream of a desktop sandbox: x11vnc (its own layer) on the sandbox's loopback, reached
through shoald's port tunnel by a local forward; the forward speaks RFB (version, security,
ServerInit with the screen's size, a framebuffer update). A sandbox without the layer says so."""
from __future__ import annotations

import re
import socket
import struct

import pytest

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


def test_vnc_through_shoald_speaks_rfb(host, desktop_images, daemon):
    ensure_desktop(host, apps=("editor",), vnc=True)
    sb = Sandbox.create(DESKTOP_IMAGE, layers=desktop_layers(["editor"], vnc=True), memory_mb=1024, disk_mb=256,
                        url=daemon["url"], api_key=daemon["admin_key"])
    try:
        sb.desktop.start()
        with VncForward(sb) as fwd:
            assert fwd.command == f"vncviewer 127.0.0.1::{fwd.port}"
            with socket.create_connection(("127.0.0.1", fwd.port), timeout=20) as c:
                assert re.fullmatch(rb"RFB 003\.00[378]\n", _recv(c, 12))
                c.sendall(b"RFB 003.008\n")
                types = _recv(c, _recv(c, 1)[0])
                assert 1 in types  # "None": the tunnel (tenant or admin only) is the access check
                c.sendall(b"\x01")
                assert _recv(c, 4) == b"\0\0\0\0"  # SecurityResult OK
                c.sendall(b"\x01")  # ClientInit: shared
                w, h = struct.unpack(">HH", _recv(c, 4))
                assert (w, h) == (1280, 800)
                _recv(c, 16)  # pixel format
                (n,) = struct.unpack(">I", _recv(c, 4))
                _recv(c, n)  # desktop name
                c.sendall(struct.pack(">BBHHHH", 3, 0, 0, 0, 32, 32))  # FramebufferUpdateRequest
                assert _recv(c, 1) == b"\x00"  # FramebufferUpdate
        assert start_vnc(sb) == 5900  # already running: found, not started twice
        r = sb.commands.run(["sh", "-c", "pgrep -c x11vnc"])
        assert r.stdout.strip() == "1"
    finally:
        sb.kill()


def test_vnc_needs_its_layer(desk):
    with pytest.raises(DesktopUnavailable, match="desktop-vnc"):
        start_vnc(desk)
