"""The episode queue on PostgreSQL: the same contract and states as the SQLite queue, for workers
on many hosts that share no filesystem.

Claims use `FOR UPDATE SKIP LOCKED`: concurrent workers each lock a different row instead of
queueing on one, and a row is claimed by one transaction only. Lease times are the database's
clock, not the workers', so hosts with skewed clocks agree on when a lease has run out.
"""
from __future__ import annotations

import uuid

from ..core.errors import InvalidArgument
from ..core.postgres import PerThreadPG
from .queue import COUNTS_SQL, DONE, FAILED, PAUSED, QUEUED, RUNNING, Claim, EpisodeQueue, tally

try:
    from psycopg.types.json import Jsonb
except ImportError as e:  # an extra: the SDK, CLI and daemon do not need it
    raise ImportError("the PostgreSQL queue needs psycopg: pip install 'shoal[rollout]'") from e

_NOW = "extract(epoch from clock_timestamp())"
_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS episodes(
  id TEXT PRIMARY KEY, n BIGSERIAL UNIQUE, task_id TEXT NOT NULL, policy JSONB NOT NULL, image TEXT,
  status TEXT NOT NULL, worker TEXT, node TEXT, lease_until DOUBLE PRECISION,
  attempts INTEGER NOT NULL DEFAULT 0, error TEXT, reward DOUBLE PRECISION, record JSONB,
  created DOUBLE PRECISION NOT NULL DEFAULT {_NOW}, started DOUBLE PRECISION, finished DOUBLE PRECISION);
CREATE INDEX IF NOT EXISTS episodes_status ON episodes(status, n);
"""
_SCHEMA_LOCK = 0x5348_4F41_4C51  # advisory lock id: concurrent first openers create the schema once


class PgEpisodeQueue(EpisodeQueue):
    def __init__(self, dsn: str, max_attempts: int = 3):
        self.dsn, self.max_attempts = dsn, max_attempts
        self._pg = PerThreadPG(dsn)
        with self._pg.transaction() as db:
            db.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
            db.execute(_SCHEMA)

    def __repr__(self) -> str:
        return f"PgEpisodeQueue({self._pg!r})"

    # ------------------------------------------------------------------ trainer side
    def submit(self, task_ids: list[str], policy: dict, *, repeats: int = 1, images: dict[str, str] | None = None,
               prefix: str | None = None) -> list[str]:
        if not task_ids or repeats < 1:
            raise InvalidArgument("submit needs at least one task id and repeats >= 1")
        prefix = prefix or uuid.uuid4().hex[:8]
        order = [t for _ in range(repeats) for t in task_ids]
        with self._pg.transaction() as db:
            ns = [r[0] for r in db.execute("SELECT nextval(pg_get_serial_sequence('episodes', 'n')) "
                                           "FROM generate_series(1, %s)", (len(order),))]
            rows = [(f"{prefix}-{n:06d}", n, t, Jsonb(policy), (images or {}).get(t), QUEUED)
                    for n, t in zip(sorted(ns), order)]
            with db.cursor() as cur:
                cur.executemany("INSERT INTO episodes(id, n, task_id, policy, image, status) "
                                "VALUES(%s, %s, %s, %s, %s, %s)", rows)
        return [r[0] for r in rows]

    def counts(self) -> dict:
        return tally(self._pg.execute(COUNTS_SQL).fetchall())

    def get(self, eid: str) -> dict | None:
        keys = ("id", "task_id", "status", "worker", "node", "attempts", "error", "reward", "started", "finished")
        row = self._pg.execute(f"SELECT {', '.join(keys)} FROM episodes WHERE id=%s", (eid,)).fetchone()
        return dict(zip(keys, row)) if row else None

    def records(self, status: str = DONE) -> list[dict]:
        return [r[0] for r in self._pg.execute(
            "SELECT record FROM episodes WHERE status=%s AND record IS NOT NULL ORDER BY n", (status,))]

    def resume_paused(self) -> int:
        return self._pg.execute("UPDATE episodes SET status=%s, worker=NULL, lease_until=NULL WHERE status=%s",
                                (QUEUED, PAUSED)).rowcount

    def pending(self) -> int:
        row = self._pg.execute("SELECT COUNT(*) FROM episodes WHERE status IN (%s, %s)", (QUEUED, RUNNING)).fetchone()
        return int(row[0]) if row else 0

    # ------------------------------------------------------------------ worker side
    def claim(self, worker: str, node: str, *, lease_s: float = 30.0,
              prefer_images: set[str] | frozenset[str] = frozenset()) -> Claim | None:
        row = self._pg.execute(
            f"""WITH pick AS (
                  SELECT id FROM episodes
                  WHERE status=%(queued)s OR (status=%(running)s AND lease_until < {_NOW})
                  ORDER BY (image = ANY(%(prefer)s)) IS TRUE DESC, n
                  LIMIT 1 FOR UPDATE SKIP LOCKED)
                UPDATE episodes e SET status=%(running)s, worker=%(worker)s, node=%(node)s,
                  lease_until={_NOW} + %(lease)s, attempts=e.attempts + 1, started=COALESCE(e.started, {_NOW})
                FROM pick WHERE e.id = pick.id
                RETURNING e.id, e.task_id, e.policy, e.attempts""",
            {"queued": QUEUED, "running": RUNNING, "prefer": sorted(prefer_images), "worker": worker, "node": node,
             "lease": lease_s}).fetchone()
        if row is None:
            return None
        eid, task_id, policy, attempts = row
        return Claim(eid, task_id, policy, attempts, resumed=attempts > 1)

    def heartbeat(self, ids: list[str], worker: str, lease_s: float = 30.0) -> None:
        if ids:
            self._pg.execute(f"UPDATE episodes SET lease_until={_NOW} + %s "
                             "WHERE worker=%s AND status=%s AND id = ANY(%s)", (lease_s, worker, RUNNING, ids))

    def finish(self, eid: str, worker: str, record: dict) -> bool:
        return self._pg.execute(
            f"UPDATE episodes SET status=%s, record=%s, reward=%s, finished={_NOW}, error=NULL "
            "WHERE id=%s AND worker=%s AND status=%s",
            (DONE, Jsonb(record), record.get("reward"), eid, worker, RUNNING)).rowcount == 1

    def fail(self, eid: str, worker: str, error: str) -> str:
        row = self._pg.execute(
            f"""UPDATE episodes SET status = CASE WHEN attempts >= %(max)s THEN %(failed)s ELSE %(queued)s END,
                  error=%(error)s, worker=NULL, lease_until=NULL,
                  finished = CASE WHEN attempts >= %(max)s THEN {_NOW} END
                WHERE id=%(id)s AND worker=%(worker)s AND status=%(running)s RETURNING status""",
            {"max": self.max_attempts, "failed": FAILED, "queued": QUEUED, "error": error[-2000:], "id": eid,
             "worker": worker, "running": RUNNING}).fetchone()
        return row[0] if row else RUNNING

    def pause(self, eid: str, worker: str, reason: str) -> None:
        self._pg.execute("UPDATE episodes SET status=%s, error=%s, worker=NULL, lease_until=NULL "
                         "WHERE id=%s AND worker=%s AND status=%s", (PAUSED, reason[-2000:], eid, worker, RUNNING))

    def close(self) -> None:
        self._pg.close()
