"""The port proxy of a front served with `--domain`: get_host's names under that domain reach the
sandbox port and every other such name is refused (sync and async SDK); WebSockets to a server inside
a sandbox; and the per-tenant caps and timeouts that keep a hostile tenant's ports from holding the
front (a port that never answers, a listener that never accepts)."""
from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import httpx
import pytest
from e2b import AsyncSandbox, Sandbox

from .conftest import start_front
from .test_ports import _get, _serve

DOMAIN = "sbx.shoal.test"
CAP = 4  # --max-port-connections of this module's front

# A WebSocket server in the standard library only (the code-interpreter image has Python, no extra
# package needed): it greets with the path and a header, answers text reversed and binary as is.
WS_SERVER = r'''
import base64, hashlib, socketserver, struct, sys
GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
class H(socketserver.StreamRequestHandler):
    def frame(self, op, data):
        n = len(data)
        size = bytes([n]) if n < 126 else b"\x7e" + struct.pack(">H", n) if n < 65536 \
            else b"\x7f" + struct.pack(">Q", n)
        self.wfile.write(bytes([0x80 | op]) + size + data)
    def handle(self):
        path = self.rfile.readline().split()[1].decode()
        head = {}
        while (line := self.rfile.readline().strip()):
            k, _, v = line.decode().partition(":")
            head[k.strip().lower()] = v.strip()
        accept = base64.b64encode(hashlib.sha1((head["sec-websocket-key"] + GUID).encode()).digest()).decode()
        proto = head.get("sec-websocket-protocol", "").split(",")[0].strip()
        self.wfile.write(("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                          f"Sec-WebSocket-Accept: {accept}\r\n"
                          + (f"Sec-WebSocket-Protocol: {proto}\r\n" if proto else "") + "\r\n").encode())
        self.frame(1, f"hello {path} {head.get('x-hello', '-')} {head.get('e2b-traffic-access-token', '-')}".encode())
        while True:
            b0, b1 = self.rfile.read(2)
            op, n = b0 & 15, b1 & 127
            if n == 126:
                n = struct.unpack(">H", self.rfile.read(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self.rfile.read(8))[0]
            mask = self.rfile.read(4)
            data = bytes(c ^ mask[i % 4] for i, c in enumerate(self.rfile.read(n)))
            if op == 8:
                self.frame(8, data[:2])
                return
            self.frame(op, data[::-1] if op == 1 else data)
socketserver.ThreadingTCPServer.allow_reuse_address = True
socketserver.ThreadingTCPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
'''


@pytest.fixture(scope="module")
def front(root, e2b_image):
    env = {**os.environ, "SHOAL_URL": "local", "SHOAL_ROOT": str(root)}
    d = start_front(root, env, "--template", f"base={e2b_image}", "--domain", DOMAIN.upper() + ".",
                    "--max-port-connections", str(CAP), "--port-timeout", "4")
    yield d
    d["proc"].terminate()
    d["proc"].wait(20)


@pytest.fixture
def fopts(front) -> dict:
    # the SDK's own domain option is a wrong one: the front's answer (`domain`) is what get_host uses
    return {"api_url": front["url"], "sandbox_url": front["url"], "api_key": front["key"], "domain": "wrong.test"}


def _port_of(url: str) -> int:
    return urlsplit(url).port or 80


