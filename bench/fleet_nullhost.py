#!/usr/bin/env python3
"""shoald, the real daemon (HTTP API, mTLS, admission, idempotency keys in SQLite, the fleet agent
registering and heartbeating in PostgreSQL), over a *null* container backend: a create resolves its
image in the host's layer store and answers a `SandboxInfo` the way a real one does, but starts
nothing, mounts nothing and holds no resource. Kill, info and list answer from memory.

bench/fleet.py uses it to measure what the gateway and PostgreSQL sustain in placements per second,
without the cost of starting sandboxes on a 2-core machine (that cost is per host and is measured by
bench/startup.py and bench/api.py). Exec and file calls are refused (501): no process exists.

    python bench/fleet_nullhost.py serve --join postgresql://... (the same flags as `shoal serve`)
"""
from __future__ import annotations

import secrets
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from shoal.backends import LOCAL_BACKENDS  # noqa: E402
from shoal.backends.local import LocalBackend  # noqa: E402
from shoal.core import errors as E  # noqa: E402
from shoal.core.contract import CreateRequest, Limits, SandboxInfo, SandboxState  # noqa: E402


class NullBackend(LocalBackend):
    name = "container"
    id_prefix = "sb"

    def __init__(self, host):
        super().__init__(host)
        self._live: dict[str, SandboxInfo] = {}
        self._lock = threading.Lock()

    def sweep(self) -> list[str]:
        return []

    def create(self, req: CreateRequest) -> SandboxInfo:
        image, layers, _config = self.host.resolve_layers(req.image, req.layers)  # the store is consulted
        lim = Limits(**{k: getattr(req, k) for k in ("cpu", "memory_mb", "disk_mb", "pids") if getattr(req, k, None)})
        info = SandboxInfo(id=f"sb-{self.settings.host_tag}-{secrets.token_hex(6)}", image=image or "", layers=layers,
                           limits=lim, state=SandboxState.RUNNING, created=time.time(), ttl=req.ttl)
        with self._lock:
            self._live[info.id] = info
        return info

    def info(self, sandbox_id: str) -> SandboxInfo:
        with self._lock:
            info = self._live.get(sandbox_id)
        if info is None:
            raise E.SandboxNotFound(f"sandbox {sandbox_id} not found")
        return info

    def kill(self, sandbox_id: str) -> None:
        with self._lock:
            if self._live.pop(sandbox_id, None) is None:
                raise E.SandboxNotFound(f"sandbox {sandbox_id} not found")

    def list(self) -> list[SandboxInfo]:
        with self._lock:
            return list(self._live.values())

    def live_ids(self) -> set[str]:
        with self._lock:
            return set(self._live)

    def committed(self) -> list[Limits]:
        with self._lock:
            return [i.limits for i in self._live.values()]

    def live_layers(self) -> set[str]:
        with self._lock:
            return {d for i in self._live.values() for d in i.layers}

    def _none(self, *a, **kw):
        raise E.BackendUnavailable("the null backend runs no process (bench/fleet_nullhost.py)")

    launch = upper_dir = root_files = exec = start = open_session = _none  # type: ignore[assignment]
    pause = resume = set_ttl = get_network = set_network = _none  # type: ignore[assignment]


LOCAL_BACKENDS.clear()  # gVisor too: this host has one backend, the null one
LOCAL_BACKENDS["container"] = ("sb", "fleet_nullhost:NullBackend")

if __name__ == "__main__":
    from shoal.cli import app

    sys.argv[0] = "shoal"
    app()
