"""Port routes: a byte tunnel to 127.0.0.1:PORT inside a sandbox (`SandboxBackend.connect_port`).

`POST /v1/sandboxes/{id}/ports/{port}/connect` answers 200 at once and then carries the connection both
ways over the one HTTP/1.1 exchange: the request body (chunked, sent as the client writes) goes to the
sandbox's port, and what the port sends comes back as the response body; either side's end closes it.
Only the sandbox's tenant (or the admin) may open one; the HTTP backend's `connect_port` is its client.
"""
from __future__ import annotations

import asyncio
import contextlib
import socket
import threading

from fastapi import APIRouter, Depends, Query, Response
from starlette.types import Receive, Scope, Send

from ...core.contract import API_PREFIX, PORT_CONNECT_TIMEOUT, check_port
from ...core.errors import QuotaExceeded
from ..auth import Caller, caller

router = APIRouter(prefix=API_PREFIX + "/sandboxes/{sandbox_id}", tags=["ports"])

MAX_TUNNELS = 64  # open tunnels per sandbox: each holds two sockets and a task in the daemon
CHUNK = 64 << 10

_open: dict[str, int] = {}
_lock = threading.Lock()


class Tunnel(Response):
    """An ASGI response that relays bytes between the HTTP exchange and a connected socket."""

    def __init__(self, sid: str, sock: socket.socket):
        super().__init__(status_code=200, media_type="application/octet-stream")
        self.sid, self.sock = sid, sock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            reader, writer = await asyncio.open_connection(sock=self.sock)
        except BaseException:
            self.sock.close()
            _release(self.sid)
            raise
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/octet-stream"), (b"cache-control", b"no-store")]})

        async def upstream() -> None:  # the client's writes -> the sandbox's port
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    return
                if msg.get("body"):
                    writer.write(msg["body"])
                    await writer.drain()
                if not msg.get("more_body", False):
                    if writer.can_write_eof():
                        writer.write_eof()
                    await asyncio.Event().wait()  # half-closed: keep relaying the other way until it ends

        async def downstream() -> None:  # the sandbox's port -> the client
            while data := await reader.read(CHUNK):
                await send({"type": "http.response.body", "body": data, "more_body": True})

        up, down = asyncio.ensure_future(upstream()), asyncio.ensure_future(downstream())
        try:
            await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (up, down):
                t.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.gather(up, down, return_exceptions=True)
            writer.close()
            _release(self.sid)
            with contextlib.suppress(Exception):
                await send({"type": "http.response.body", "body": b"", "more_body": False})


def _release(sid: str) -> None:
    with _lock:
        n = _open.get(sid, 1) - 1
        if n <= 0:
            _open.pop(sid, None)
        else:
            _open[sid] = n


@router.post("/ports/{port}/connect", response_class=Response)
def connect(sandbox_id: str, port: int, timeout: float = Query(PORT_CONNECT_TIMEOUT, gt=0, le=60),
            c: Caller = Depends(caller)) -> Tunnel:
    """A tunnel to 127.0.0.1:`port` inside the sandbox (module docstring)."""
    sid = c.sandbox(sandbox_id)
    check_port(port)
    with _lock:
        if _open.get(sid, 0) >= MAX_TUNNELS:
            raise QuotaExceeded(f"sandbox {sid} has {MAX_TUNNELS} port tunnels open already")
        _open[sid] = _open.get(sid, 0) + 1
    try:
        sock = c.d.backend.connect_port(sid, port, timeout)
    except BaseException:
        _release(sid)
        raise
    return Tunnel(sid, sock)
