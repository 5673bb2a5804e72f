"""The E2B-compatible server: the REST control plane and the envd front on one port, over any backend.

Point the SDK at it with E2B_API_URL and E2B_SANDBOX_URL set to the same address (docs/e2b.md).
"""
from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..core.contract import SandboxBackend
from ..core.errors import InvalidArgument, QuotaExceeded, SandboxNotFound, ShoalError
from . import control, envd, snapshots
from .front import ApiError, Front, Limits
from .ports import PortRoutes, normal_domain
from .state import Boxes, BoxStore, Keys
from .templates import DEFAULT_TEMPLATES

CONTROL_BODY_MAX = 64 << 10  # bytes of a control-plane request body (create's JSON is well under 1 KiB)
_ENVD_PREFIXES = ("/process.Process/", "/filesystem.Filesystem/", "/files", "/health")


class ControlGuard:
    """The control plane (every path that is not envd's) checks X-API-KEY before any body is read,
    and reads at most CONTROL_BODY_MAX bytes of one: an unauthenticated client cannot make the front
    buffer anything, and an authenticated one not more than that. envd's routes check their sandbox's
    token first and cap their own bodies (envd.py)."""

    def __init__(self, app: Any, keys: Keys):
        self.app, self.keys = app, keys

    async def __call__(self, scope: dict, receive: Callable[[], Awaitable[dict]],
                       send: Callable[[dict], Awaitable[None]]) -> None:
        if scope.get("type") != "http" or scope.get("path", "").startswith(_ENVD_PREFIXES):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.keys.tenant(headers.get("x-api-key")) is None:
            await _reply(send, 401, "Invalid API key: pass a key from `shoal e2b key create` in X-API-KEY")
            return
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > CONTROL_BODY_MAX:
            await _reply(send, 413, f"request body over {CONTROL_BODY_MAX} bytes")
            return
        body, more = b"", True
        while more:
            msg = await receive()
            if msg["type"] != "http.request":
                return  # the client went away
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
            if len(body) > CONTROL_BODY_MAX:
                await _reply(send, 413, f"request body over {CONTROL_BODY_MAX} bytes")
                return
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _reply(send: Callable[[dict], Awaitable[None]], status: int, message: str) -> None:
    payload = json.dumps({"code": status, "message": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": payload})


def make_app(backend: SandboxBackend, keys: Keys, templates: Mapping[str, str] | None = None,
             default_timeout: float = 300.0, state: Path | None = None, limits: Limits | None = None,
             domain: str | None = None, sandbox_backend: str | None = None) -> FastAPI:
    """state: the index's SQLite file (None: memory only). Sandboxes it lists that the backend no
    longer has are dropped at start. domain: get_host's domain (ports.py); None serves any."""
    store = BoxStore(state) if state is not None else None
    front = Front(backend=backend, keys=keys, templates=dict(templates or DEFAULT_TEMPLATES),
                  default_timeout=default_timeout, boxes=Boxes(store), limits=limits or Limits(),
                  domain=normal_domain(domain) if domain else None, sandbox_backend=sandbox_backend)
    front.snapshots.store = store
    front.snapshots.load()
    if store is not None:
        for box in store.load():
            try:
                backend.info(box.id)
            except SandboxNotFound:
                store.delete(box.id)
                continue
            front.boxes.add(box)
    app = FastAPI(title="Shoal E2B front", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.front = front
    app.include_router(control.router(front))
    app.include_router(envd.router(front))
    app.include_router(snapshots.router(front))
    app.add_middleware(ControlGuard, keys=keys)
    # added last, so outermost: a sandbox port's traffic (its own token) never meets the API key check
    app.add_middleware(PortRoutes, front=front)  # sandbox ports: get_host, the code interpreter

    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError) -> JSONResponse:
        return JSONResponse({"code": e.status, "message": e.message}, status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"code": e.status_code, "message": str(e.detail)}, status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def bad_request(_: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse({"code": 400, "message": f"bad request: {e.errors()}"}, status_code=400)

    @app.exception_handler(ShoalError)
    async def shoal_error(_: Request, e: ShoalError) -> JSONResponse:
        status = 404 if isinstance(e, SandboxNotFound) else 400 if isinstance(e, InvalidArgument) \
            else 429 if isinstance(e, QuotaExceeded) else 500
        return JSONResponse({"code": status, "message": f"{type(e).__name__}: {e}"}, status_code=status)

    @app.on_event("shutdown")
    def _close() -> None:
        front.close()
        if store is not None:
            store.close()

    return app


def default_keys_path(root: str | None = None) -> Path:
    from ..config import load_settings

    return load_settings(root).root / "e2b-keys.json"


def serve(backend: SandboxBackend, keys: Keys, host: str = "127.0.0.1", port: int = 3000,
          templates: Mapping[str, str] | None = None, log_level: str = "warning", state: Path | None = None,
          tls: tuple[str, str] | None = None, limits: Limits | None = None, domain: str | None = None,
          sandbox_backend: str | None = None) -> None:
    """`tls`: (certificate, key) PEM files: serve https."""
    import uvicorn

    uvicorn.run(make_app(backend, keys, templates, state=state, limits=limits, domain=domain,
                         sandbox_backend=sandbox_backend), host=host, port=port,
                log_level=log_level, ws="websockets-sansio",  # WebSockets to sandbox ports (ports.py)
                http="h11", access_log=False, timeout_graceful_shutdown=2,  # open streams don't hold a stop
                ssl_certfile=tls[0] if tls else None, ssl_keyfile=tls[1] if tls else None)
