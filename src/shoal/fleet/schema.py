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
CREATE TABLE IF NOT EXISTS fleet_usage(
  tenant TEXT NOT NULL, host TEXT NOT NULL, sandboxes BIGINT NOT NULL DEFAULT 0,
  cpu DOUBLE PRECISION NOT NULL DEFAULT 0, memory_mb BIGINT NOT NULL DEFAULT 0, disk_mb BIGINT NOT NULL DEFAULT 0,
  PRIMARY KEY (tenant, host));
CREATE TABLE IF NOT EXISTS fleet_snapshots(
  id TEXT PRIMARY KEY, host TEXT NOT NULL, tenant TEXT NOT NULL, created DOUBLE PRECISION NOT NULL DEFAULT {NOW});
"""
# reserve (directory.py) in one round trip and one commit: the image ownership check (images another
# tenant made are not found); under the tenant's row lock, an earlier
# create with the same key, else the quota check (the tenant's usage counters) and the placement among
# the candidates the gateway scored (locality, free room), to which the tenant's spread over failure
# domains (its counters per host) is added here.
# PL/pgSQL: each statement takes a fresh snapshot (READ COMMITTED), so the sums after the lock see
# every create that held it before; a single SQL statement (a CTE) would read under its first snapshot.
RESERVE_FN = """
CREATE OR REPLACE FUNCTION fleet_reserve(p_tenant TEXT, p_admin BOOLEAN, p_key TEXT, p_cpu DOUBLE PRECISION,
    p_mem BIGINT, p_disk BIGINT, p_hosts TEXT[], p_domains TEXT[], p_base DOUBLE PRECISION[], p_w_spread
    DOUBLE PRECISION, p_slot TEXT, p_refs TEXT[])
  RETURNS TABLE(kind TEXT, r_slot TEXT, r_host TEXT, r_address TEXT, r_state TEXT, r_id TEXT, r_info JSONB,
                r_reason TEXT, r_order TEXT[])
  LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
  q JSONB; pr RECORD; u RECORD; ranked TEXT[]; res TEXT; used DOUBLE PRECISION; want DOUBLE PRECISION;
  cap DOUBLE PRECISION;
BEGIN
  IF NOT p_admin THEN  -- images another tenant made are not found (Served.check_image)
    SELECT o.ref INTO res FROM fleet_owners o WHERE o.kind = 'image' AND o.ref = ANY(p_refs)
      AND o.tenant <> p_tenant LIMIT 1;
    IF FOUND THEN
      RETURN QUERY SELECT 'no_image', NULL, NULL, NULL, NULL, NULL, NULL::JSONB, res, NULL::TEXT[]; RETURN;
    END IF;
  END IF;
  IF NOT p_admin THEN  -- the tenant's row lock serializes its creates: quota checks cannot interleave
    SELECT t.quotas INTO q FROM fleet_tenants t WHERE t.name = p_tenant FOR UPDATE;
    IF NOT FOUND THEN
      RETURN QUERY SELECT 'no_tenant', NULL, NULL, NULL, NULL, NULL, NULL::JSONB, NULL, NULL::TEXT[]; RETURN;
    END IF;
  END IF;
  IF p_key IS NOT NULL THEN
    SELECT s.slot, s.host, h.address, s.state, s.id, s.info, s.reason INTO pr FROM fleet_sandboxes s
      LEFT JOIN fleet_hosts h ON h.id = s.host WHERE s.tenant = p_tenant AND s.idem_key = p_key;
    IF FOUND THEN
      IF NOT (pr.state IN ('lost', 'dead') AND pr.info IS NULL) THEN
        RETURN QUERY SELECT 'prior', pr.slot, pr.host, pr.address, pr.state, pr.id, pr.info, pr.reason,
          NULL::TEXT[];
        RETURN;
      END IF;
      -- its create never answered and its host is gone: the key may place a new one
      UPDATE fleet_sandboxes SET idem_key = NULL WHERE slot = pr.slot;
    END IF;
  END IF;
  IF q IS NOT NULL THEN
    SELECT coalesce(sum(c.sandboxes), 0)::DOUBLE PRECISION AS sandboxes, coalesce(sum(c.cpu), 0) AS cpu,
           coalesce(sum(c.memory_mb), 0)::DOUBLE PRECISION AS memory_mb,
           coalesce(sum(c.disk_mb), 0)::DOUBLE PRECISION AS disk_mb
      INTO u FROM fleet_usage c WHERE c.tenant = p_tenant;
    FOREACH res IN ARRAY ARRAY['sandboxes', 'cpu', 'memory_mb', 'disk_mb'] LOOP
      used := CASE res WHEN 'sandboxes' THEN u.sandboxes WHEN 'cpu' THEN u.cpu WHEN 'memory_mb' THEN u.memory_mb
              ELSE u.disk_mb END;
      want := CASE res WHEN 'sandboxes' THEN 1 WHEN 'cpu' THEN p_cpu WHEN 'memory_mb' THEN p_mem ELSE p_disk END;
      cap := coalesce((q ->> res)::DOUBLE PRECISION, 0);
      IF used + want > cap + 1e-9 THEN  -- the counters add and subtract floats (cpu): no refusal on their residue
        RETURN QUERY SELECT 'quota', NULL, NULL, NULL, NULL, NULL,
          jsonb_build_object('name', res, 'cap', cap, 'used', used, 'want', want), NULL, NULL::TEXT[];
        RETURN;
      END IF;
    END LOOP;
  END IF;
  IF coalesce(array_length(p_hosts, 1), 0) = 0 THEN
    RETURN QUERY SELECT 'no_host', NULL, NULL, NULL, NULL, NULL, NULL::JSONB, NULL, NULL::TEXT[]; RETURN;
  END IF;
  WITH dc AS (SELECT h.domain, sum(c.sandboxes)::DOUBLE PRECISION AS n FROM fleet_usage c
                JOIN fleet_hosts h ON h.id = c.host
               WHERE c.tenant = p_tenant AND c.sandboxes > 0 GROUP BY h.domain),
       tot AS (SELECT coalesce(sum(n), 0) AS t FROM dc)
  SELECT array_agg(c.host ORDER BY c.base + p_w_spread * (CASE WHEN tot.t = 0 THEN 1.0
                                                          ELSE 1.0 - coalesce(dc.n, 0) / tot.t END) DESC)
    INTO ranked
    FROM unnest(p_hosts, p_domains, p_base) AS c(host, domain, base) CROSS JOIN tot
    LEFT JOIN dc ON dc.domain = c.domain;
  INSERT INTO fleet_sandboxes(slot, host, tenant, state, idem_key, cpu, memory_mb, disk_mb)
    VALUES (p_slot, ranked[1], p_tenant, 'creating', p_key, p_cpu, p_mem, p_disk);
  RETURN QUERY SELECT 'placed', p_slot, ranked[1], NULL, 'creating', NULL, NULL::JSONB, NULL, ranked;