def test_get_host_under_the_domain_and_nothing_else(front, fopts):
    s = Sandbox.create("base", timeout=120, **fopts)
    try:
        _serve(s, 8080)
        assert s.get_host(8080) == f"8080-{s.sandbox_id}.{DOMAIN}"
        tok = {"E2B-Traffic-Access-Token": s.traffic_access_token}
        url = front["url"] + "/index.html"
        port = _port_of(front["url"])
        r = _get(url, {"Host": s.get_host(8080), **tok})
        assert (r.status_code, r.text) == (200, "served from the sandbox\n")
        # the name as a client resolving it would send it: with the front's port, any case, a final dot
        for host in (f"{s.get_host(8080)}:{port}", f"8080-{s.sandbox_id}.{DOMAIN.upper()}."):
            assert httpx.get(url, headers={"Host": host, **tok}).status_code == 200, host
        again = Sandbox.connect(s.sandbox_id, **fopts)  # connect's answer carries the domain too
        assert again.get_host(8080) == s.get_host(8080)
        # forged: another domain, the domain as a prefix or under another name, a deeper name: refused
        # before any token is looked at, never proxied
        for host in (f"8080-{s.sandbox_id}.wrong.test", f"8080-{s.sandbox_id}.{DOMAIN}.evil.test",
                     f"8080-{s.sandbox_id}.x.{DOMAIN}", f"8080-{s.sandbox_id}.{DOMAIN}x",
                     f"8080-{s.sandbox_id}.sbx.shoal", f"49983-{s.sandbox_id}.wrong.test"):
            r = httpx.get(url, headers={"Host": host, **tok})
            assert r.status_code == 404 and "domain" in r.json()["message"], (host, r.status_code)
        # the right domain with another sandbox's id or a bad token: 401, as without --domain
        r = httpx.get(url, headers={"Host": f"8080-sb-nothere-000000000000.{DOMAIN}", **tok})
        assert r.status_code == 502
        r = httpx.get(url, headers={"Host": s.get_host(8080), "E2B-Traffic-Access-Token": "0" * 64})
        assert r.status_code == 401
        # WebSocket upgrades are refused the same way, before the upgrade: a forged name, a bad token,
        # a port nothing listens on; a server that is no WebSocket server answers with its own status
        from websockets.exceptions import InvalidStatus
        from websockets.sync.client import connect

        for host, token, status in ((f"8080-{s.sandbox_id}.wrong.test", s.traffic_access_token, 404),
                                    (s.get_host(8080), "0" * 64, 401), (s.get_host(8099), s.traffic_access_token, 502),
                                    (s.get_host(8080), s.traffic_access_token, 404)):  # httpd: no such file
            with pytest.raises(InvalidStatus) as e:
                connect(f"ws://{host}:{port}/nothing", sock=socket.create_connection(("127.0.0.1", port)),
                        open_timeout=10, additional_headers={"E2B-Traffic-Access-Token": token})
            assert e.value.response.status_code == status, (host, token)
        # names that are not a port's still reach the control plane and envd
        assert s.commands.run("echo ok").stdout == "ok\n"
    finally:
        s.kill()


def test_async_sdk_builds_the_domains_host(front, fopts):
    async def main() -> None:
        s = await AsyncSandbox.create("base", timeout=60, **fopts)
        try:
            assert s.get_host(8080) == f"8080-{s.sandbox_id}.{DOMAIN}"
            await s.commands.run("httpd -p 127.0.0.1:8080 -h /etc")
            deadline = time.monotonic() + 10
            async with httpx.AsyncClient() as c:
                while True:
                    r = await c.get(front["url"] + "/passwd", headers={
                        "Host": s.get_host(8080), "E2B-Traffic-Access-Token": s.traffic_access_token})
                    if r.status_code != 502 or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.1)
            assert r.status_code == 200 and "user:x:1000" in r.text
        finally:
            await s.kill()

    asyncio.run(main())


