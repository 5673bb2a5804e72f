"""What every route shares: the served backend, tenants and ownership, admission, live handles, metrics.

shoald serves a `SandboxBackend`: in practice this host (`shoal.host.Host`), which also offers the
housekeeping a daemon needs (`ServedBackend`). The daemon never goes through the SDK.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ..config import Settings
from ..core import errors as E
from ..core.contract import CreateRequest, ForkReply, ForkRequest, Limits, SandboxBackend, SandboxInfo
from .admission import Admission, AdmissionConfig
from .handles import HandleTable
from .idle import IdlePolicy
from .quotas import QuotaBook, limits_of
from .served import Handles, Served
from .state import DaemonState, Tenant, own_memory_pool

log = logging.getLogger("shoald")


@runtime_checkable
class Housekeeping(Protocol):
    """What shoald needs beyond the contract: cheap views of what holds resources, and the reaper."""

    settings: Settings
    store: Any  # shoal.layers.store.LayerStore: images and layers

    def sweep(self) -> list[str]: ...

    def live_ids(self) -> set[str]: ...

    def committed(self) -> list[Limits]: ...

    def live_layers(self) -> set[str]: ...


class Daemon(Served):
    backend: Any  # a SandboxBackend that also keeps house (Housekeeping): in practice, Host

    def __init__(self, backend: Any, admission: AdmissionConfig | None = None, admin_key: str | None = None,
                 state_path: Path | None = None, reap_every_s: float = 5.0):
        if not (isinstance(backend, SandboxBackend) and isinstance(backend, Housekeeping)):
            raise E.InvalidArgument(f"shoald serves a SandboxBackend that keeps house (sweep, live_ids, committed, "
                                    f"live_layers, settings, store), such as Host; got {type(backend).__name__}")
        self._init_served()
        self.counters.update(reclaims=0, reclaimed_bytes=0)  # POST .../reclaim (and the idle policy)
        self.backend = backend
        self.settings: Settings = backend.settings
        self.state = self.db = DaemonState(state_path or self.settings.root / "shoald.db")
        self.admission = Admission(admission)
        self.admin_key = admin_key
        cfg = self.admission.cfg
        # the backend's live ProcessHandle / SessionHandle objects, under ids this daemon issues
        self.commands = HandleTable("cmd", "background command", cfg.commands_per_sandbox,
                                    finished=lambda h: h.poll() is not None)
        self.sessions = HandleTable("ses", "session", cfg.sessions_per_sandbox)
        self.quotas = QuotaBook(self)
        # creates under one idempotency key run one at a time (striped: no lock per key to forget)
        self._create_locks = [threading.Lock() for _ in range(64)]
        self._start_zram()
        self._start_backends()
        threading.Thread(target=self._reap, args=(reap_every_s,), name="shoald-reaper", daemon=True).start()
        self.idle: IdlePolicy | None = self._idle_policy()

    def _idle_policy(self) -> IdlePolicy | None:
        """[density] idle_pause_s / reclaim_after_s: pause, then reclaim, sandboxes left idle (idle.py)."""
        s = self.settings
        if not (s.idle_pause_s or s.reclaim_after_s):
            return None
        policy = IdlePolicy(self.backend, s.idle_pause_s, s.reclaim_after_s, s.reclaim_target, self.counters)
        policy.start()
        return policy

    def _start_zram(self) -> None:
        """Shoal's zram swap device, when the config enables it ([density] zram_mb): made once, reused
        by a restarted daemon, left in place at exit (live sandboxes may have pages in it)."""
        from ..backends.container import zram

        cfg = zram.config_of(self.settings)
        if cfg is None:
            return
        try:
            dev = zram.setup(cfg)
            log.info("zram swap: %s (%d MiB, %s, priority %d)", dev.path, dev.size_mb, dev.algorithm, dev.priority)
        except E.ShoalError as e:  # serve anyway: reclaim then says why it cannot
            log.error("zram swap not set up: %s", e)
        self._start_zswap()

    def _start_zswap(self) -> None:
        """[density] zswap_compressor: the kernel's zswap on, with that compressor, in front of the swap
        (host-wide; the values found are recorded and `shoal zram down` puts them back)."""
        if not self.settings.zswap_compressor:
            return
        from ..backends.container import zswap

        try:
            zswap.setup(self.settings.zswap_compressor)
            log.info("zswap on with %s in front of the swap", self.settings.zswap_compressor)
        except E.ShoalError as e:
            log.error("zswap not set up: %s", e)

    def _start_backends(self) -> None:
        """Sweep orphans and reattach to the live sandboxes of every local backend before serving."""
        starter = getattr(self.backend, "backend", None)
        if starter is None:
            return
        from ..backends import LOCAL_BACKENDS

        for name in LOCAL_BACKENDS:
            try:
                starter(name)
            except Exception as e:  # e.g. gVisor not installed: its sandboxes cannot exist either
                log.warning("backend %s not started: %s", name, e)

    def _reap(self, every_s: float) -> None:
        """Close the sessions and commands of sandboxes that ended on their own (TTL, OOM, crash)."""
        while True:
            time.sleep(every_s)
            try:
                self.backend.sweep()  # state of sandboxes whose supervising processes are both gone
                live = self.backend.live_ids()
                self.commands.prune(live)
                self.sessions.prune(live)
            except Exception as e:  # keep reaping; a failed round is retried in a few seconds
                log.warning("handle reaper: %s", e)

    # ---------------------------------------------------------------- served
    def info(self, tenant: Tenant, sandbox_id: str) -> SandboxInfo:
        return self.backend.info(self.visible(tenant, sandbox_id))

    def keep(self, table: Handles, sandbox_id: str, obj: Any) -> str:
        table.prune(self.backend.live_ids())  # forget what sandboxes that ended on their own held
        return table.add(sandbox_id, obj)

    def create(self, tenant: Tenant, req: CreateRequest, idempotency_key: str | None = None) -> SandboxInfo:
        if idempotency_key is None:
            return self._create(tenant, req)
        with self._create_locks[hash((tenant.name, idempotency_key)) % len(self._create_locks)]:
            done = self.db.created_for(tenant.name, idempotency_key)
            if done is not None:
                try:
                    return self.backend.info(done)  # a retry: the sandbox the first call made
                except E.SandboxNotFound:
                    raise E.SandboxNotFound(f"sandbox {done}, created under idempotency key {idempotency_key!r}, "
                                            "has ended") from None
            info = self._create(tenant, req)
            self.db.remember_create(tenant.name, idempotency_key, info.id)
            return info

    def _create(self, tenant: Tenant, req: CreateRequest) -> SandboxInfo:
        req = own_memory_pool(tenant, req)
        limits = limits_of(req, self.settings)
        with self.quotas.reserve(tenant, [limits]):
            committed = self.backend.committed()
            with self.admission.creating(len(committed), sum(x.memory_mb for x in committed), limits.memory_mb):
                info = self.backend.create(req)
            self.state.own("sandbox", info.id, tenant.name)
        self.counters["creates"] += 1
        return info

    def fork(self, tenant: Tenant, sandbox_id: str, req: ForkRequest) -> ForkReply:
        src = self.backend.info(self.visible(tenant, sandbox_id)).limits
        child = Limits(cpu=req.cpu or src.cpu, memory_mb=req.memory_mb or src.memory_mb,
                       disk_mb=req.disk_mb or src.disk_mb, pids=req.pids or src.pids,
                       upper=req.upper or src.upper)  # children: the source's limits unless given
        with self.quotas.reserve(tenant, [child] * req.n):
            reply = self.backend.fork(sandbox_id, req)
            self.state.own("image", reply.snapshot.image, tenant.name)
            for sb in reply.sandboxes:
                self.state.own("sandbox", sb.id, tenant.name)
        self.counters["creates"] += len(reply.sandboxes)
        return reply

    def usage(self, tenant: Tenant) -> dict[str, float]:
        return self.quotas.usage(tenant)

    def health(self) -> dict[str, Any]:
        return {"host": self.settings.host_tag, "sandboxes": len(self.backend.live_ids())}

    def gauges(self) -> dict[str, float]:
        live = self.backend.list()
        return {"sandboxes": len(live), "sandboxes_starting": self.admission.starting,
                "sandbox_memory_bytes": sum(i.memory_bytes or 0 for i in live),
                "background_commands": self.commands.count(), "sessions": self.sessions.count(),
                "open_fds": len(os.listdir("/proc/self/fd")), **self._density_gauges()}

    def _density_gauges(self) -> dict[str, float]:
        """The idle policy's state and what Shoal's zram device holds (original vs RAM used)."""
        out: dict[str, float] = {}
        if self.idle is not None:
            out.update(sandboxes_idle_paused=len(self.idle.paused), sandboxes_idle_reclaimed=len(self.idle.reclaimed))
        from ..backends.container import zram

        dev = zram.current() if self.settings.zram_mb else None
        if dev is not None:
            st = dev.stats()
            out.update(zram_stored_bytes=st["orig_data_size"], zram_ram_bytes=st["mem_used_total"])
        if self.settings.zswap_compressor:
            from ..backends.container import zswap

            zs = zswap.stats()  # host-wide: zswap is one pool for every swap area
            out.update(zswap_stored_bytes=zs["stored_bytes"], zswap_ram_bytes=zs["pool_bytes"])
        return out

    def totals(self) -> dict[str, int]:
        return {**self.counters, "admission_refusals": self.admission.refusals}

    def remove_image(self, ref: str) -> None:
        self.backend.store.remove_image(ref)

    def layers(self) -> list[dict[str, Any]]:
        return [{"digest": x.digest, "size": x.size, "image_bytes": x.image_bytes, "created": x.created,
                 "names": list(x.names), "source": x.source} for x in self.backend.store.list()]
