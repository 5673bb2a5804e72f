"""The fleet's tables in PostgreSQL, created once by whichever process opens the database first.

Times are the database's clock (seconds since the epoch, `clock_timestamp()`), never a host's: hosts
with skewed clocks still agree on when a lease ran out. docs/fleet.md describes each table."""
from __future__ import annotations

from ..core.postgres import PerThreadPG

NOW = "extract(epoch from clock_timestamp())"

# sandbox states in the directory: creating (placed, quota taken, the host not yet answered),
# running (the host made it; paused ones too: the host knows), dead (killed or ended), lost
CREATING, RUNNING, DEAD, LOST = "creating", "running", "dead", "lost"
LIVE = (CREATING, RUNNING)  # what holds quota and host capacity
UP, DOWN = "up", "down"  # host states

SCHEMA = f"""
CREATE TABLE IF NOT EXISTS fleet_hosts(
  id TEXT PRIMARY KEY, address TEXT NOT NULL, domain TEXT NOT NULL DEFAULT '', state TEXT NOT NULL,
  epoch BIGINT NOT NULL DEFAULT 1, lease_s DOUBLE PRECISION NOT NULL, lease_until DOUBLE PRECISION NOT NULL,
  heartbeat DOUBLE PRECISION NOT NULL, registered DOUBLE PRECISION NOT NULL,
  capacity JSONB NOT NULL, load JSONB NOT NULL, inventory JSONB NOT NULL DEFAULT '{{}}',
  inventory_rev TEXT NOT NULL DEFAULT '', reason TEXT);
CREATE TABLE IF NOT EXISTS fleet_sandboxes(
  slot TEXT PRIMARY KEY, id TEXT UNIQUE, host TEXT NOT NULL, tenant TEXT NOT NULL, state TEXT NOT NULL,
  reason TEXT, idem_key TEXT, cpu DOUBLE PRECISION NOT NULL, memory_mb BIGINT NOT NULL, disk_mb BIGINT NOT NULL,
  info JSONB, created DOUBLE PRECISION NOT NULL DEFAULT {NOW}, updated DOUBLE PRECISION NOT NULL DEFAULT {NOW});
CREATE UNIQUE INDEX IF NOT EXISTS fleet_sandboxes_idem ON fleet_sandboxes(tenant, idem_key)
  WHERE idem_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS fleet_sandboxes_host ON fleet_sandboxes(host, state, created);
CREATE INDEX IF NOT EXISTS fleet_sandboxes_tenant ON fleet_sandboxes(tenant, state);
CREATE TABLE IF NOT EXISTS fleet_tenants(
  name TEXT PRIMARY KEY, key_hash TEXT UNIQUE NOT NULL, quotas JSONB NOT NULL, created DOUBLE PRECISION NOT NULL);
CREATE TABLE IF NOT EXISTS fleet_owners(
  kind TEXT NOT NULL, ref TEXT NOT NULL, tenant TEXT NOT NULL, created DOUBLE PRECISION NOT NULL,
  PRIMARY KEY (kind, ref));
CREATE TABLE IF NOT EXISTS fleet_snapshots(
  id TEXT PRIMARY KEY, host TEXT NOT NULL, tenant TEXT NOT NULL, created DOUBLE PRECISION NOT NULL DEFAULT {NOW});
"""
_SCHEMA_LOCK = 0x5348_4F41_4C46  # advisory lock id: concurrent first openers create the schema once


def open_db(dsn: str) -> PerThreadPG:
    """Connections to the fleet's database, its tables created if missing."""
    pg = PerThreadPG(dsn)
    with pg.transaction() as db:
        db.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
        db.execute(SCHEMA)
    return pg
