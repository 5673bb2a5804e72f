"""Tenants, keys and ownership for a fleet, in PostgreSQL: the same `TenantStore` a host keeps in
SQLite (server/state.py), so the gateway's routes authenticate and check visibility the same way,
but once for the whole fleet. A sandbox's owner is its directory row (one source of truth);
images and snapshots a tenant made are in `fleet_owners`. Keys are stored as sha256 hashes only."""
from __future__ import annotations

import re
import secrets
import threading
import time

from ..core.errors import InvalidArgument, TenantNotFound, Unauthorized
from ..core.postgres import PerThreadPG
from ..server.state import Quotas, Tenant, hash_key
from .directory import Directory
from .schema import LIVE

try:
    import psycopg
    from psycopg.types.json import Jsonb
except ImportError as e:  # an extra: a single host does not need it
    raise ImportError("fleet tenants need psycopg: pip install 'shoal[fleet]'") from e


KEY_CACHE_S = 2.0  # a key a gateway resolved is trusted this long without asking PostgreSQL again


class PgTenants:
    """Keys resolve from a short per-process cache (KEY_CACHE_S): an exec through the gateway does
    not ask PostgreSQL who its key belongs to. What a cached tenant may do is still decided in the
    database: a create reads the tenant's quotas under its row lock (a deleted tenant cannot create),
    and every sandbox's owner is its directory row. A deleted tenant's key, or changed quotas, reach
    this process's cache at once and other gateways' within KEY_CACHE_S."""

    def __init__(self, pg: PerThreadPG, directory: Directory):
        self.pg, self.directory = pg, directory
        self._keys: dict[str, tuple[Tenant, float]] = {}
        self._keys_lock = threading.Lock()

    def _forget(self, name: str) -> None:
        with self._keys_lock:
            for h in [h for h, (t, _) in self._keys.items() if t.name == name]:
                del self._keys[h]

    # ------------------------------------------------------------------ tenants
    def create_tenant(self, name: str, quotas: Quotas | None = None) -> tuple[Tenant, str]:
        if not re.fullmatch(r"[a-z0-9][a-z0-9_-]{0,62}", name or "") or name == "admin":
            raise InvalidArgument(f"invalid tenant name {name!r}: lowercase letters, digits, _ and -; not 'admin'")
        key = "sk-" + secrets.token_urlsafe(32)
        q = quotas or Quotas()
        try:
            self.pg.execute("INSERT INTO fleet_tenants(name, key_hash, quotas, created) VALUES (%s, %s, %s, %s)",
                            (name, hash_key(key), Jsonb(q.__dict__), time.time()))
        except psycopg.errors.UniqueViolation:
            raise InvalidArgument(f"tenant {name} already exists") from None
        return self.get_tenant(name), key

    def get_tenant(self, name: str) -> Tenant:
        row = self.pg.execute("SELECT name, quotas, created FROM fleet_tenants WHERE name=%s", (name,)).fetchone()
        if row is None:
            raise TenantNotFound(f"tenant {name} not found")
        return Tenant(row[0], Quotas(**row[1]), row[2])

    def list_tenants(self) -> list[Tenant]:
        return [Tenant(r[0], Quotas(**r[1]), r[2])
                for r in self.pg.execute("SELECT name, quotas, created FROM fleet_tenants ORDER BY name").fetchall()]

    def set_quotas(self, name: str, quotas: Quotas) -> Tenant:
        self._forget(name)
        if self.pg.execute("UPDATE fleet_tenants SET quotas=%s WHERE name=%s",
                           (Jsonb(quotas.__dict__), name)).rowcount != 1:
            raise TenantNotFound(f"tenant {name} not found")
        return self.get_tenant(name)

    def delete_tenant(self, name: str) -> None:
        self._forget(name)
        if self.pg.execute("DELETE FROM fleet_tenants WHERE name=%s", (name,)).rowcount != 1:
            raise TenantNotFound(f"tenant {name} not found")

    def cached_tenant(self, key: str) -> Tenant | None:
        hit = self._keys.get(hash_key(key))  # one dict read: atomic, no lock needed
        return hit[0] if hit is not None and time.monotonic() - hit[1] < KEY_CACHE_S else None

    def tenant_for_key(self, key: str) -> Tenant | None:
        h = hash_key(key)
        now = time.monotonic()
        with self._keys_lock:
            hit = self._keys.get(h)
        if hit is not None and now - hit[1] < KEY_CACHE_S:
            return hit[0]
        row = self.pg.execute("SELECT name, quotas, created FROM fleet_tenants WHERE key_hash=%s", (h,)).fetchone()
        if row is None:  # unknown keys are not cached: a tenant made a moment ago must work at once
            with self._keys_lock:
                self._keys.pop(h, None)
            return None
        t = Tenant(row[0], Quotas(**row[1]), row[2])
        with self._keys_lock:
            if len(self._keys) > 100_000:
                self._keys.clear()
            self._keys[h] = (t, now)
        return t

    def tenant_for_uid(self, name: str) -> Tenant:
        raise Unauthorized("a fleet gateway has no Unix-socket peers: use an API key")

    # ------------------------------------------------------------------ ownership
    def own(self, kind: str, ref: str, tenant: str) -> None:
        if kind == "sandbox":  # the directory row says who owns a sandbox
            return
        self.pg.execute("INSERT INTO fleet_owners(kind, ref, tenant, created) VALUES (%s, %s, %s, %s) "
                        "ON CONFLICT (kind, ref) DO UPDATE SET tenant=EXCLUDED.tenant",
                        (kind, ref, tenant, time.time()))

    def owner(self, kind: str, ref: str) -> str | None:
        if kind == "sandbox":
            return self.directory.owner(ref)
        row = self.pg.execute("SELECT tenant FROM fleet_owners WHERE kind=%s AND ref=%s", (kind, ref)).fetchone()
        return row[0] if row else None

    def owned(self, kind: str, tenant: str) -> list[str]:
        if kind == "sandbox":
            return [r[0] for r in self.pg.execute(
                "SELECT id FROM fleet_sandboxes WHERE tenant=%s AND state = ANY(%s) AND id IS NOT NULL",
                (tenant, list(LIVE))).fetchall()]
        return [r[0] for r in self.pg.execute("SELECT ref FROM fleet_owners WHERE kind=%s AND tenant=%s",
                                              (kind, tenant)).fetchall()]

    def disown(self, kind: str, ref: str) -> None:
        if kind == "sandbox":  # the gateway ends the directory row itself (Gateway.forget)
            return
        self.pg.execute("DELETE FROM fleet_owners WHERE kind=%s AND ref=%s", (kind, ref))
