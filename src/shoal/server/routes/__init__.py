"""shoald's routes, one module per resource; every one under `API_PREFIX` (except /metrics)."""
from __future__ import annotations

from fastapi import APIRouter

from . import desktop, episodes, exec, files, health, images, ports, sandboxes, sessions, snapshots, tenants, watch

ROUTERS: list[APIRouter] = [m.router for m in (health, sandboxes, exec, sessions, files, snapshots, images, tenants,
                                               ports, episodes, desktop, watch)]