END
$fn$;
"""
# What the live rows (creating, running) of each tenant hold on each host, kept by a trigger in the
# same transaction as every change to fleet_sandboxes: admission (fleet_reserve) and placement read a
# few counter rows instead of summing the live rows, whose number grows with the fleet. Exact by
# construction (one transaction), so a host's death (expire), a PostgreSQL restart (committed or
# not, both together) or a crash cannot make them drift; `Directory.usage_drift` checks.
USAGE_FN = """
CREATE OR REPLACE FUNCTION fleet_usage_track() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
  IF TG_OP <> 'INSERT' AND OLD.state IN ('creating', 'running') THEN
    UPDATE fleet_usage SET sandboxes = sandboxes - 1, cpu = cpu - OLD.cpu, memory_mb = memory_mb - OLD.memory_mb,
      disk_mb = disk_mb - OLD.disk_mb WHERE tenant = OLD.tenant AND host = OLD.host;
  END IF;
  IF TG_OP <> 'DELETE' AND NEW.state IN ('creating', 'running') THEN
    INSERT INTO fleet_usage AS u(tenant, host, sandboxes, cpu, memory_mb, disk_mb)
      VALUES (NEW.tenant, NEW.host, 1, NEW.cpu, NEW.memory_mb, NEW.disk_mb)
      ON CONFLICT (tenant, host) DO UPDATE SET sandboxes = u.sandboxes + 1, cpu = u.cpu + EXCLUDED.cpu,
        memory_mb = u.memory_mb + EXCLUDED.memory_mb, disk_mb = u.disk_mb + EXCLUDED.disk_mb;
  END IF;
  RETURN NULL;
END
$fn$;
CREATE OR REPLACE TRIGGER fleet_usage_rows AFTER INSERT OR DELETE ON fleet_sandboxes
  FOR EACH ROW EXECUTE FUNCTION fleet_usage_track();
CREATE OR REPLACE TRIGGER fleet_usage_moves AFTER UPDATE ON fleet_sandboxes FOR EACH ROW
  WHEN ((OLD.state IN ('creating', 'running')) IS DISTINCT FROM (NEW.state IN ('creating', 'running'))
        OR OLD.host IS DISTINCT FROM NEW.host OR OLD.tenant IS DISTINCT FROM NEW.tenant OR OLD.cpu <> NEW.cpu
        OR OLD.memory_mb <> NEW.memory_mb OR OLD.disk_mb <> NEW.disk_mb)
  EXECUTE FUNCTION fleet_usage_track();
"""
# the counters from the rows: once, when a database made before them gets them (its writers held off)
USAGE_BACKFILL = """
LOCK TABLE fleet_sandboxes IN SHARE ROW EXCLUSIVE MODE;
DELETE FROM fleet_usage;
INSERT INTO fleet_usage(tenant, host, sandboxes, cpu, memory_mb, disk_mb)
  SELECT tenant, host, count(*), sum(cpu), sum(memory_mb), sum(disk_mb) FROM fleet_sandboxes
   WHERE state IN ('creating', 'running') GROUP BY tenant, host;
"""
_SCHEMA_LOCK = 0x5348_4F41_4C46  # advisory lock id: concurrent first openers create the schema once


def open_db(dsn: str) -> PerThreadPG:
    """Connections to the fleet's database, its tables created if missing."""
    pg = PerThreadPG(dsn)
    with pg.transaction() as db:
        db.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
        row = db.execute("SELECT to_regclass('fleet_usage') IS NULL").fetchone()
        db.execute(SCHEMA)
        db.execute(USAGE_FN)
        if row is not None and row[0]:
            db.execute(USAGE_BACKFILL)
        db.execute(RESERVE_FN)
    return pg
