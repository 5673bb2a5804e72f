"""shoald's HTTP API (FastAPI): the routes of `routes/` over one `Served` (a host's `Daemon`, or a fleet gateway).

Auth is `auth.py` (keys, and the Unix-socket peer's uid), quotas `quotas.py`, admission
`admission.py`, the error shape `errors.py`. See docs/api.md."""
from __future__ import annotations

from fastapi import FastAPI

from . import errors
from .routes import ROUTERS
from .routes.health import VERSION
from .served import Served


def create_app(daemon: Served | None, title: str = "shoald") -> FastAPI:
    """The app serving `daemon` (a host's Daemon, or a fleet's Gateway: the same routes); with None,
    an app that only describes the API (its OpenAPI spec)."""
    app = FastAPI(title=title, version=VERSION,
                  description="Shoal host daemon: sandboxes, exec, files, sessions, snapshots, tenants.")
    app.state.daemon = daemon
    errors.install(app, daemon.counters if daemon is not None else None)
    for router in ROUTERS:
        app.include_router(router)
    policy = getattr(daemon, "idle", None)
    if policy is not None:  # a host's daemon with an idle policy: requests are its activity
        from .idle import ActivityMiddleware

        app.add_middleware(ActivityMiddleware, policy=policy)
    return app
