"""`connect_port`: a TCP connection from the host to a server inside a sandbox that has no network
(its own netns with only lo), on the container backend in-process and through shoald's tunnel, and on
gVisor through a relay run inside (backends/gvisor/relay.py)."""
from __future__ import annotations

import socket
import time

import pytest

from shoal.core.errors import InvalidArgument, PortClosed, SandboxError

pytestmark = pytest.mark.all_backends

PAGE = "hello from inside"


def _recv_all(s: socket.socket) -> bytes:
    s.settimeout(10)
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def _connect(sb, port: int) -> socket.socket:
    """The first connect may race the server's bind: retry refusals for a few seconds."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return sb.connect_port(port)
        except SandboxError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_a_server_inside_is_reached_from_the_host(make_sandbox, backend_kind):
    sb = make_sandbox()
    sb.commands.run(f"mkdir -p /www && echo '{PAGE}' > /www/index.html && httpd -p 127.0.0.1:8000 -h /www", check=True)
    with _connect(sb, 8000) as s:
        s.sendall(b"GET /index.html HTTP/1.0\r\nHost: x\r\n\r\n")
        reply = _recv_all(s)
    assert reply.startswith(b"HTTP/1.") and b" 200 " in reply.split(b"\r\n")[0], reply[:200]
    assert reply.endswith(PAGE.encode() + b"\n")
    # both directions, then a half-close: the echo server sees EOF and closes its side
    sb.commands.start("nc -l -p 9000 -e cat")
    with _connect(sb, 9000) as s:
        s.sendall(b"ping " * 20000)  # 100 KB: more than one chunk each way
        if backend_kind == "gvisor":  # its relay passes no half-close on (relay.py): read what came back
            s.settimeout(10)
            got = b""
            while len(got) < 100_000 and (chunk := s.recv(65536)):
                got += chunk
            assert got == b"ping " * 20000
            return
        s.shutdown(socket.SHUT_WR)
        assert _recv_all(s) == b"ping " * 20000


def test_bad_and_closed_ports_and_the_hosts_own_listeners(make_sandbox, backend_kind):
    sb = make_sandbox()
    for bad in (0, 70000, -1):
        with pytest.raises(InvalidArgument):
            sb.connect_port(bad)
    with pytest.raises(PortClosed, match="nothing listens"):
        sb.connect_port(8001)
    # a server on the host's loopback is not what the sandbox's 127.0.0.1 reaches
    with socket.socket() as host_srv:
        host_srv.bind(("127.0.0.1", 0))
        host_srv.listen()
        with pytest.raises(PortClosed, match="nothing listens"):
            sb.connect_port(host_srv.getsockname()[1])
