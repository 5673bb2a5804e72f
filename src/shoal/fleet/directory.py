"""The fleet directory in PostgreSQL: hosts under leases, and every sandbox's host, owner and state.

A create is two short transactions around the host's own create:
  1. reserve: under the tenant's row lock, answer an earlier create with the same idempotency key,
     else check the tenant's quota against its live sandboxes, score the live hosts (placement.py)
     and insert the sandbox as `creating` on the best one: quota and placement commit together;
  2. confirm: the host answered, the row becomes `running` with the host's sandbox id and info.
     Off the create's path: the gateway answers the client at once and a background thread
     (`Confirmer`) confirms what it made, many rows per statement. Quota is already held by the
     `creating` row, so admission does not depend on it. Until it lands, a gateway that does not
     know the id waits for it (`FleetBackend.entry`); if the gateway died first, the host confirms
     the row itself at its next heartbeat (agent.py: it knows which sandbox it made under the slot).
The host is asked with the slot id as its own idempotency key, so whichever gateway completes a
create (the first, or the one a client retried on) gets the same sandbox.

Leases: a host renews `lease_until` (database clock) every few seconds; `expire()` (run by every
gateway, idempotent) turns hosts past it `down` and their live sandboxes `lost`, with the reason.
A lease never runs out within one lease of the database's own start: while it was down nobody
could renew, and a database restart must not declare the whole fleet lost.
"""
from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..core import errors as E
from ..core.contract import Limits, SandboxInfo
from ..core.postgres import PerThreadPG
from ..server.quotas import RESOURCES
from ..server.state import Tenant
from . import placement
from .schema import CREATING, DEAD, DOWN, LIVE, LOST, NOW, RUNNING, UP

try:
    import psycopg
    from psycopg.types.json import Jsonb
except ImportError as e:  # an extra: a single host does not need it
    raise ImportError("the fleet directory needs psycopg: pip install 'shoal[fleet]'") from e

log = logging.getLogger("shoal.fleet")
TERMINAL_KEEP_S = 24 * 3600.0  # dead and lost rows answer (404 with a reason, 410) this long, then go
CREATING_STALE_S = 600.0  # a `creating` row no gateway confirmed in this long is settled by its host
HOST_VIEWS_S = 0.5  # a gateway re-reads the hosts' capacity, load and inventory at most this often
CONFIRM_LATE_S = 2.0  # a `creating` row its host made a sandbox for is confirmed by the host after this long
CONFIRM_BATCH = 500  # confirms per statement
CONFIRM_RETRY_S = 0.2  # a batch that failed (the database restarting) is sent again after this long
CONFIRM_LINGER_S = 0.002  # the confirm thread waits this long once woken: the reply goes out first, batches grow


@dataclass(frozen=True)
class Slot:
    """A reserved placement: the directory row of a sandbox being created (or an earlier one)."""

    slot: str
    host: str
    address: str
    state: str
    sandbox_id: str | None = None
    info: SandboxInfo | None = None
    reason: str | None = None
    alternatives: tuple[tuple[str, str], ...] = ()  # (host, address) to try if the host refuses


@dataclass(frozen=True)
class Entry:
    """Where a sandbox lives and what the directory says of it."""

    id: str
    slot: str
    host: str
    tenant: str
    state: str
    reason: str | None
    address: str | None
    host_gone: bool
    info: SandboxInfo | None


def _limits_row(limits: Limits) -> tuple[float, int, int]:
    return limits.cpu, limits.memory_mb, limits.disk_mb


