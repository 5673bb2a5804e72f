"""The episode queue: the single source of truth between trainers and rollout workers.

Trainers submit episodes and read results; workers claim episodes under a lease that they renew
while they run them. A worker that dies stops renewing: when its lease runs out the episode is
claimed again (by any worker, on any node) and resumes through the trajectory log. Nothing here
depends on the trainer process being alive.

`EpisodeQueue` is the contract; `open_queue(where)` picks the store: a file path is SQLite (WAL),
the single-host default; a `postgresql://` URL is PostgreSQL (`queue_pg`), for workers on many
hosts without a shared filesystem. Both pass the same tests (tests/rollout/test_queue.py).

States: queued -> running -> done | failed (after max_attempts) | paused (the LLM endpoint was
down: `resume_paused()` puts those back in the queue).
"""
from __future__ import annotations

import abc
import json
import os
import sqlite3
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import InvalidArgument
from ..core.sqlite import PerThreadDB, is_postgres_url

QUEUED, RUNNING, DONE, FAILED, PAUSED = "queued", "running", "done", "failed", "paused"
STATES = (QUEUED, RUNNING, DONE, FAILED, PAUSED)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS episodes(
  id TEXT PRIMARY KEY, n INTEGER NOT NULL, task_id TEXT NOT NULL, policy TEXT NOT NULL, image TEXT,
  status TEXT NOT NULL, worker TEXT, node TEXT, lease_until REAL, attempts INTEGER NOT NULL DEFAULT 0,
  error TEXT, reward REAL, record TEXT, created REAL NOT NULL, started REAL, finished REAL);
CREATE INDEX IF NOT EXISTS episodes_status ON episodes(status, n);
"""


@dataclass
class Claim:
    id: str
    task_id: str
    policy: dict
    attempts: int
    resumed: bool  # someone ran it before (a dead worker): the log will fast-forward it


class EpisodeQueue(abc.ABC):
    """Episodes between trainers and workers. Every state change is atomic; a claim is exclusive
    while its lease runs; a late write by a worker whose lease was taken over is refused."""

    max_attempts: int

    # ------------------------------------------------------------------ trainer side
    @abc.abstractmethod
    def submit(self, task_ids: list[str], policy: dict, *, repeats: int = 1, images: dict[str, str] | None = None,
               prefix: str | None = None) -> list[str]:
        """Queue `repeats` episodes of each task; returns their ids (`<prefix>-<n>`), in order."""

    @abc.abstractmethod
    def counts(self) -> dict:
        """Episodes per state, plus "reward" (sum over done) and "total"."""

    @abc.abstractmethod
    def get(self, eid: str) -> dict | None: ...

    @abc.abstractmethod
    def records(self, status: str = DONE) -> list[dict]:
        """The finished episodes' records, in submission order."""

    @abc.abstractmethod
    def resume_paused(self) -> int: ...

    @abc.abstractmethod
    def pending(self) -> int:
        """Episodes queued or running."""

    # ------------------------------------------------------------------ worker side
    @abc.abstractmethod
    def claim(self, worker: str, node: str, *, lease_s: float = 30.0,
              prefer_images: set[str] | frozenset[str] = frozenset()) -> Claim | None:
        """Take the oldest claimable episode (queued, or running under an expired lease), preferring
        ones whose task image this node already has."""

    @abc.abstractmethod
    def heartbeat(self, ids: list[str], worker: str, lease_s: float = 30.0) -> None: ...

    @abc.abstractmethod
    def finish(self, eid: str, worker: str, record: dict) -> bool:
        """Record the result; False if `worker` no longer holds the episode."""

    @abc.abstractmethod
    def fail(self, eid: str, worker: str, error: str) -> str:
        """Requeue (attempts left) or mark failed; returns the new state."""

    @abc.abstractmethod
    def pause(self, eid: str, worker: str, reason: str) -> None: ...

    def close(self) -> None:
        return None


COUNTS_SQL = "SELECT status, COUNT(*), COALESCE(SUM(reward), 0) FROM episodes GROUP BY status"


def tally(rows: list) -> dict:
    """`counts()` from COUNTS_SQL's rows (status, episodes, reward sum)."""
    out: dict[str, float] = {s: 0 for s in STATES}
    reward = 0.0
    for status, n, r in rows:
        out[status] = n
        reward += r
    out["reward"] = reward
    out["total"] = sum(out[s] for s in STATES)
    return out


def open_queue(where: str | os.PathLike, max_attempts: int = 3) -> EpisodeQueue:
    """A `postgresql://` URL: the PostgreSQL queue; anything else: an SQLite file at that path."""
    if is_postgres_url(where):
        from .queue_pg import PgEpisodeQueue

        return PgEpisodeQueue(str(where), max_attempts=max_attempts)
    return SQLiteEpisodeQueue(where, max_attempts=max_attempts)


