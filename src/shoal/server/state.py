"""The daemon's own state (SQLite, WAL, under the Shoal root): tenants, API keys, ownership.

Creates made with an idempotency key remember the sandbox they made for a day, so a retried
request answers the same one. Keys are stored as sha256 hashes only; the plain key is shown once, when it is created.
Sandboxes, snapshots and images created through the API belong to the tenant that created them;
images without an owner (built by an operator with the CLI) are visible to every tenant.
"""
from __future__ import annotations

import hashlib
import json
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..core.contract import CreateRequest
from ..core.errors import InvalidArgument, TenantNotFound

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tenants (
    name TEXT PRIMARY KEY, key_hash TEXT UNIQUE NOT NULL, quotas TEXT NOT NULL, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS owners (
    kind TEXT NOT NULL, ref TEXT NOT NULL, tenant TEXT NOT NULL, created REAL NOT NULL,
    PRIMARY KEY (kind, ref));
CREATE TABLE IF NOT EXISTS creates (
    tenant TEXT NOT NULL, key TEXT NOT NULL, sandbox TEXT NOT NULL, created REAL NOT NULL,
    PRIMARY KEY (tenant, key));
"""
IDEMPOTENCY_S = 24 * 3600.0  # how long a create's idempotency key keeps answering the same sandbox


@dataclass(frozen=True)
class Quotas:
    sandboxes: int = 100
    cpu: float = 64.0  # sum of cpu over live sandboxes
    memory_mb: int = 64 * 1024
    disk_mb: int = 256 * 1024

    def __post_init__(self):
        for k, v in self.__dict__.items():
            if v is None or v <= 0:
                raise InvalidArgument(f"quota {k} must be > 0, got {v}")


@dataclass(frozen=True)
class Tenant:
    name: str
    quotas: Quotas = field(default_factory=Quotas)
    created: float = 0.0
    admin: bool = False


ADMIN = Tenant("admin", Quotas(sandboxes=10**6, cpu=1e9, memory_mb=10**9, disk_mb=10**9), admin=True)


def own_memory_pool(tenant: Tenant, req: CreateRequest) -> CreateRequest:
    """The create as the host runs it: a tenant's pooled sandboxes share memory cgroups only with its
    own (a pool member can push its neighbours into an OOM kill). Whatever key a tenant sends is
    replaced by its name; an admin's is kept (a fleet gateway sets its caller's tenant this way)."""
    if tenant.admin:
        return req
    return req.model_copy(update={"memory_pool": f"tenant:{tenant.name}"})


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class DaemonState:
    def __init__(self, path: Path):
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, timeout=30, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        # WAL + NORMAL: no fsync per commit (tens of ms here), still never corrupt; sandboxes do not
        # outlive a host crash anyway, so the last ownership records are all that could be lost
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def _q(self, sql: str, args=()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, tuple(args)).fetchall()

    # ------------------------------------------------------------------ tenants
    def create_tenant(self, name: str, quotas: Quotas | None = None) -> tuple[Tenant, str]:
        """Returns the tenant and its API key (shown once; only the hash is kept)."""
        import re

        if not re.fullmatch(r"[a-z0-9][a-z0-9_-]{0,62}", name or "") or name == "admin":
            raise InvalidArgument(f"invalid tenant name {name!r}: lowercase letters, digits, _ and -; not 'admin'")
        if self._q("SELECT 1 FROM tenants WHERE name=?", [name]):
            raise InvalidArgument(f"tenant {name} already exists")
        key = "sk-" + secrets.token_urlsafe(32)
        q = quotas or Quotas()
        self._q("INSERT INTO tenants VALUES (?,?,?,?)", [name, hash_key(key), json.dumps(q.__dict__), time.time()])
        return self.get_tenant(name), key

    def get_tenant(self, name: str) -> Tenant:
        rows = self._q("SELECT name, quotas, created FROM tenants WHERE name=?", [name])
        if not rows:
            raise TenantNotFound(f"tenant {name} not found")
        return Tenant(rows[0][0], Quotas(**json.loads(rows[0][1])), rows[0][2])

    def list_tenants(self) -> list[Tenant]:
        return [self.get_tenant(r[0]) for r in self._q("SELECT name FROM tenants ORDER BY name")]

    def set_quotas(self, name: str, quotas: Quotas) -> Tenant:
        self.get_tenant(name)
        self._q("UPDATE tenants SET quotas=? WHERE name=?", [json.dumps(quotas.__dict__), name])
        return self.get_tenant(name)

    def rotate_key(self, name: str) -> str:
        self.get_tenant(name)
        key = "sk-" + secrets.token_urlsafe(32)
        self._q("UPDATE tenants SET key_hash=? WHERE name=?", [hash_key(key), name])
        return key

    def delete_tenant(self, name: str) -> None:
        self.get_tenant(name)
        self._q("DELETE FROM tenants WHERE name=?", [name])

    def tenant_for_uid(self, name: str) -> Tenant:
        """The tenant a Unix-socket peer without a key acts as (`uid-<uid>`), created on first use
        with default quotas. Its stored key hash is of a random key nobody is shown: it is reached
        only through the socket, by that uid (or by a key an admin rotates in)."""
        try:
            return self.get_tenant(name)
        except TenantNotFound:  # first request of this uid (a racing one may insert it too)
            self._q("INSERT OR IGNORE INTO tenants VALUES (?,?,?,?)",
                    [name, hash_key("sk-" + secrets.token_urlsafe(32)), json.dumps(Quotas().__dict__), time.time()])
            return self.get_tenant(name)

    def cached_tenant(self, key: str) -> Tenant | None:
        return None  # no cache: every key is looked up in SQLite (tenant_for_key)

    def tenant_for_key(self, key: str) -> Tenant | None:
        rows = self._q("SELECT name FROM tenants WHERE key_hash=?", [hash_key(key)])
        return self.get_tenant(rows[0][0]) if rows else None

    # ------------------------------------------------------------------ ownership
    def own(self, kind: str, ref: str, tenant: str) -> None:
        self._q("INSERT OR REPLACE INTO owners VALUES (?,?,?,?)", [kind, ref, tenant, time.time()])

    def owner(self, kind: str, ref: str) -> str | None:
        rows = self._q("SELECT tenant FROM owners WHERE kind=? AND ref=?", [kind, ref])
        return rows[0][0] if rows else None

    def owned(self, kind: str, tenant: str) -> list[str]:
        return [r[0] for r in self._q("SELECT ref FROM owners WHERE kind=? AND tenant=?", [kind, tenant])]

    def disown(self, kind: str, ref: str) -> None:
        self._q("DELETE FROM owners WHERE kind=? AND ref=?", [kind, ref])

    # ------------------------------------------------------------------ idempotent creates
    def remember_create(self, tenant: str, key: str, sandbox_id: str) -> None:
        now = time.time()
        self._q("INSERT OR REPLACE INTO creates VALUES (?,?,?,?)", [tenant, key, sandbox_id, now])
        if hash(key) % 64 == 0:  # now and then: keys older than a day answer nothing any more
            self._q("DELETE FROM creates WHERE created < ?", [now - IDEMPOTENCY_S])

    def created_for(self, tenant: str, key: str) -> str | None:
        """The sandbox a create under this tenant's key made, if one did (within IDEMPOTENCY_S)."""
        rows = self._q("SELECT sandbox FROM creates WHERE tenant=? AND key=? AND created >= ?",
                       [tenant, key, time.time() - IDEMPOTENCY_S])
        return rows[0][0] if rows else None

    def close(self) -> None:
        self._db.close()
