"""The trajectory log on PostgreSQL: the `LogStore` contract for workers on many hosts that share no
filesystem (the fleet). Same semantics as the SQLite store, tested by the same tests:

- `append` is one INSERT ... ON CONFLICT DO NOTHING: exactly one writer wins a (stream, seq);
- `open_stream` takes a stream over and turns the old writer's PENDING entries UNKNOWN, in one
  transaction;
- every call commits before it returns (a kill -9 of the worker right after loses nothing).

Requests and results are stored as the JSON text the log hashed and wrote, not re-encoded (JSONB
would reorder keys and normalise numbers).
"""
from __future__ import annotations

import json
import time

from ..core.errors import InvalidArgument
from ..core.postgres import PerThreadPG
from .store import _COLS, DONE, PENDING, UNKNOWN, Entry, LogStore, StreamInfo, _entry, entries_query, result_json

try:
    from psycopg.types.json import Jsonb
except ImportError as e:  # an extra: the SDK, CLI and daemon do not need it
    raise ImportError("the PostgreSQL log needs psycopg: pip install 'shoal[rollout]'") from e

_SCHEMA = """
CREATE TABLE IF NOT EXISTS log_streams(
  stream TEXT PRIMARY KEY, episode TEXT, image TEXT, layers JSONB NOT NULL, writer TEXT,
  created DOUBLE PRECISION NOT NULL, meta JSONB NOT NULL DEFAULT '{}');
CREATE TABLE IF NOT EXISTS log_entries(
  stream TEXT NOT NULL, seq INTEGER NOT NULL, kind TEXT NOT NULL, req_hash TEXT NOT NULL,
  request TEXT NOT NULL, status TEXT NOT NULL, result TEXT, episode TEXT, sandbox TEXT, host TEXT,
  writer TEXT, started DOUBLE PRECISION NOT NULL, finished DOUBLE PRECISION, PRIMARY KEY(stream, seq));
CREATE INDEX IF NOT EXISTS log_entries_episode ON log_entries(episode);
CREATE INDEX IF NOT EXISTS log_entries_sandbox ON log_entries(sandbox);
CREATE INDEX IF NOT EXISTS log_entries_started ON log_entries(started);
CREATE INDEX IF NOT EXISTS log_streams_episode ON log_streams(episode);
ALTER TABLE log_streams ADD COLUMN IF NOT EXISTS parent TEXT;
ALTER TABLE log_streams ADD COLUMN IF NOT EXISTS parent_step INTEGER;
CREATE INDEX IF NOT EXISTS log_streams_parent ON log_streams(parent);
"""
_SCHEMA_LOCK = 0x5348_4F41_4C4C  # advisory lock id: concurrent first openers create the schema once
_STREAM_COLS = "stream, episode, image, layers, writer, created, meta, parent, parent_step"


