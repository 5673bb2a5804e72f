"""Sandbox ports through the front: what `sandbox.get_host(port)` and the code interpreter reach.

A request is for a port inside a sandbox when its `E2b-Sandbox-Port` header names a port other than
envd's (what the SDK sends with E2B_SANDBOX_URL set, e.g. the code interpreter's 49999), or when its
Host is `PORT-SANDBOXID.<any domain>` (the name `get_host` builds). The front then speaks HTTP/1.1 to
127.0.0.1:PORT inside the sandbox over the contract's `connect_port` and streams the answer back.

Who may: the request carries the sandbox's traffic token (`E2B-Traffic-Access-Token`, returned by
create and connect to the sandbox's tenant only, as `trafficAccessToken`) or its envd token
(`X-Access-Token`). Anything else is 401, so a tenant never reaches another tenant's ports. Both
headers are removed before the request enters the sandbox.
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import re
import secrets
import socket
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import anyio
import h11
from starlette.types import ASGIApp, Receive, Scope, Send

from ..core.contract import PORT_CONNECT_TIMEOUT, ProcessHandle, StartRequest
from ..core.errors import InvalidArgument, NotSupported, QuotaExceeded, SandboxError, SandboxNotFound, ShoalError
from .state import Box

if TYPE_CHECKING:
    from .front import Front

ENVD_PORT = 49983  # the SDK's envd port: requests naming it are envd's own routes
START_SCRIPT = "/etc/e2b/start.sh"  # a template's start command, run at create (the code interpreter's server)
START_RING = 64 << 10  # bytes of the start command's output the front keeps (a log tail, per stream)
START_GRACE = 30.0  # seconds a port may refuse while the template's start command is still coming up
MAX_BODY = 64 << 20  # bytes of one proxied request body
CHUNK = 64 << 10
_HOST = re.compile(r"^(\d{1,5})-([A-Za-z0-9][A-Za-z0-9_-]*)\.(.*)$")
_DOMAIN = re.compile(r"^(?=.{1,253}$)([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*$")
CONNECT_POOL = 64  # threads connecting into sandbox ports at once, over all tenants (Limits.port_connects each)
WS_MAX_MESSAGE = 16 << 20  # bytes of one WebSocket message from a sandbox (uvicorn's cap the other way)
_HOP = {b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"te", b"trailer", b"upgrade",
        b"host", b"x-access-token", b"e2b-traffic-access-token", b"x-api-key", b"content-length"}


def traffic_token(box: Box) -> str:
    """The sandbox's traffic token: derived from its envd token, so it needs no storage, and one
    way, so handing it to a browser gives no command or file access."""
    return hmac.new(box.token.encode(), b"shoal-e2b-traffic", hashlib.sha256).hexdigest()


class Starts:
    """Start commands the front ran at create, by sandbox: a port may refuse while one comes up."""

    def __init__(self) -> None:
        self._running: dict[str, tuple[ProcessHandle, float]] = {}

    def run(self, front: Front, sandbox_id: str) -> None:
        """Run the template's start script in the background, if the image has one."""
        try:
            front.backend.stat_file(sandbox_id, START_SCRIPT)
        except ShoalError:
            return
        h = front.backend.start(sandbox_id, StartRequest(argv=["/bin/sh", START_SCRIPT], ring_bytes=START_RING))
        self._running[sandbox_id] = (h, time.monotonic())

    def coming_up(self, sandbox_id: str) -> bool:
        got = self._running.get(sandbox_id)
        if got is None:
            return False
        h, t0 = got
        try:
            alive = h.poll() is None
        except ShoalError:
            alive = False
        if alive and time.monotonic() - t0 < START_GRACE:
            return True
        return False

    def forget(self, sandbox_id: str) -> None:
        got = self._running.pop(sandbox_id, None)
        if got is not None:
            got[0].close()


