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
import hashlib
import hmac
import json
import re
import secrets
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import anyio
import h11
from starlette.types import ASGIApp, Receive, Scope, Send

from ..core.contract import ProcessHandle, StartRequest
from ..core.errors import NotSupported, SandboxError, SandboxNotFound, ShoalError
from .state import Box

if TYPE_CHECKING:
    from .front import Front

ENVD_PORT = 49983  # the SDK's envd port: requests naming it are envd's own routes
START_SCRIPT = "/etc/e2b/start.sh"  # a template's start command, run at create (the code interpreter's server)
START_RING = 64 << 10  # bytes of the start command's output the front keeps (a log tail, per stream)
START_GRACE = 30.0  # seconds a port may refuse while the template's start command is still coming up
MAX_BODY = 64 << 20  # bytes of one proxied request body
CHUNK = 64 << 10
_HOST = re.compile(r"^(\d{1,5})-([A-Za-z0-9][A-Za-z0-9_-]*)\.")
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


def route_of(scope: Scope) -> tuple[str, int] | None:
    """(sandbox id, port) when the request is for a sandbox's port, else None (envd or the control plane)."""
    headers = dict(scope.get("headers") or [])
    port = headers.get(b"e2b-sandbox-port")
    sid = headers.get(b"e2b-sandbox-id")
    if port is not None and sid is not None:
        try:
            n = int(port)
        except ValueError:
            return None
        return (sid.decode("latin-1"), n) if n != ENVD_PORT else None
    m = _HOST.match(headers.get(b"host", b"").decode("latin-1"))
    if m is not None and int(m.group(1)) != ENVD_PORT:
        return m.group(2), int(m.group(1))
    return None


class PortRoutes:
    """ASGI middleware in front of the E2B app: port requests are proxied, the rest pass through."""

    def __init__(self, app: ASGIApp, front: Front):
        self.app, self.front = app, front

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = route_of(scope) if scope["type"] == "http" else None
        if route is None:
            await self.app(scope, receive, send)
            return
        sid, port = route
        try:
            await self._proxy(scope, receive, send, sid, port)
        except _Answer as a:
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

    async def _connect(self, sid: str, port: int):
        deadline = time.monotonic() + START_GRACE
        while True:
            try:
                return await anyio.to_thread.run_sync(self.front.backend.connect_port, sid, port)
            except SandboxNotFound:
                raise _Answer(502, f"The sandbox {sid} was not found (killed, paused or timed out)") from None
            except NotSupported as e:
                raise _Answer(501, str(e)) from None
            except SandboxError as e:
                if self.front.starts.coming_up(sid) and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                    continue
                raise _Answer(502, f"The sandbox {sid}'s port {port} is not open: {e}") from None

    async def _proxy(self, scope: Scope, receive: Receive, send: Send, sid: str, port: int) -> None:
        self._box(scope, sid, port)
        body = await _body(receive)
        sock = await self._connect(sid, port)
        reader, writer = await asyncio.open_connection(sock=sock, limit=CHUNK)
        conn = h11.Connection(h11.CLIENT)
        started = False
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
                    data = await reader.read(CHUNK)
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


async def _reply(send: Send, status: int, message: str) -> None:
    body = json.dumps({"code": status, "message": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