class Confirmer:
    """Confirms the sandboxes this process made, off the create's path: a thread sends every
    confirm queued meanwhile in one statement (`Directory.confirm_many`), and sends a failed batch
    again (the confirm only moves `creating` rows, so a repeat changes nothing). Confirms queued
    here die with the process; the hosts settle those rows (agent.py)."""

    def __init__(self, directory: Directory):
        self.directory = directory
        self._pending: dict[str, tuple[str, SandboxInfo]] = {}  # sandbox id -> (slot, info), in order
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self.held = False  # tests: a gateway that dies before its confirms land

    def submit(self, slot: str, info: SandboxInfo) -> None:
        with self._cv:
            self._pending[info.id] = (slot, info)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="fleet-confirm", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def pending(self, sandbox_id: str) -> bool:
        with self._cv:
            return sandbox_id in self._pending

    def wait(self, sandbox_id: str, timeout: float = 10.0) -> bool:
        """Wait until this process's confirm of `sandbox_id` landed; False if there was none."""
        deadline = time.monotonic() + timeout
        with self._cv:
            if sandbox_id not in self._pending:
                return False
            while sandbox_id in self._pending and time.monotonic() < deadline:
                self._cv.wait(deadline - time.monotonic())
        return True

    def flush(self, timeout: float = 10.0) -> None:
        """Wait until every confirm queued so far landed."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._pending and time.monotonic() < deadline:
                self._cv.wait(deadline - time.monotonic())

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._pending or self.held:
                    self._cv.wait(1.0)
            time.sleep(CONFIRM_LINGER_S)
            with self._cv:
                batch = list(self._pending.items())[:CONFIRM_BATCH]
            try:
                self.directory.confirm_many([(slot, info) for _, (slot, info) in batch])
            except Exception as e:  # the database restarting: the same batch again shortly
                log.warning("confirming %d sandboxes: %s", len(batch), e)
                time.sleep(CONFIRM_RETRY_S)
                continue
            with self._cv:
                for sid, item in batch:
                    if self._pending.get(sid) is item:
                        del self._pending[sid]
                self._cv.notify_all()


class Directory:
    def __init__(self, pg: PerThreadPG):
        self.pg = pg
        self.confirms = Confirmer(self)
        self._inventories: dict[str, tuple[str, dict[str, list[str]], dict[str, int]]] = {}
        self._inv_lock = threading.Lock()
        self._views: tuple[list[placement.HostView] | None, float] = (None, 0.0)
        self._views_lock = threading.Lock()

    # ================================================================ hosts
    def register(self, host_id: str, address: str, domain: str, lease_s: float, capacity: dict[str, Any],
                 load: dict[str, Any], inventory: dict[str, Any], inventory_rev: str) -> int:
        """Put the host in the directory as `up` under a fresh lease; its new epoch (a heartbeat of
        an older registration, say a process that was replaced, no longer renews anything). Refused
        while another live host holds the same id at another address."""
        with self.pg.transaction() as db:
            row = db.execute(f"SELECT address, state = %s AND lease_until > {NOW} FROM fleet_hosts WHERE id=%s "
                             "FOR UPDATE", (UP, host_id)).fetchone()
            if row is not None and row[1] and row[0] != address:
                raise E.InvalidArgument(f"host id {host_id!r} is held by a live host at {row[0]}: give this host "
                                        "another id (host_id in the config, or $SHOAL_HOST_ID)")
            out = db.execute(
                f"""INSERT INTO fleet_hosts(id, address, domain, state, epoch, lease_s, lease_until, heartbeat,
                      registered, capacity, load, inventory, inventory_rev)
                    VALUES (%(id)s, %(address)s, %(domain)s, %(up)s, 1, %(lease)s, {NOW} + %(lease)s, {NOW}, {NOW},
                      %(cap)s, %(load)s, %(inv)s, %(rev)s)
                    ON CONFLICT (id) DO UPDATE SET address=EXCLUDED.address, domain=EXCLUDED.domain, state=%(up)s,
                      epoch=fleet_hosts.epoch + 1, lease_s=EXCLUDED.lease_s, lease_until=EXCLUDED.lease_until,
                      heartbeat=EXCLUDED.heartbeat, registered=EXCLUDED.registered, capacity=EXCLUDED.capacity,
                      load=EXCLUDED.load, inventory=EXCLUDED.inventory, inventory_rev=EXCLUDED.inventory_rev,
                      reason=NULL
                    RETURNING epoch""",
                {"id": host_id, "address": address, "domain": domain, "up": UP, "lease": lease_s,
                 "cap": Jsonb(capacity), "load": Jsonb(load), "inv": Jsonb(inventory), "rev": inventory_rev}).fetchone()
        assert out is not None
        return int(out[0])

    def heartbeat(self, host_id: str, epoch: int, load: dict[str, Any],
                  inventory: tuple[dict[str, Any], str] | None = None) -> bool:
        """Renew the lease; False when this registration no longer holds it (declared down, or
        replaced): the host must reconcile and register again."""
        sets, args = [f"lease_until = {NOW} + lease_s", f"heartbeat = {NOW}", "load = %(load)s"], \
            {"id": host_id, "epoch": epoch, "load": Jsonb(load), "up": UP}
        if inventory is not None:
            sets += ["inventory = %(inv)s", "inventory_rev = %(rev)s"]
            args.update(inv=Jsonb(inventory[0]), rev=inventory[1])
        cur = self.pg.execute(f"UPDATE fleet_hosts SET {', '.join(sets)} "
                              "WHERE id=%(id)s AND epoch=%(epoch)s AND state=%(up)s", args)
        return cur.rowcount == 1

    def deregister(self, host_id: str, epoch: int, reason: str) -> None:
        """A host leaving on purpose: down at once (its sandboxes lost with `reason`)."""
        with self.pg.transaction() as db:
            db.execute("UPDATE fleet_hosts SET state=%s, reason=%s WHERE id=%s AND epoch=%s",
                       (DOWN, reason, host_id, epoch))
            db.execute(f"UPDATE fleet_sandboxes SET state=%s, reason=%s, updated={NOW} "
                       "WHERE host=%s AND state = ANY(%s)", (LOST, reason, host_id, list(LIVE)))

    def expire(self) -> int:
        """Hosts whose lease ran out become `down`; every live sandbox on a down host becomes `lost`
        with the reason. Idempotent; any gateway runs it. Answers how many sandboxes were lost."""
        with self.pg.transaction() as db:
            db.execute(f"""UPDATE fleet_hosts SET state=%s, reason = 'host ' || id || ' stopped renewing its lease: '
                             || 'no heartbeat for ' || round(({NOW} - heartbeat)::numeric, 1) || ' s (lease '
                             || lease_s || ' s), last from ' || address
                           WHERE state=%s AND lease_until < {NOW}
                             AND extract(epoch from pg_postmaster_start_time()) + lease_s < {NOW}""", (DOWN, UP))
            cur = db.execute(f"""UPDATE fleet_sandboxes s SET state=%s, reason=h.reason, updated={NOW}
                                 FROM fleet_hosts h WHERE h.id = s.host AND h.state=%s AND s.state = ANY(%s)""",
                             (LOST, DOWN, list(LIVE)))
            return cur.rowcount

    def up_hosts(self) -> set[str]:
        """The hosts that hold a live lease now."""
        return {r[0] for r in self.pg.execute(f"SELECT id FROM fleet_hosts WHERE state=%s AND lease_until > {NOW}",
                                              (UP,)).fetchall()}

    def hosts(self) -> list[dict[str, Any]]:
        """Every host the directory knows, for operators (`shoal fleet hosts`, GET /fleet/hosts)."""
        keys = ("id", "address", "domain", "state", "epoch", "lease_s", "lease_left_s", "capacity", "load", "reason")
        rows = self.pg.execute(f"SELECT id, address, domain, state, epoch, lease_s, lease_until - {NOW}, capacity, "
                               "load, reason FROM fleet_hosts ORDER BY id").fetchall()
        return [dict(zip(keys, r)) for r in rows]

    def _inventory(self, db: psycopg.Connection, hosts: list[tuple[str, str]]
                   ) -> dict[str, tuple[dict[str, list[str]], dict[str, int]]]:
        """(images, cached layers) per host, re-read only when a host's inventory changed."""
        with self._inv_lock:
            stale = [h for h, rev in hosts if self._inventories.get(h, ("",))[0] != rev]
        if stale:
            for hid, rev, inv in db.execute("SELECT id, inventory_rev, inventory FROM fleet_hosts WHERE id = ANY(%s)",
                                            (stale,)).fetchall():
                images = {i["ref"]: list(i["layers"]) for i in inv.get("images", [])}
                with self._inv_lock:
                    self._inventories[hid] = (rev, images, dict(inv.get("cached", {})))
        with self._inv_lock:
            return {h: self._inventories[h][1:] for h, _ in hosts if h in self._inventories}

    def host_views(self, db: psycopg.Connection) -> list[placement.HostView]:
        """The live hosts as placement sees them: capacity, load (sandboxes the directory places
        there plus those the host runs for its own local clients), images and cached layers."""
        rows = db.execute(f"SELECT id, address, domain, capacity, load, inventory_rev FROM fleet_hosts "
                          f"WHERE state=%s AND lease_until > {NOW}", (UP,)).fetchall()
        placed = {h: (n, mem) for h, n, mem in db.execute(
            "SELECT host, sum(sandboxes), sum(memory_mb) FROM fleet_usage GROUP BY host").fetchall()}
        inv = self._inventory(db, [(r[0], r[5]) for r in rows])
        views = []
        for hid, address, domain, cap, load, _ in rows:
            n, mem = placed.get(hid, (0, 0))
            images, cached = inv.get(hid, ({}, {}))
            views.append(placement.HostView(
                id=hid, address=address, domain=domain, max_sandboxes=int(cap.get("sandboxes", 0)),
                memory_mb=int(cap.get("memory_mb", 0)), sandboxes=int(n) + int(load.get("local_sandboxes", 0)),
                used_memory_mb=int(mem) + int(load.get("local_memory_mb", 0)), images=images, cached=cached))
        return views

    # ================================================================ sandboxes
    def reserve(self, tenant: Tenant, limits: Limits, want: placement.Wanted, key: str | None,
                avoid: Iterable[str] = (), images: Iterable[str] = ()) -> Slot:
        """Quota and placement in one transaction (see the module doc); an earlier create with the
        same key answers its own slot. QuotaExceeded (429, retryable) over quota or with no host;
        ImageNotFound if one of `images` (name:tag) is another tenant's."""
        for attempt in range(3):
            try:
                return self._reserve(tenant, limits, want, key, set(avoid), list(images))
            except psycopg.errors.UniqueViolation:  # a concurrent create with the same key won: read its slot
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def views(self, fresh: bool = False) -> list[placement.HostView]:
        """The live hosts as placement sees them, read at most every HOST_VIEWS_S by this process
        (one query for all its creates then). Their load may be that much behind: placement only
        prefers with it, and a host that is full refuses the create (the next best takes it)."""
        now = time.monotonic()
        with self._views_lock:
            got, at = self._views
            if not fresh and got is not None and now - at < HOST_VIEWS_S:
                return got
        with self.pg.transaction() as db:
            views = self.host_views(db)
        with self._views_lock:
            self._views = (views, time.monotonic())
        return views

    def _placed(self, host_id: str, memory_mb: int) -> None:
        """A placement this process made counts in its cached views until the next read."""
        with self._views_lock:
            for v in self._views[0] or ():
                if v.id == host_id:
                    v.sandboxes += 1
                    v.used_memory_mb += memory_mb

    _RESERVE_SQL = "/* write */ SELECT * FROM fleet_reserve(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"

    def _reserve_call(self, views: list[placement.HostView], tenant: Tenant, limits: Limits, want: placement.Wanted,
                      key: str | None, images: list[str]) -> tuple[tuple[Any, ...], dict[str, placement.HostView]]:
        """fleet_reserve's arguments over the scored hosts, and the hosts by id."""
        scored = placement.base_scores(views, placement.Wanted(refs=want.refs, digests=want.digests,
                                                               memory_mb=limits.memory_mb, pin=want.pin))
        cpu, mem, disk = _limits_row(limits)
        slot = "sl-" + uuid.uuid4().hex
        args = (tenant.name, tenant.admin, key, cpu, mem, disk, [h.id for _, h in scored],
                [h.domain for _, h in scored], [b for b, _ in scored], placement.W_SPREAD, slot, images)
        return args, {h.id: h for _, h in scored}

    def _needs_fresh(self, views: list[placement.HostView], want: placement.Wanted) -> bool:
        """No cached host knows the image, or the pinned host: a host may report it by now."""
        return not placement.knows_all(views, want) or (want.pin is not None and all(v.id != want.pin for v in views))

    def _reserved(self, row: tuple[Any, ...] | None, args: tuple[Any, ...], by_id: dict[str, placement.HostView],
                  tenant: Tenant, limits: Limits, want: placement.Wanted) -> Slot:
        """fleet_reserve's answer as a Slot, or its refusal as an error."""
        assert row is not None
        kind, r_slot, r_host, r_address, r_state, r_id, r_info, r_reason, order = row
        if kind == "no_tenant":
            raise E.TenantNotFound(f"tenant {tenant.name} not found")
        if kind == "no_image":
            raise E.ImageNotFound(f"image {r_reason} not found (see `shoal image ls`)")
        if kind == "prior":
            return Slot(r_slot, r_host, r_address or "", r_state, r_id,
                        SandboxInfo.model_validate(r_info) if r_info else None, r_reason)
        if kind == "quota":
            q = r_info
            raise E.QuotaExceeded(f"tenant {tenant.name} quota {q['name']}={q['cap']:g} would be exceeded "
                                  f"(in use fleet-wide {q['used']:g}, asked {q['want']:g})")
        if kind == "no_host":
            where = f"host {want.pin}" if want.pin else "no live host"
            raise E.QuotaExceeded(f"{where} can take a sandbox of {limits.memory_mb} MiB now "
                                  f"({len(by_id)} live hosts); retry later")
        best = by_id[r_host]
        self._placed(best.id, limits.memory_mb)
        return Slot(args[10], best.id, best.address, CREATING,
                    alternatives=tuple((by_id[h].id, by_id[h].address) for h in order[1:3]))

    def _reserve(self, tenant: Tenant, limits: Limits, want: placement.Wanted, key: str | None,
                 avoid: set[str], images: list[str]) -> Slot:
        views = [v for v in self.views() if v.id not in avoid]
        if self._needs_fresh(views, want):
            views = [v for v in self.views(fresh=True) if v.id not in avoid]
        args, by_id = self._reserve_call(views, tenant, limits, want, key, images)
        # one statement, autocommitted: one round trip and one commit (schema.RESERVE_FN). Not a
        # read: never sent again by PerThreadPG (it may have committed); with a key it may be, below.
        try:
            row = self.pg.execute(self._RESERVE_SQL, args).fetchone()
        except E.DatabaseUnavailable:
            if key is None:
                raise
            row = self.pg.execute(self._RESERVE_SQL, args).fetchone()  # the key makes a repeat answer the first's slot
        return self._reserved(row, args, by_id, tenant, limits, want)

    def move(self, slot: str, host: str) -> None:
        """The chosen host refused (full): the reservation goes to another."""
        self.pg.execute("UPDATE fleet_sandboxes SET host=%s WHERE slot=%s AND state=%s", (host, slot, CREATING))

    def release(self, slot: str) -> None:
        """The create failed before any sandbox existed: the slot and its quota go."""
        self.pg.execute("DELETE FROM fleet_sandboxes WHERE slot=%s AND state=%s", (slot, CREATING))

    def confirm(self, slot: str, info: SandboxInfo) -> None:
        """The host made the sandbox: the row is `running`. SandboxLost if its host was declared
        lost meanwhile (the host kills it when it comes back)."""
        cur = self.pg.execute(f"UPDATE fleet_sandboxes SET id=%s, state=%s, info=%s, updated={NOW} "
                              "WHERE slot=%s AND state=%s",
                              (info.id, RUNNING, Jsonb(info.model_dump(mode="json")), slot, CREATING))
        if cur.rowcount == 1:
            return
        row = self.pg.execute("SELECT state, id, reason FROM fleet_sandboxes WHERE slot=%s", (slot,)).fetchone()
        if row is not None and row[0] == RUNNING and row[1] == info.id:
            return  # another gateway confirmed it first
        if row is not None and row[0] == LOST:
            self.pg.execute("UPDATE fleet_sandboxes SET id=%s, info=%s WHERE slot=%s AND id IS NULL",
                            (info.id, Jsonb(info.model_dump(mode="json")), slot))
            raise E.SandboxLost(f"sandbox {info.id} was lost while it was being created: {row[2]}")
        raise E.SandboxError(f"the directory lost track of sandbox {info.id} while it was created (slot {slot}); "
                             "its host removes it")

    def confirm_many(self, items: list[tuple[str, SandboxInfo]]) -> None:
        """Many confirms in one statement (`Confirmer`). A row no longer `creating` keeps its state:
        running (its host or another gateway confirmed it), lost (it records the id, so calls on it
        answer 410 and the host kills it when it comes back), gone (logged: its host removes it)."""
        slots = [s for s, _ in items]
        ids = [i.id for _, i in items]
        infos = [i.model_dump_json() for _, i in items]
        done = {r[0] for r in self.pg.execute(
            f"/* write */ UPDATE fleet_sandboxes s SET id=v.id, state=%s, info=v.info::jsonb, updated={NOW} "
            "FROM unnest(%s::text[], %s::text[], %s::text[]) AS v(slot, id, info) "
            "WHERE s.slot = v.slot AND s.state = %s RETURNING s.slot",
            (RUNNING, slots, ids, infos, CREATING)).fetchall()}
        rest = [(s, i) for s, i in items if s not in done]
        if not rest:
            return
        rows = {r[0]: r[1:] for r in self.pg.execute("SELECT slot, state, id FROM fleet_sandboxes WHERE slot = ANY(%s)",
                                                     ([s for s, _ in rest],)).fetchall()}
        for slot, info in rest:
            state, sid = rows.get(slot, (None, None))
            if state == LOST and sid is None:
                self.pg.execute("UPDATE fleet_sandboxes SET id=%s, info=%s WHERE slot=%s AND id IS NULL",
                                (info.id, Jsonb(info.model_dump(mode="json")), slot))
            elif not (state == RUNNING and sid == info.id):
                log.warning("the directory lost track of sandbox %s while it was created (slot %s, now %s)",
                            info.id, slot, state)

    def unconfirmed(self, host: str, tenant: str | None) -> int:
        """How many sandboxes placed on `host` (for `tenant`, or anyone's) wait for their confirm."""
        sql = "SELECT count(*) FROM fleet_sandboxes WHERE host=%s AND state=%s AND id IS NULL"
        args: list[Any] = [host, CREATING]
        if tenant is not None:
            sql += " AND tenant=%s"
            args.append(tenant)
        row = self.pg.execute(sql, args).fetchone()
        return int(row[0]) if row else 0

    def locate(self, sandbox_id: str) -> Entry | None:
        row = self.pg.execute(
            f"SELECT s.id, s.slot, s.host, s.tenant, s.state, s.reason, h.address, "
            f"h.id IS NULL OR h.state <> %s OR h.lease_until < {NOW}, s.info "
            "FROM fleet_sandboxes s LEFT JOIN fleet_hosts h ON h.id = s.host WHERE s.id=%s",
            (UP, sandbox_id)).fetchone()
        if row is None:
            return None
        info = SandboxInfo.model_validate(row[8]) if row[8] else None
        return Entry(row[0], row[1], row[2], row[3], row[4], row[5], row[6], bool(row[7]), info)

    def end(self, sandbox_id: str, reason: str, state: str = DEAD) -> None:
        self.confirms.wait(sandbox_id)  # a confirm landing after this would revive the row
        self.pg.execute(f"UPDATE fleet_sandboxes SET state=%s, reason=%s, updated={NOW} "
                        "WHERE id=%s AND state = ANY(%s)", (state, reason, sandbox_id, list(LIVE)))

    def owner(self, sandbox_id: str) -> str | None:
        row = self.pg.execute("SELECT tenant FROM fleet_sandboxes WHERE id=%s", (sandbox_id,)).fetchone()
        return row[0] if row else None

    def live(self, tenant: str | None = None) -> list[Entry]:
        """Running sandboxes (all, or one tenant's), with their hosts."""
        sql = ("SELECT s.id, s.slot, s.host, s.tenant, s.state, s.reason, h.address, FALSE, s.info "
               "FROM fleet_sandboxes s LEFT JOIN fleet_hosts h ON h.id = s.host WHERE s.state=%s")
        args: list[Any] = [RUNNING]
        if tenant is not None:
            sql += " AND s.tenant=%s"
            args.append(tenant)
        return [Entry(r[0], r[1], r[2], r[3], r[4], r[5], r[6], False,
                      SandboxInfo.model_validate(r[8]) if r[8] else None)
                for r in self.pg.execute(sql + " ORDER BY s.created", args).fetchall()]

    def _usage(self, db: psycopg.Connection, tenant: str) -> dict[str, float]:
        row = db.execute("SELECT coalesce(sum(sandboxes), 0), coalesce(sum(cpu), 0), coalesce(sum(memory_mb), 0), "
                         "coalesce(sum(disk_mb), 0) FROM fleet_usage WHERE tenant=%s", (tenant,)).fetchone()
        assert row is not None
        return dict(zip(RESOURCES, (float(x) for x in row)))

    def usage_drift(self) -> list[tuple[Any, ...]]:
        """(tenant, host, counters, sums of the live rows) wherever the usage counters differ from
        the rows they count: empty, always (tests, operators' checks)."""
        return [tuple(r) for r in self.pg.execute(
            """SELECT coalesce(c.tenant, s.tenant), coalesce(c.host, s.host),
                 ARRAY[coalesce(c.sandboxes, 0), coalesce(c.cpu, 0), coalesce(c.memory_mb, 0), coalesce(c.disk_mb, 0)],
                 ARRAY[coalesce(s.n, 0), coalesce(s.cpu, 0), coalesce(s.mem, 0), coalesce(s.disk, 0)]
               FROM fleet_usage c FULL JOIN
                 (SELECT tenant, host, count(*) AS n, sum(cpu) AS cpu, sum(memory_mb) AS mem, sum(disk_mb) AS disk
                    FROM fleet_sandboxes WHERE state = ANY(%s) GROUP BY tenant, host) s
                 ON s.tenant = c.tenant AND s.host = c.host
               WHERE coalesce(c.sandboxes, 0) <> coalesce(s.n, 0)
                  OR abs(coalesce(c.cpu, 0) - coalesce(s.cpu, 0)) > 1e-6
                  OR coalesce(c.memory_mb, 0) <> coalesce(s.mem, 0) OR coalesce(c.disk_mb, 0) <> coalesce(s.disk, 0)""",
            (list(LIVE),)).fetchall()]

    def usage(self, tenant: str) -> dict[str, float]:
        with self.pg.transaction() as db:
            return self._usage(db, tenant)

    # ================================================================ the host's side
    def host_rows(self, host_id: str, states: Iterable[str]) -> list[tuple[str, str | None, str, float]]:
        """(slot, sandbox id, state, age in seconds) of the host's sandboxes in these states."""
        return [(r[0], r[1], r[2], float(r[3])) for r in self.pg.execute(
            f"SELECT slot, id, state, {NOW} - created FROM fleet_sandboxes WHERE host=%s AND state = ANY(%s)",
            (host_id, list(states))).fetchall()]

    def settle(self, slot: str, info: SandboxInfo | None) -> None:
        """A stale `creating` row, settled by its host: confirmed if the sandbox exists, else gone."""
        if info is not None:
            self.pg.execute(f"UPDATE fleet_sandboxes SET id=%s, state=%s, info=%s, updated={NOW} "
                            "WHERE slot=%s AND state=%s",
                            (info.id, RUNNING, Jsonb(info.model_dump(mode="json")), slot, CREATING))
        else:
            self.release(slot)

    def prune(self) -> int:
        """Dead and lost rows older than TERMINAL_KEEP_S go."""
        return self.pg.execute(f"DELETE FROM fleet_sandboxes WHERE state = ANY(%s) AND updated < {NOW} - %s",
                               ([DEAD, LOST], TERMINAL_KEEP_S)).rowcount

    # ================================================================ snapshots
    def record_snapshot(self, snap_id: str, host: str, tenant: str) -> None:
        self.pg.execute("INSERT INTO fleet_snapshots(id, host, tenant) VALUES (%s, %s, %s) ON CONFLICT (id) DO NOTHING",
                        (snap_id, host, tenant))

    def snapshot_host(self, snap_id: str) -> str | None:
        row = self.pg.execute("SELECT host FROM fleet_snapshots WHERE id=%s", (snap_id,)).fetchone()
        return row[0] if row else None


def inventory_rev(inventory: dict[str, Any]) -> str:
    """A short digest of an inventory: gateways re-read a host's inventory only when it changes."""
    import hashlib

    return hashlib.sha256(json.dumps(inventory, sort_keys=True).encode()).hexdigest()[:16]