def test_a_bad_domain_is_refused_at_start(root, e2b_image):
    import subprocess
    import sys

    env = {**os.environ, "SHOAL_URL": "local", "SHOAL_ROOT": str(root)}
    r = subprocess.run([sys.executable, "-m", "shoal.cli", "e2b", "serve", "--listen", "127.0.0.1:0",
                        "--domain", "bad domain!", "--memory-only"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0 and "not a DNS name" in r.stdout + r.stderr


def test_websocket_to_a_server_inside_a_sandbox(front, code_interpreter_image):
    """A real WebSocket client (websockets) reaches a stdlib WebSocket server inside a sandbox by the
    name get_host builds: the handshake's path, headers and subprotocol get there, messages and the
    close go both ways, and the tokens stay in the front."""
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    s = Sandbox.create("code-interpreter", timeout=120, api_url=front["url"], sandbox_url=front["url"],
                       api_key=front["key"])
    try:
        s.files.write("/tmp/ws.py", WS_SERVER)
        s.commands.run("python3 /tmp/ws.py 8765", background=True)
        host, port = s.get_host(8765), _port_of(front["url"])

        def ws(token: str, **kw):
            sock = socket.create_connection(("127.0.0.1", port))  # what resolving `host` to the front gives
            return connect(f"ws://{host}:{port}/chat?room=1", sock=sock, open_timeout=10,
                           additional_headers={"E2B-Traffic-Access-Token": token, "X-Hello": "there"}, **kw)

        # the server's bind races the first connect (and a port refused while the template's start
        # command comes up is retried for 30 s): wait for it inside first
        s.commands.run("python3 -c 'import socket, time\nfor _ in range(200):\n    try:\n        "
                       "socket.create_connection((\"127.0.0.1\", 8765)).close(); break\n    except OSError:\n"
                       "        time.sleep(0.05)'")
        c = ws(s.traffic_access_token, subprotocols=["chat.v1", "chat.v0"])
        with c:
            assert c.subprotocol == "chat.v1"
            assert c.recv(timeout=10) == "hello /chat?room=1 there -"  # the token was not forwarded
            c.send("stressed")
            assert c.recv(timeout=10) == "desserts"
            blob = os.urandom(200_000)
            c.send(blob)
            assert c.recv(timeout=10) == blob
        # a bad token never reaches the server: the upgrade is answered 401
        with pytest.raises(InvalidStatus) as e:
            ws("0" * 64)
        assert e.value.response.status_code == 401
    finally:
        s.kill()


def _burst(url: str, headers: dict, n: int, timeout: float = 30) -> list[tuple[int, float]]:
    """n requests at once: (status, seconds) each."""
    def one(_: int) -> tuple[int, float]:
        t0 = time.monotonic()
        try:
            code = httpx.get(url, headers=headers, timeout=timeout).status_code
        except httpx.TimeoutException:
            code = -1
        return code, time.monotonic() - t0

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def test_hostile_ports_cannot_hold_the_front(front, fopts):
    """Hostile: a tenant's ports that never answer (a server that accepts and says nothing) or never
    accept (a stopped listener: connects hang until their timeout) are hit with 40 requests at once.
    The tenant holds at most CAP of the front's connections (the rest are 429 at once), each is let go
    within the answer timeout (504) or the connect timeout (502); meanwhile the control plane and
    the other tenant stay responsive, and the slots come back."""
    s = Sandbox.create("base", timeout=120, **fopts)
    bob = Sandbox.create("base", timeout=120, **{**fopts, "api_key": front["other_key"]})
    try:
        _serve(s, 8080)
        _serve(bob, 8080)
        s.commands.run("nc -ll -p 8081 -e sleep 300", background=True)  # accepts, never answers
        s.commands.run("httpd -f -p 127.0.0.1:8082 -h /tmp", background=True)
        pid = s.commands.run("sleep 0.3; pidof httpd | tr ' ' '\\n' | sort -n | tail -1").stdout.strip()
        s.commands.run(f"kill -STOP {pid}")  # the listener stays, nobody accepts
        url = front["url"] + "/index.html"
        tok = {"E2B-Traffic-Access-Token": s.traffic_access_token}
        assert _get(url, {"Host": s.get_host(8080), **tok}).status_code == 200
        for bad in (8081, 8082):
            results: list[list[tuple[int, float]]] = []
            t = threading.Thread(target=lambda b=bad, out=results: out.append(
                _burst(url, {"Host": s.get_host(b), **tok}, 40)))
            t0 = time.monotonic()
            t.start()
            time.sleep(2.0)  # the burst is in: CAP connections held, the rest answered 429
            # meanwhile the tenant's own good port is refused (its CAP are in use), while the control
            # plane, envd and the other tenant's port answer
            assert httpx.get(url, headers={"Host": s.get_host(8080), **tok}, timeout=10).status_code == 429
            t1 = time.monotonic()
            assert Sandbox.list(**fopts).next_items()
            assert s.commands.run("echo alive").stdout == "alive\n"
            r = httpx.get(url, headers={"Host": bob.get_host(8080), "E2B-Traffic-Access-Token":
                                        bob.traffic_access_token}, timeout=10)
            assert r.status_code == 200
            assert time.monotonic() - t1 < 3.0  # about 0.1 s on an idle host, under 1 s at a load of 15
            t.join(60)
            codes = sorted(c for c, _ in results[0])
            assert codes.count(429) >= 40 - CAP, codes  # over the cap: refused, not queued
            assert set(codes) <= {429, 502, 504}, codes
            assert max(d for c, d in results[0] if c == 429) < 4.0  # answered before any held one
            assert time.monotonic() - t0 < 20  # the admitted ones are let go: 504 after 4 s, 502 after 5 s
            # the slots came back
            assert httpx.get(url, headers={"Host": s.get_host(8080), **tok}, timeout=10).status_code == 200
    finally:
        s.kill()
        bob.kill()
