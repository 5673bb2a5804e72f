"""A host's side of the fleet, inside its shoald (`shoal serve --join postgresql://… --advertise URL`).

On start it reconciles before it registers: sandboxes the directory marks `lost` on this host are
killed here (the fleet already told their owners they are gone; they must not come back). Then it
registers under a lease and heartbeats every lease/3 with its load and, when they change, its
images and the layers it holds (for placement by locality). Each heartbeat also settles its rows:
sandboxes that ended here on their own (TTL, OOM) end in the directory, lost ones still running
here are killed, and `creating` rows no gateway confirmed are confirmed once this host made their
sandbox (CONFIRM_LATE_S: the gateway that made it died before its background confirm landed) or
dropped when long stale.

A heartbeat that finds its registration gone (the host was cut off longer than its lease and was
declared down) reconciles again and registers anew, so a host that comes back is clean before it
takes new sandboxes.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from ..core import errors as E
from ..server.state import ADMIN
from .directory import CONFIRM_LATE_S, CREATING_STALE_S, Directory, inventory_rev
from .schema import CREATING, LOST, RUNNING, open_db

if TYPE_CHECKING:
    from ..server.daemon import Daemon

log = logging.getLogger("shoal.fleet")
DEFAULT_LEASE_S = 10.0
INVENTORY_EVERY_S = 5.0


class HostAgent:
    def __init__(self, daemon: Daemon, dsn: str, advertise: str, domain: str = "",
                 lease_s: float = DEFAULT_LEASE_S):
        self.daemon, self.host = daemon, daemon.backend
        self.host_id = daemon.settings.host_tag
        self.address, self.domain, self.lease_s = advertise.rstrip("/"), domain, lease_s
        self.directory = Directory(open_db(dsn))
        self.epoch = 0
        self._stop = threading.Event()
        self._inventory: tuple[dict[str, Any], str] | None = None
        self._inventory_at = 0.0
        self.reconciled = 0  # sandboxes killed because the directory marked them lost

    # ---------------------------------------------------------------- what the host reports
    def capacity(self) -> dict[str, Any]:
        cfg = self.daemon.admission.cfg
        return {"sandboxes": cfg.max_sandboxes, "memory_mb": cfg.memory_mb, "cpu": os.cpu_count() or 1}

    def inventory(self) -> dict[str, Any]:
        """Images the fleet may start here (shared ones and those made through the fleet) and the
        layers held here (their image files, or every chunk cached), with their sizes."""
        state, store = self.daemon.state, self.host.store
        images = [i.model_dump(mode="json") for i in self.host.images()
                  if state.owner("image", i.ref) in (None, ADMIN.name)]
        cached = {x.digest: x.image_bytes or x.size for x in store.list()
                  if store.location(x.digest) in ("local", "cached")}
        return {"images": images, "cached": cached}

    def load(self, fleet_ids: set[str]) -> dict[str, Any]:
        live = self.host.live_ids()
        committed = self.host.committed()
        local = [sid for sid in live if sid not in fleet_ids]
        mem = sum(x.memory_mb for x in committed)
        share = mem * len(local) // max(1, len(live))  # committed limits carry no ids: the local share, pro rata
        return {"sandboxes": len(live), "memory_mb": mem, "local_sandboxes": len(local), "local_memory_mb": share}

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Reconcile, register once the daemon's TCP port answers, then heartbeat in a thread."""
        self.reconcile()
        threading.Thread(target=self._run, name="fleet-agent", daemon=True).start()

    def stop(self) -> None:
        """Stop heartbeating. The lease runs out unless a new process registers first: a daemon
        restart within the lease loses nothing (sandboxes outlive their daemon)."""
        self._stop.set()

    def _port_answers(self) -> bool:
        u = urlsplit(self.address)
        try:
            with socket.create_connection((u.hostname or "127.0.0.1", u.port or 443), timeout=1):
                return True
        except OSError:
            return False

    def _run(self) -> None:
        deadline = time.monotonic() + 60
        while not self._port_answers() and time.monotonic() < deadline and not self._stop.is_set():
            time.sleep(0.05)
        while not self._stop.is_set():
            try:
                self.register()
                break
            except E.ShoalError as e:  # the database is away, or the id is taken: keep trying
                log.warning("fleet registration: %s", e)
                self._stop.wait(1.0)
        every = max(0.2, self.lease_s / 3)
        while not self._stop.wait(every):
            try:
                self.beat()
            except Exception as e:  # the database restarting: the lease has slack for a few misses
                log.warning("fleet heartbeat: %s", e)

    def register(self) -> None:
        inv = self.inventory()
        self._inventory, self._inventory_at = (inv, inventory_rev(inv)), time.monotonic()
        fleet_ids = {sid for _, sid, _, _ in self.directory.host_rows(self.host_id, (RUNNING,)) if sid}
        self.epoch = self.directory.register(self.host_id, self.address, self.domain, self.lease_s, self.capacity(),
                                             self.load(fleet_ids), inv, self._inventory[1])
        log.warning("fleet: host %s registered at %s (domain %r, epoch %d)", self.host_id, self.address, self.domain,
                    self.epoch)

    def beat(self) -> None:
        rows = self.directory.host_rows(self.host_id, (RUNNING, CREATING, LOST))
        live = self.host.live_ids()
        fleet_ids = {sid for _, sid, state, _ in rows if sid and state == RUNNING}
        inventory = None
        if time.monotonic() - self._inventory_at >= INVENTORY_EVERY_S:
            inv = self.inventory()
            self._inventory_at = time.monotonic()
            rev = inventory_rev(inv)
            if self._inventory is None or rev != self._inventory[1]:
                inventory = self._inventory = (inv, rev)
        if not self.directory.heartbeat(self.host_id, self.epoch, self.load(fleet_ids), inventory):
            log.warning("fleet: host %s lost its registration (declared down); reconciling", self.host_id)
            self.reconcile()
            self.register()
            return
        self._settle(rows, live)

    # ---------------------------------------------------------------- reconciling
    def _local_id(self, slot: str, sandbox_id: str | None) -> str | None:
        """The sandbox a directory row names here: its id, or (never confirmed) the one this host
        made under the slot's idempotency key, if any."""
        return sandbox_id or self.daemon.db.created_for(ADMIN.name, slot)

    def reconcile(self) -> int:
        """Kill the sandboxes the directory marks lost on this host. Answers how many."""
        try:
            rows = self.directory.host_rows(self.host_id, (LOST,))
        except E.ShoalError as e:
            log.warning("fleet reconcile: %s", e)
            return 0
        live = self.host.live_ids()
        killed = 0
        for slot, sid, _, _ in rows:
            local = self._local_id(slot, sid)
            if local and local in live:
                self._kill(local)
                killed += 1
        self.reconciled += killed
        if killed:
            log.warning("fleet: killed %d sandboxes the directory marks lost", killed)
        return killed

    def _kill(self, sandbox_id: str) -> None:
        try:
            self.host.kill(sandbox_id)
        except E.SandboxNotFound:
            pass
        self.daemon.forget(sandbox_id)

    def _settle(self, rows: list[tuple[str, str | None, str, float]], live: set[str]) -> None:
        for slot, sid, state, age in rows:
            if state == LOST:
                local = self._local_id(slot, sid)
                if local and local in live:
                    self._kill(local)
                    self.reconciled += 1
            elif state == RUNNING and sid and sid not in live and age > 5:
                self.directory.end(sid, "ended on its host (ttl, idle ttl, or its processes died)")
            elif state == CREATING and age > CONFIRM_LATE_S:
                # the gateway that made it did not confirm it (it died after the host answered):
                # confirmed here once this host made the sandbox; dropped only when long stale
                local = self._local_id(slot, None)
                info = None
                if local and local in live:
                    try:
                        info = self.host.info(local)
                    except E.SandboxNotFound:
                        info = None
                if info is not None or age > CREATING_STALE_S:
                    self.directory.settle(slot, info)
