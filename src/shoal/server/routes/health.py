"""Health (no auth: it says nothing about anyone's sandboxes but their count) and Prometheus metrics."""
from __future__ import annotations

import os
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
    return {"ok": True, "host": d.settings.host_tag, "version": VERSION,
            "sandboxes": len(d.backend.live_ids()), "uptime_s": round(time.time() - d.started, 1)}


@router.get("/metrics", response_class=PlainTextResponse)
def metrics(request: Request) -> str:
    d = daemon_of(request)
    live = d.backend.list()
    gauges = {"sandboxes": len(live), "sandboxes_starting": d.admission.starting,
              "sandbox_memory_bytes": sum(i.memory_bytes or 0 for i in live),
              "background_commands": d.commands.count(), "sessions": d.sessions.count(),
              "open_fds": len(os.listdir("/proc/self/fd"))}
    lines = []
    for k, v in gauges.items():
        lines += [f"# TYPE shoal_{k} gauge", f"shoal_{k} {v}"]
    lines += ["# TYPE shoal_admission_refusals_total counter", f"shoal_admission_refusals_total {d.admission.refusals}"]
    for k, v in d.counters.items():
        lines += [f"# TYPE shoal_{k}_total counter", f"shoal_{k}_total {v}"]
    return "\n".join(lines) + "\n"