class PgLogStore(LogStore):
    def __init__(self, dsn: str):
        self.dsn = dsn
        self._pg = PerThreadPG(dsn)
        with self._pg.transaction() as db:
            db.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
            db.execute(_SCHEMA)

    def __repr__(self) -> str:
        return f"PgLogStore({self._pg!r})"

    # ------------------------------------------------------------------ streams
    def open_stream(self, stream, *, episode, image, layers, writer, meta=None) -> int:
        with self._pg.transaction() as db:
            db.execute("INSERT INTO log_streams(stream, episode, image, layers, writer, created, meta) "
                       "VALUES(%s, %s, %s, %s, %s, %s, %s) "
                       "ON CONFLICT(stream) DO UPDATE SET writer=excluded.writer",
                       (stream, episode, image, Jsonb(layers), writer, time.time(), Jsonb(meta or {})))
            db.execute("UPDATE log_entries SET status=%s, finished=%s WHERE stream=%s AND status=%s "
                       "AND writer IS DISTINCT FROM %s", (UNKNOWN, time.time(), stream, PENDING, writer))
            row = db.execute("SELECT COUNT(*) FROM log_entries WHERE stream=%s", (stream,)).fetchone()
            return int(row[0]) if row else 0

    def update_stream(self, stream, *, image=None, layers=None, meta=None):
        self._pg.execute("UPDATE log_streams SET image=COALESCE(%s, image), layers=COALESCE(%s, layers), "
                         "meta = meta || %s WHERE stream=%s",
                         (image, Jsonb(layers) if layers is not None else None, Jsonb(meta or {}), stream))

    def stream_info(self, stream):
        row = self._pg.execute(f"SELECT {_STREAM_COLS} FROM log_streams WHERE stream=%s", (stream,)).fetchone()
        return _stream(row) if row else None

    def streams(self, episode=None):
        q = f"SELECT {_STREAM_COLS} FROM log_streams"
        rows = self._pg.execute(q + " WHERE episode=%s ORDER BY created", (episode,)) if episode is not None \
            else self._pg.execute(q + " ORDER BY created")
        return [_stream(r) for r in rows]

    def children(self, stream):
        rows = self._pg.execute(f"SELECT {_STREAM_COLS} FROM log_streams WHERE parent=%s ORDER BY created", (stream,))
        return [_stream(r) for r in rows]

    def branch_streams(self, copies, *, episode, step) -> int:
        n = 0
        with self._pg.transaction() as db:  # one transaction: a branch is all there, or not at all
            for source, stream, upto, meta in copies:
                row = db.execute("SELECT image, layers, meta FROM log_streams WHERE stream=%s", (source,)).fetchone()
                if row is None:
                    raise InvalidArgument(f"no trajectory stream named {source!r}")
                cur = db.execute(f"INSERT INTO log_streams({_STREAM_COLS}) VALUES(%s, %s, %s, %s, %s, %s, %s, %s, %s) "
                                 "ON CONFLICT DO NOTHING",
                                 (stream, episode, row[0], Jsonb(row[1]), None, time.time(),
                                  Jsonb({**dict(row[2]), **(meta or {})}), source, step))
                if cur.rowcount != 1:
                    raise InvalidArgument(f"trajectory stream {stream!r} exists already")
                n += db.execute(f"INSERT INTO log_entries({_COLS}) SELECT %s, seq, kind, req_hash, request, status, "
                                "result, %s, sandbox, host, writer, started, finished FROM log_entries "
                                "WHERE stream=%s AND seq<%s", (stream, episode, source, upto)).rowcount
        return n

    # ------------------------------------------------------------------ entries
    def append(self, e: Entry) -> bool:
        cur = self._pg.execute(
            f"INSERT INTO log_entries({_COLS}) VALUES(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s) "
            "ON CONFLICT DO NOTHING",
            (e.stream, e.seq, e.kind, e.req_hash, e.request_json or json.dumps(e.request), e.status,
             None if e.result is None else json.dumps(e.result), e.episode, e.sandbox, e.host, e.writer,
             e.started, e.finished))
        return cur.rowcount == 1

    def complete(self, stream, seq, result, status=DONE):
        self._pg.execute("UPDATE log_entries SET status=%s, result=%s, finished=%s WHERE stream=%s AND seq=%s",
                         (status, result_json(result), time.time(), stream, seq))

    def discard(self, stream, seq):
        self._pg.execute("DELETE FROM log_entries WHERE stream=%s AND seq=%s AND status=%s", (stream, seq, PENDING))

    def get(self, stream, seq):
        row = self._pg.execute(f"SELECT {_COLS} FROM log_entries WHERE stream=%s AND seq=%s",
                               (stream, seq)).fetchone()
        return _entry(row) if row else None

    def entries(self, stream=None, *, episode=None, sandbox=None, kind=None, since=None, until=None, limit=None):
        q, args = entries_query("log_entries", "%s", stream, episode=episode, sandbox=sandbox, kind=kind,
                                since=since, until=until, limit=limit)
        return [_entry(r) for r in self._pg.execute(q, args)]

    def close(self) -> None:
        self._pg.close()


def _stream(r) -> StreamInfo:
    return StreamInfo(stream=r[0], episode=r[1], image=r[2], layers=list(r[3]), writer=r[4], created=r[5],
                      meta=dict(r[6]), parent=r[7], parent_step=r[8])
