"""Port routes: a byte tunnel to 127.0.0.1:PORT inside a sandbox (`SandboxBackend.connect_port`).

`POST /v1/sandboxes/{id}/ports/{port}/connect` answers 200 at once and then carries the connection both
ways over the one HTTP/1.1 exchange: the request body (chunked, sent as the client writes) goes to the
sandbox's port, and what the port sends comes back as the response body; either side's end closes it.
Only the sandbox's tenant (or the admin) may open one; the HTTP backend's `connect_port` is its client.
`GET /v1/sandboxes/{id}/ports/{port}/sockets` is `SandboxBackend.port_sockets`: who holds that port
inside the sandbox (a grader's question before it trusts the server there).

Bounds, since a tenant (or the agent behind it) is hostile: at most MAX_TUNNELS open per sandbox and
MAX_TENANT_TUNNELS per tenant; the connect itself (which blocks a thread until the port accepts or the
timeout passes: a port whose listener never accepts) runs on a pool of CONNECT_POOL threads of its
own, never the daemon's request threads, and a tenant has at most TENANT_CONNECTS of them in flight.
"""
from __future__ import annotations

import asyncio
import contextlib
import socket
import threading

import anyio
from fastapi import APIRouter, Depends, Query, Response
from pydantic import BaseModel, Field
from starlette.types import Receive, Scope, Send

from ...core.contract import API_PREFIX, PORT_CONNECT_TIMEOUT, PortSocket, check_port
from ...core.errors import QuotaExceeded
from ..auth import Caller, caller

router = APIRouter(prefix=API_PREFIX + "/sandboxes/{sandbox_id}", tags=["ports"])

MAX_TUNNELS = 64  # open tunnels per sandbox: each holds two sockets and a task in the daemon
MAX_TENANT_TUNNELS = 256  # open tunnels per tenant, over all its sandboxes (the admin: per sandbox only)
TENANT_CONNECTS = 8  # connects in flight per tenant (each holds a pool thread up to its timeout)
CONNECT_POOL = 32  # threads connecting into sandboxes at once, over all tenants
CHUNK = 64 << 10

_open: dict[str, int] = {}  # by sandbox id, and by "tenant:NAME"
_connecting: dict[str, int] = {}  # by tenant
_lock = threading.Lock()
_pool: anyio.CapacityLimiter | None = None  # made on the event loop (anyio needs a running one)


class Tunnel(Response):
    """An ASGI response that relays bytes between the HTTP exchange and a connected socket."""

    def __init__(self, keys: list[str], sock: socket.socket):
        super().__init__(status_code=200, media_type="application/octet-stream")
        self.keys, self.sock = keys, sock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            reader, writer = await asyncio.open_connection(sock=self.sock)
        except BaseException:
            self.sock.close()
            _release(self.keys)
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
            _release(self.keys)
            with contextlib.suppress(Exception):
                await send({"type": "http.response.body", "body": b"", "more_body": False})


def _release(keys: list[str], counts: dict[str, int] = _open) -> None:
    with _lock:
        for k in keys:
            n = counts.get(k, 1) - 1
            if n <= 0:
                counts.pop(k, None)
            else:
                counts[k] = n


def _take(sid: str, tenant: str, admin: bool) -> list[str]:
    """Count one more open tunnel against the sandbox and the tenant (QuotaExceeded past a cap)."""
    keys = [sid] if admin else [sid, "tenant:" + tenant]
    with _lock:
        if _open.get(sid, 0) >= MAX_TUNNELS:
            raise QuotaExceeded(f"sandbox {sid} has {MAX_TUNNELS} port tunnels open already")
        if not admin and _open.get(keys[1], 0) >= MAX_TENANT_TUNNELS:
            raise QuotaExceeded(f"tenant {tenant} has {MAX_TENANT_TUNNELS} port tunnels open already")
        if not admin and _connecting.get(tenant, 0) >= TENANT_CONNECTS:
            raise QuotaExceeded(f"tenant {tenant} has {TENANT_CONNECTS} port connects in flight already")
        for k in keys:
            _open[k] = _open.get(k, 0) + 1
        _connecting[tenant] = _connecting.get(tenant, 0) + 1
    return keys


@router.post("/ports/{port}/connect", response_class=Response)
async def connect(sandbox_id: str, port: int, timeout: float = Query(PORT_CONNECT_TIMEOUT, gt=0, le=60),
                  c: Caller = Depends(caller)) -> Tunnel:
    """A tunnel to 127.0.0.1:`port` inside the sandbox (module docstring)."""
    global _pool
    check_port(port)
    sid = await anyio.to_thread.run_sync(c.sandbox, sandbox_id)
    keys = _take(sid, c.t.name, c.t.admin)
    if _pool is None:
        _pool = anyio.CapacityLimiter(CONNECT_POOL)
    try:
        sock = await anyio.to_thread.run_sync(c.d.backend.connect_port, sid, port, timeout, limiter=_pool)
    except BaseException:
        _release(keys)
        raise
    finally:
        _release([c.t.name], _connecting)
    return Tunnel(keys, sock)


@router.get("/ports/{port}/sockets")
def port_sockets(sandbox_id: str, port: int, c: Caller = Depends(caller)) -> list[PortSocket]:
    """The sockets on `port` inside the sandbox that its processes hold, with their holders."""
    check_port(port)
    return c.d.backend.port_sockets(c.sandbox(sandbox_id), port)


@router.post("/ports/{port}/guard")
def guard_port(sandbox_id: str, port: int, c: Caller = Depends(caller)) -> dict:
    """Only the host side (connect_port) reaches `port` in the sandbox from now on."""
    check_port(port)
    c.d.backend.guard_port(c.sandbox(sandbox_id), port)
    return {"guarded": True}


@router.get("/ports/{port}/guard")
def port_guarded(sandbox_id: str, port: int, c: Caller = Depends(caller)) -> dict:
    check_port(port)
    return {"guarded": c.d.backend.port_guarded(c.sandbox(sandbox_id), port)}


class WrittenRequest(BaseModel):
    paths: list[str] = Field(max_length=64)
    limit: int = Field(20, ge=1, le=1000)


@router.post("/written")
def written_under(sandbox_id: str, req: WrittenRequest, c: Caller = Depends(caller)) -> list[str]:
    """What the sandbox wrote at or below `paths` (SandboxBackend.written_under)."""
    return c.d.backend.written_under(c.sandbox(sandbox_id), req.paths, req.limit)
