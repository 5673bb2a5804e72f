"""Health (no auth: it says nothing about anyone's sandboxes but their count) and Prometheus metrics."""
from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from ...core.contract import API_PREFIX
from ..auth import daemon_of

VERSION = "0.1.0"

router = APIRouter(tags=["health"])


@router.get(API_PREFIX + "/health")
def health(request: Request) -> dict[str, Any]:
    d = daemon_of(request)
    return {"ok": True, **d.health(), "version": VERSION, "uptime_s": round(time.time() - d.started, 1)}


@router.get("/metrics", response_class=PlainTextResponse)
def metrics(request: Request) -> str:
    d = daemon_of(request)
    lines = []
    for k, v in d.gauges().items():
        lines += [f"# TYPE shoal_{k} gauge", f"shoal_{k} {v}"]
    for k, n in d.totals().items():
        lines += [f"# TYPE shoal_{k}_total counter", f"shoal_{k}_total {n}"]
    return "\n".join(lines) + "\n"