class SQLiteEpisodeQueue(EpisodeQueue):
    def __init__(self, path: str | os.PathLike, max_attempts: int = 3):
        self.path = Path(path)
        self.max_attempts = max_attempts
        self._conn = PerThreadDB(self.path)
        self._db.executescript(_SCHEMA)

    @property
    def _db(self) -> sqlite3.Connection:
        return self._conn.get()

    # ------------------------------------------------------------------ trainer side
    def submit(self, task_ids: list[str], policy: dict, *, repeats: int = 1, images: dict[str, str] | None = None,
               prefix: str | None = None) -> list[str]:
        if not task_ids or repeats < 1:
            raise InvalidArgument("submit needs at least one task id and repeats >= 1")
        prefix = prefix or uuid.uuid4().hex[:8]
        with self._conn.transaction() as db:
            n0 = db.execute("SELECT COALESCE(MAX(n), 0) FROM episodes").fetchone()[0]
            ids, now = [], time.time()
            for _ in range(repeats):
                for t in task_ids:
                    n0 += 1
                    eid = f"{prefix}-{n0:06d}"
                    db.execute("INSERT INTO episodes(id, n, task_id, policy, image, status, created) "
                               "VALUES(?,?,?,?,?,?,?)", (eid, n0, t, json.dumps(policy), (images or {}).get(t),
                                                         QUEUED, now))
                    ids.append(eid)
        return ids

    def counts(self) -> dict:
        return tally(self._db.execute(COUNTS_SQL).fetchall())

    def get(self, eid: str) -> dict | None:
        row = self._db.execute("SELECT id, task_id, status, worker, node, attempts, error, reward, started, finished "
                               "FROM episodes WHERE id=?", (eid,)).fetchone()
        if not row:
            return None
        keys = ("id", "task_id", "status", "worker", "node", "attempts", "error", "reward", "started", "finished")
        return dict(zip(keys, row))

    def records(self, status: str = DONE) -> list[dict]:
        return [json.loads(r[0]) for r in
                self._db.execute("SELECT record FROM episodes WHERE status=? AND record IS NOT NULL ORDER BY n",
                                 (status,))]

    def resume_paused(self) -> int:
        return self._db.execute("UPDATE episodes SET status=?, worker=NULL, lease_until=NULL WHERE status=?",
                                (QUEUED, PAUSED)).rowcount

    # ------------------------------------------------------------------ worker side
    def claim(self, worker: str, node: str, *, lease_s: float = 30.0,
              prefer_images: set[str] | frozenset[str] = frozenset()) -> Claim | None:
        now = time.time()
        with self._conn.transaction() as db:
            rows = db.execute("SELECT id, task_id, policy, image, attempts, status FROM episodes "
                              "WHERE status=? OR (status=? AND lease_until < ?) ORDER BY n LIMIT 256",
                              (QUEUED, RUNNING, now)).fetchall()
            if not rows:
                return None
            pick = next((r for r in rows if r[3] and r[3] in prefer_images), rows[0])
            db.execute("UPDATE episodes SET status=?, worker=?, node=?, lease_until=?, attempts=attempts+1, "
                       "started=COALESCE(started, ?) WHERE id=?", (RUNNING, worker, node, now + lease_s, now, pick[0]))
        return Claim(pick[0], pick[1], json.loads(pick[2]), pick[4] + 1, resumed=pick[4] > 0)

    def heartbeat(self, ids: list[str], worker: str, lease_s: float = 30.0) -> None:
        if ids:
            marks = ",".join("?" * len(ids))
            self._db.execute(f"UPDATE episodes SET lease_until=? WHERE worker=? AND status=? AND id IN ({marks})",
                             (time.time() + lease_s, worker, RUNNING, *ids))

    def finish(self, eid: str, worker: str, record: dict) -> bool:
        return self._db.execute("UPDATE episodes SET status=?, record=?, reward=?, finished=?, error=NULL "
                                "WHERE id=? AND worker=? AND status=?",
                                (DONE, json.dumps(record), record.get("reward"), time.time(), eid, worker,
                                 RUNNING)).rowcount == 1

    def fail(self, eid: str, worker: str, error: str) -> str:
        with self._conn.transaction() as db:
            row = db.execute("SELECT attempts FROM episodes WHERE id=? AND worker=? AND status=?",
                             (eid, worker, RUNNING)).fetchone()
            state = RUNNING
            if row:
                state = FAILED if row[0] >= self.max_attempts else QUEUED
                db.execute("UPDATE episodes SET status=?, error=?, worker=NULL, lease_until=NULL, finished=? "
                           "WHERE id=?", (state, error[-2000:], time.time() if state == FAILED else None, eid))
        return state

    def pause(self, eid: str, worker: str, reason: str) -> None:
        self._db.execute("UPDATE episodes SET status=?, error=?, worker=NULL, lease_until=NULL "
                         "WHERE id=? AND worker=? AND status=?", (PAUSED, reason[-2000:], eid, worker, RUNNING))

    def pending(self) -> int:
        return self._db.execute("SELECT COUNT(*) FROM episodes WHERE status IN (?, ?)", (QUEUED, RUNNING)).fetchone()[0]

    def close(self) -> None:
        self._conn.close()


def log_beside(queue: str | os.PathLike, log: str | os.PathLike | None = None) -> str | os.PathLike:
    """Where a rollout's trajectory log is: `log` if given, else the same PostgreSQL database as the
    queue, or a file next to an SQLite queue."""
    if log is not None:
        return log
    if is_postgres_url(queue):
        return queue
    p = Path(queue)
    return p.with_name(p.stem + ".traj.db")
