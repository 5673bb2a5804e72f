"""Tenant quotas: what a tenant's live sandboxes hold, and reserving room for new ones.

A create (or a fork of n) reserves its share before it starts and holds it as pending until the
sandboxes are owned, so concurrent creates cannot both slip under a quota."""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ..core import errors as E
from ..core.contract import CreateRequest, Limits
from .state import Tenant

if TYPE_CHECKING:
    from .daemon import Daemon

RESOURCES = ("sandboxes", "cpu", "memory_mb", "disk_mb")


def limits_of(req: CreateRequest, defaults) -> Limits:
    """The limits a create request will get: its own, else the host's defaults."""
    return Limits(cpu=req.cpu or defaults.default_cpu, memory_mb=req.memory_mb or defaults.default_memory_mb,
                  disk_mb=req.disk_mb or defaults.default_disk_mb, pids=req.pids or defaults.default_pids,
                  upper=req.upper or "tmpfs")


def totals(limits: list[Limits]) -> dict[str, float]:
    return {"sandboxes": len(limits), "cpu": sum(x.cpu for x in limits),
            "memory_mb": sum(x.memory_mb for x in limits), "disk_mb": sum(x.disk_mb for x in limits)}


class QuotaBook:
    def __init__(self, daemon: Daemon):
        self.d = daemon
        self._lock = threading.Lock()
        self._pending: dict[str, dict[str, float]] = {}  # tenant -> resources of creates in flight

    def usage(self, tenant: Tenant) -> dict[str, float]:
        """What the tenant's live sandboxes hold."""
        be = self.d.backend
        live = be.live_ids()
        mine = []
        for sid in self.d.state.owned("sandbox", tenant.name):
            if sid in live:
                try:
                    mine.append(be.info(sid).limits)
                except E.ShoalError:  # ended meanwhile
                    continue
        return totals(mine)

    @contextlib.contextmanager
    def reserve(self, tenant: Tenant, new: list[Limits]) -> Iterator[None]:
        """Check `new` sandboxes against the tenant's quotas and hold them until the block ends."""
        if tenant.admin:
            yield
            return
        want = totals(new)
        caps = {k: getattr(tenant.quotas, k) for k in RESOURCES}
        with self._lock:
            use = self.usage(tenant)
            pending = self._pending.setdefault(tenant.name, {k: 0.0 for k in RESOURCES})
            for name in RESOURCES:
                have = use[name] + pending[name]
                if have + want[name] > caps[name]:
                    raise E.QuotaExceeded(f"tenant {tenant.name} quota {name}={caps[name]:g} would be exceeded "
                                          f"(in use {have:g}, asked {want[name]:g})")
            for k, v in want.items():
                pending[k] += v
        try:
            yield
        finally:
            with self._lock:
                for k, v in want.items():
                    pending[k] -= v