def host_name(raw: bytes) -> str:
    """A Host header's name without its :port."""
    host = raw.decode("latin-1").strip()
    if host.startswith("["):  # [v6]:port
        return host[: host.find("]") + 1] if "]" in host else host
    name, sep, port = host.rpartition(":")
    return name if sep and port.isdigit() else host


def normal_domain(domain: str) -> str:
    """`--domain`: a DNS name, lowercased, without leading or trailing dots (InvalidArgument else)."""
    d = domain.strip().strip(".").lower()
    if not _DOMAIN.match(d):
        raise InvalidArgument(f"--domain {domain!r} is not a DNS name (labels of letters, digits and '-')")
    return d


def route_of(scope: Scope, domain: str | None = None) -> tuple[str, int] | None:
    """(sandbox id, port) when the request is for a sandbox's port, else None (envd or the control plane).
    With a `domain`, a Host of get_host's form under any other domain is refused (_Answer 404): the
    front serves its own domain's names only, not whatever name a client sends it."""
    headers = dict(scope.get("headers") or [])
    port = headers.get(b"e2b-sandbox-port")
    sid = headers.get(b"e2b-sandbox-id")
    if port is not None and sid is not None:
        try:
            n = int(port)
        except ValueError:
            return None
        return (sid.decode("latin-1"), n) if n != ENVD_PORT else None
    host = host_name(headers.get(b"host", b""))
    m = _HOST.match(host)
    if m is None:
        return None
    if domain is not None and m.group(3).rstrip(".").lower() != domain:
        raise _Answer(404, f"host {host!r} is not a sandbox's under this front's domain {domain}")
    if int(m.group(1)) == ENVD_PORT:
        return None
    return m.group(2), int(m.group(1))


class PortRoutes:
    """ASGI middleware in front of the E2B app: port requests (HTTP and WebSocket) are proxied, the
    rest pass through."""

    def __init__(self, app: ASGIApp, front: Front):
        self.app, self.front = app, front
        self._pool: anyio.CapacityLimiter | None = None  # made on the loop (anyio needs one running)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        try:
            route = route_of(scope, self.front.domain)
            if route is None:
                await self.app(scope, receive, send)
                return
            sid, port = route
            if kind == "websocket":
                await self._websocket(scope, receive, send, sid, port)
            else:
                await self._proxy(scope, receive, send, sid, port)
        except _Answer as a:
            if kind == "websocket":
                await _deny(scope, send, a.status, a.message)
            else:
                await _reply(send, a.status, a.message)

    def _box(self, scope: Scope, sid: str, port: int) -> Box:
        box = self.front.boxes.get(sid)
        if box is None or box.paused:
            raise _Answer(502, f"The sandbox {sid} was not found (killed, paused or timed out)")
        headers = dict(scope.get("headers") or [])
        traffic = headers.get(b"e2b-traffic-access-token", b"").decode("latin-1")
        envd = headers.get(b"x-access-token", b"").decode("latin-1")
        ok = bool(traffic) and secrets.compare_digest(traffic, traffic_token(box))
        ok = ok or (bool(envd) and secrets.compare_digest(envd, box.token))
        if not ok:
            raise _Answer(401, f"port {port} of sandbox {sid}: missing or invalid E2B-Traffic-Access-Token")
        if not 1 <= port <= 65535:
            raise _Answer(400, f"invalid port {port}")
        return box

    @contextlib.contextmanager
    def _slot(self, box: Box) -> Iterator[None]:
        """One of the tenant's proxied connections, for as long as it is open (429 past the cap)."""
        limit = self.front.limits.ports
        if not self.front.ports.take(box.tenant, limit):
            raise _Answer(429, f"tenant has {limit} proxied port connections open already (--max-port-connections)")
        try:
            yield
        finally:
            self.front.ports.give(box.tenant)

    async def _connect(self, box: Box, port: int) -> socket.socket:
        """connect_port on a bounded pool of its own: a port that never accepts holds one of its
        threads for the connect timeout at most, never a request handler's, and one tenant holds at
        most `port_connects` of them."""
        sid, tenant, limit = box.id, box.tenant, self.front.limits.port_connects
        if self._pool is None:
            self._pool = anyio.CapacityLimiter(CONNECT_POOL)
        if not self.front.port_connects.take(tenant, limit):
            raise _Answer(429, f"tenant has {limit} connects into sandbox ports in flight already")
        try:
            deadline = time.monotonic() + START_GRACE
            while True:
                try:
                    return await anyio.to_thread.run_sync(self.front.backend.connect_port, sid, port,
                                                          PORT_CONNECT_TIMEOUT, limiter=self._pool)
                except SandboxNotFound:
                    raise _Answer(502, f"The sandbox {sid} was not found (killed, paused or timed out)") from None
                except NotSupported as e:
                    raise _Answer(501, str(e)) from None
                except QuotaExceeded as e:  # shoald's own tunnel caps
                    raise _Answer(429, str(e)) from None
                except SandboxError as e:
                    if self.front.starts.coming_up(sid) and time.monotonic() < deadline:
                        await asyncio.sleep(0.1)
                        continue
                    raise _Answer(502, f"The sandbox {sid}'s port {port} is not open: {e}") from None
        finally:
            self.front.port_connects.give(tenant)

    async def _proxy(self, scope: Scope, receive: Receive, send: Send, sid: str, port: int) -> None:
        box = self._box(scope, sid, port)
        with self._slot(box):
            body = await _body(receive)
            sock = await self._connect(box, port)
            await self._relay(scope, receive, send, sid, port, body, sock)

    async def _relay(self, scope: Scope, receive: Receive, send: Send, sid: str, port: int, body: bytes,
                     sock: socket.socket) -> None:
        reader, writer = await asyncio.open_connection(sock=sock, limit=CHUNK)
        conn = h11.Connection(h11.CLIENT)
        started = False
        answer_by = time.monotonic() + self.front.limits.port_answer_s
        # a client that leaves (the SDK's run_code timeout) closes the connection into the sandbox, so
        # the server there sees it go (the execute server then interrupts the cell)
        watch = asyncio.ensure_future(_on_disconnect(receive, writer))
        try:
            target = scope.get("raw_path") or scope["path"].encode()
            if scope.get("query_string"):
                target += b"?" + scope["query_string"]
            host = dict(scope["headers"]).get(b"host", b"localhost")
            headers = [(b"host", host), *_forwarded(scope["headers"]), (b"content-length", str(len(body)).encode())]
            writer.write(conn.send(h11.Request(method=scope["method"], target=target, headers=headers)) or b"")
            if body:
                writer.write(conn.send(h11.Data(data=body)) or b"")
            writer.write(conn.send(h11.EndOfMessage()) or b"")
            await writer.drain()
            while True:
                ev = conn.next_event()
                if ev is h11.NEED_DATA:
                    if started:  # a streamed answer may pause for as long as it likes (run_code)
                        data = await reader.read(CHUNK)
                    else:  # but its head comes within port_answer_s, or the connection is let go
                        try:
                            data = await asyncio.wait_for(reader.read(CHUNK), max(0.0, answer_by - time.monotonic()))
                        except TimeoutError:
                            raise _Answer(504, f"port {port} of sandbox {sid} sent no answer within "
                                               f"{self.front.limits.port_answer_s:g} s") from None
                    conn.receive_data(data)
                    continue
                if isinstance(ev, h11.InformationalResponse):
                    continue
                if isinstance(ev, h11.Response):
                    await send({"type": "http.response.start", "status": ev.status_code,
                                "headers": [(k, v) for k, v in ev.headers if k not in _HOP or k == b"content-length"]})
                    started = True
                elif isinstance(ev, h11.Data):
                    await send({"type": "http.response.body", "body": bytes(ev.data), "more_body": True})
                elif isinstance(ev, (h11.EndOfMessage, h11.ConnectionClosed)):
                    break
            if started:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            else:
                raise _Answer(502, f"port {port} of sandbox {sid} closed without an answer")
        except (h11.RemoteProtocolError, OSError) as e:
            if started:  # the answer was under way: end it short, as a broken upstream would
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            raise _Answer(502, f"port {port} of sandbox {sid} answered no valid HTTP/1.1: {e}") from None
        finally:
            watch.cancel()
            writer.close()

    async def _websocket(self, scope: Scope, receive: Receive, send: Send, sid: str, port: int) -> None:
        """A WebSocket to a sandbox port: the front accepts the client's only once the server inside
        has accepted its own (with the subprotocol it chose), then relays messages both ways; either
        side's close closes the other."""
        from websockets.asyncio.client import connect as ws_connect
        from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

        if (await receive())["type"] != "websocket.connect":
            return
        box = self._box(scope, sid, port)
        with self._slot(box):
            sock = await self._connect(box, port)
            target = scope.get("raw_path") or scope["path"].encode()
            if scope.get("query_string"):
                target += b"?" + scope["query_string"]
            host = dict(scope["headers"]).get(b"host", b"localhost").decode("latin-1")
            extra = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in _forwarded(scope["headers"])
                     if not k.lower().startswith(b"sec-websocket-")]
            try:
                upstream = await ws_connect(
                    f"ws://{host}{target.decode('latin-1')}", sock=sock, additional_headers=extra,
                    subprotocols=scope.get("subprotocols") or None, compression=None, max_size=WS_MAX_MESSAGE,
                    ping_interval=None,  # a relay adds no pings of its own: the two ends keep their own alive
                    open_timeout=self.front.limits.port_answer_s, user_agent_header=None)
            except InvalidStatus as e:
                sock.close()
                raise _Answer(e.response.status_code, f"port {port} of sandbox {sid} refused the WebSocket") from None
            except (InvalidHandshake, InvalidURI, OSError, TimeoutError) as e:
                sock.close()
                raise _Answer(502, f"port {port} of sandbox {sid}: no WebSocket handshake: {e}") from None
            await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol})

            async def to_sandbox() -> None:
                while True:
                    msg = await receive()
                    if msg["type"] == "websocket.disconnect":
                        await upstream.close(msg.get("code") or 1000)
                        return
                    if msg["type"] == "websocket.receive":
                        data = msg.get("bytes")
                        await upstream.send(data if data is not None else msg.get("text") or "")

            async def to_client() -> None:
                try:
                    async for m in upstream:
                        await send({"type": "websocket.send", **({"text": m} if isinstance(m, str) else {"bytes": m})})
                except ConnectionClosed:
                    pass
                with contextlib.suppress(Exception):  # the client may be gone already
                    await send({"type": "websocket.close", "code": upstream.close_code or 1000,
                                "reason": upstream.close_reason or ""})

            tasks = {asyncio.ensure_future(to_sandbox()), asyncio.ensure_future(to_client())}
            try:
                await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                await upstream.close()


class _Answer(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def _forwarded(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in headers if k.lower() not in _HOP and not k.lower().startswith(b"e2b-sandbox-")]


async def _body(receive: Receive) -> bytes:
    out = bytearray()
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise _Answer(400, "the client left")
        out += msg.get("body", b"")
        if len(out) > MAX_BODY:
            raise _Answer(413, f"request body over {MAX_BODY} bytes")
        if not msg.get("more_body", False):
            return bytes(out)


async def _on_disconnect(receive: Receive, writer: asyncio.StreamWriter) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    writer.transport.abort()


async def _deny(scope: Scope, send: Send, status: int, message: str) -> None:
    """Refuse a WebSocket before it is accepted: an HTTP answer where the server can send one."""
    if "websocket.http.response" in (scope.get("extensions") or {}):
        body = json.dumps({"code": status, "message": message}).encode()
        await send({"type": "websocket.http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "websocket.http.response.body", "body": body})
    else:
        await send({"type": "websocket.close", "code": 1008, "reason": message[:120]})


async def _reply(send: Send, status: int, message: str) -> None:
    body = json.dumps({"code": status, "message": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
