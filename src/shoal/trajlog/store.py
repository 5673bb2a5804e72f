"""Where trajectory-log entries live: the storage contract and its embedded SQLite implementation.

An entry is one operation on one *stream* (a sandbox's operations, or an episode's LLM calls),
keyed by (stream, seq) and carrying the hash of its request. The contract is small on purpose so
a shared database can serve many hosts later; the embedded default is one SQLite file in WAL mode,
which many processes on one host (workers, Ray raylets) can share.
"""
from __future__ import annotations

import json
import math
import os
import sqlite3
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

from ..core.errors import InvalidArgument
from ..core.sqlite import PerThreadDB

PENDING, DONE, UNKNOWN = "PENDING", "DONE", "UNKNOWN"


class ModelResult(dict):
    """A result that is a pydantic model (an ExecResult): stored as the model's own JSON, which skips
    a dict round trip on the hot path. Empty as a dict; the caller takes `.model`."""

    def __init__(self, model):  # empty: dict.__init__ has nothing to do
        self.model = model

    def to_json(self) -> str:
        return self.json_bytes().decode()

    def json_bytes(self) -> bytes:
        m = self.model  # what model_dump_json() returns, as bytes, without its Python layer
        return m.__pydantic_serializer__.to_json(m)


def result_json(result: dict) -> str:
    return result.to_json() if isinstance(result, ModelResult) else json.dumps(result)


_pid = os.getpid()  # kept current across forks, so the hot path makes no getpid(2) call


def _after_fork() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_after_fork)

_STATUS_JSON = {DONE: b'"DONE"', UNKNOWN: b'"UNKNOWN"'}
_jstr = json.encoder.encode_basestring_ascii  # json.dumps(s) for a str: one C call, no encoder object


def _j(v: object) -> str:
    """json.dumps(v), without building an encoder for the scalars an entry is mostly made of."""
    if type(v) is str:
        return _jstr(v)
    if v is None:
        return "null"
    if type(v) is int or (type(v) is float and math.isfinite(v)):
        return repr(v)  # what json writes for them
    return json.dumps(v)


@dataclass
class Entry:
    stream: str
    seq: int
    kind: str  # exec, write, read, list, snapshot, llm, ...
    req_hash: str
    request: dict
    status: str = PENDING  # PENDING -> DONE, or UNKNOWN when its writer died mid-operation
    result: dict | None = None
    episode: str | None = None
    sandbox: str | None = None  # the physical sandbox it ran in (changes when a stream is restored)
    host: str | None = None  # node / host root that ran it
    writer: str | None = None
    started: float = field(default_factory=time.time)
    finished: float | None = None
    request_json: str | None = field(default=None, repr=False, compare=False)  # canonical JSON, when known


@dataclass
class StreamInfo:
    stream: str
    episode: str | None
    image: str | None
    layers: list[str]
    writer: str | None
    created: float
    meta: dict
    parent: str | None = None  # the stream this one was branched from (rollout.branch), with the step
    parent_step: int | None = None


class LogStore(ABC):
    """Storage behind a TrajectoryLog. Implementations must make `append` atomic on (stream, seq):
    exactly one writer wins a sequence number."""

    @abstractmethod
    def open_stream(self, stream: str, *, episode: str | None, image: str | None, layers: list[str],
                    writer: str, meta: dict | None = None) -> int:
        """Create or take over a stream. Entries left PENDING by an earlier writer become UNKNOWN.
        Returns how many entries the stream holds."""

    @abstractmethod
    def update_stream(self, stream: str, *, image: str | None = None, layers: list[str] | None = None,
                      meta: dict | None = None) -> None:
        """Change a stream's image / layers, and merge `meta` into its metadata."""

    @abstractmethod
    def stream_info(self, stream: str) -> StreamInfo | None: ...

    @abstractmethod
    def append(self, entry: Entry) -> bool:
        """Insert a PENDING entry; False if (stream, seq) is taken."""

    def begin(self, stream: str, seq: int, kind: str, req_hash: str, request: dict, request_json: str | None,
              episode: str | None, sandbox: str | None, host: str | None, writer: str | None) -> bool:
        """`append` of a new PENDING entry given by its fields (what `Stream` writes before each
        operation runs); a store may write it without building the `Entry`."""
        return self.append(Entry(stream=stream, seq=seq, kind=kind, req_hash=req_hash, request=request,
                                 episode=episode, sandbox=sandbox, host=host, writer=writer,
                                 request_json=request_json))

    @abstractmethod
    def complete(self, stream: str, seq: int, result: dict, status: str = DONE) -> None: ...

    @abstractmethod
    def discard(self, stream: str, seq: int) -> None:
        """Drop a PENDING entry whose operation had no effect (a failed idempotent call)."""

    @abstractmethod
    def get(self, stream: str, seq: int) -> Entry | None: ...

    @abstractmethod
    def entries(self, stream: str | None = None, *, episode: str | None = None, sandbox: str | None = None,
                kind: str | None = None, since: float | None = None, until: float | None = None,
                limit: int | None = None) -> list[Entry]: ...

    @abstractmethod
    def streams(self, episode: str | None = None) -> list[StreamInfo]: ...

    def branch_stream(self, source: str, stream: str, upto: int, *, episode: str | None, step: int,
                      meta: dict | None = None) -> int:
        """A new stream `stream` holding `source`'s entries with seq < `upto` (their `episode` set to
        `episode`), its image and layers, its metadata merged with `meta`, and the parent link
        (`source`, `step`). Refuses (InvalidArgument) when `stream` exists. Returns the entries copied."""
        return self.branch_streams([(source, stream, upto, meta)], episode=episode, step=step)

    def branch_streams(self, copies: list[tuple[str, str, int, dict | None]], *, episode: str | None,
                       step: int) -> int:
        """`branch_stream` for each (source, stream, upto, meta), all in one transaction: a branch's
        streams are all there, or none is."""
        raise NotImplementedError(f"{type(self).__name__} cannot branch streams")

    def children(self, stream: str) -> list[StreamInfo]:
        """The streams branched from `stream`, oldest first."""
        return [s for s in self.streams() if s.parent == stream]


_SCHEMA = """
CREATE TABLE IF NOT EXISTS streams(
  stream TEXT PRIMARY KEY, episode TEXT, image TEXT, layers TEXT NOT NULL, writer TEXT,
  created REAL NOT NULL, meta TEXT NOT NULL DEFAULT '{}');
CREATE TABLE IF NOT EXISTS entries(
  stream TEXT NOT NULL, seq INTEGER NOT NULL, kind TEXT NOT NULL, req_hash TEXT NOT NULL,
  request TEXT NOT NULL, status TEXT NOT NULL, result TEXT, episode TEXT, sandbox TEXT, host TEXT,
  writer TEXT, started REAL NOT NULL, finished REAL, PRIMARY KEY(stream, seq)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS entries_episode ON entries(episode);
CREATE INDEX IF NOT EXISTS entries_sandbox ON entries(sandbox);
CREATE INDEX IF NOT EXISTS streams_episode ON streams(episode);
"""

_COLS = "stream, seq, kind, req_hash, request, status, result, episode, sandbox, host, writer, started, finished"
_STREAM_COLS = "stream, episode, image, layers, writer, created, meta, parent, parent_step"
# added after the first release of the log: logs written before get them on open (NULL: no parent)
_STREAM_MIGRATION = (("parent", "TEXT"), ("parent_step", "INTEGER"))


def _migrate(db: sqlite3.Connection) -> None:
    """Bring an older log's tables up to this schema (idempotent, under the write lock)."""
    have = {r[1] for r in db.execute("PRAGMA table_info(streams)")}
    for col, typ in _STREAM_MIGRATION:
        if col not in have:
            db.execute(f"ALTER TABLE streams ADD COLUMN {col} {typ}")
    db.execute("CREATE INDEX IF NOT EXISTS streams_parent ON streams(parent)")


class SQLiteLogStore(LogStore):
    """One SQLite file (WAL). `durable=True` fsyncs every commit (survives power loss); the default
    survives any process crash, kill -9 included, which is what preemption looks like."""

    def __init__(self, path: str | os.PathLike, durable: bool = False):
        self.path = Path(path)
        self._durable = durable
        self._conn = PerThreadDB(self.path, "FULL" if durable else "NORMAL")
        self._db.executescript(_SCHEMA)
        with self._conn.transaction() as db:
            _migrate(db)

    @property
    def _db(self) -> sqlite3.Connection:
        return self._conn.get()

    def open_stream(self, stream, *, episode, image, layers, writer, meta=None) -> int:
        with self._conn.transaction() as db:
            db.execute("INSERT INTO streams(stream, episode, image, layers, writer, created, meta) "
                       "VALUES(?,?,?,?,?,?,?) ON CONFLICT(stream) DO UPDATE SET writer=excluded.writer",
                       (stream, episode, image, json.dumps(layers), writer, time.time(), json.dumps(meta or {})))
            db.execute("UPDATE entries SET status=?, finished=? WHERE stream=? AND status=? AND writer IS NOT ?",
                       (UNKNOWN, time.time(), stream, PENDING, writer))
            return db.execute("SELECT COUNT(*) FROM entries WHERE stream=?", (stream,)).fetchone()[0]

    def update_stream(self, stream, *, image=None, layers=None, meta=None):
        with self._conn.transaction() as db:
            row = db.execute("SELECT meta FROM streams WHERE stream=?", (stream,)).fetchone()
            merged = {**json.loads(row[0]), **(meta or {})} if row else None
            db.execute("UPDATE streams SET image=COALESCE(?, image), layers=COALESCE(?, layers), "
                       "meta=COALESCE(?, meta) WHERE stream=?",
                       (image, json.dumps(layers) if layers is not None else None,
                        json.dumps(merged) if merged is not None else None, stream))

    def stream_info(self, stream):
        row = self._db.execute(f"SELECT {_STREAM_COLS} FROM streams WHERE stream=?", (stream,)).fetchone()
        return _stream(row) if row else None

    def streams(self, episode=None):
        q = f"SELECT {_STREAM_COLS} FROM streams"
        rows = self._db.execute(q + " WHERE episode=? ORDER BY created", (episode,)) if episode is not None \
            else self._db.execute(q + " ORDER BY created")
        return [_stream(r) for r in rows]

    def children(self, stream):
        rows = self._db.execute(f"SELECT {_STREAM_COLS} FROM streams WHERE parent=? ORDER BY created", (stream,))
        return [_stream(r) for r in rows]

    def branch_streams(self, copies, *, episode, step) -> int:
        n = 0
        with self._conn.transaction() as db:  # one transaction: a branch is all there, or not at all
            for source, stream, upto, meta in copies:
                row = db.execute("SELECT image, layers, meta FROM streams WHERE stream=?", (source,)).fetchone()
                if row is None:
                    raise InvalidArgument(f"no trajectory stream named {source!r}")
                merged = {**json.loads(row[2]), **(meta or {})}
                try:
                    db.execute(f"INSERT INTO streams({_STREAM_COLS}) VALUES(?,?,?,?,?,?,?,?,?)",
                               (stream, episode, row[0], row[1], None, time.time(), json.dumps(merged), source, step))
                except sqlite3.IntegrityError:
                    raise InvalidArgument(f"trajectory stream {stream!r} exists already") from None
                n += db.execute(f"INSERT INTO entries({_COLS}) SELECT ?, seq, kind, req_hash, request, status, result, "
                                "?, sandbox, host, writer, started, finished FROM entries WHERE stream=? AND seq<?",
                                (stream, episode, source, upto)).rowcount
        return n

    def append(self, e: Entry) -> bool:
        try:
            self._db.execute(f"INSERT INTO entries({_COLS}) VALUES(?,?,?,?,?,?,?,?,?,?,?,?,?)",
                             (e.stream, e.seq, e.kind, e.req_hash, e.request_json or json.dumps(e.request), e.status,
                              None if e.result is None else json.dumps(e.result), e.episode, e.sandbox, e.host,
                              e.writer, e.started, e.finished))
            return True
        except sqlite3.IntegrityError:
            return False

    def complete(self, stream, seq, result, status=DONE):
        self._db.execute("UPDATE entries SET status=?, result=?, finished=? WHERE stream=? AND seq=?",
                         (status, result_json(result), time.time(), stream, seq))

    def discard(self, stream, seq):
        self._db.execute("DELETE FROM entries WHERE stream=? AND seq=? AND status=?", (stream, seq, PENDING))

    def get(self, stream, seq):
        row = self._db.execute(f"SELECT {_COLS} FROM entries WHERE stream=? AND seq=?", (stream, seq)).fetchone()
        return _entry(row) if row else None

    def entries(self, stream=None, *, episode=None, sandbox=None, kind=None, since=None, until=None, limit=None):
        q, args = entries_query("entries", "?", stream, episode=episode, sandbox=sandbox, kind=kind, since=since,
                                until=until, limit=limit)
        return [_entry(r) for r in self._db.execute(q, args)]

    def close(self) -> None:
        self._conn.close()


def entries_query(table: str, mark: str, stream: str | None = None, *, episode: str | None = None,
                  sandbox: str | None = None, kind: str | None = None, since: float | None = None,
                  until: float | None = None, limit: int | None = None) -> tuple[str, list[object]]:
    """The SELECT behind `LogStore.entries` for an entries table, with `mark` as the placeholder
    (`?` for SQLite, `%s` for PostgreSQL); values travel as parameters, never in the text."""
    where: list[str] = []
    args: list[object] = []
    for col, val in (("stream", stream), ("episode", episode), ("sandbox", sandbox), ("kind", kind)):
        if val is not None:
            where.append(f"{col}={mark}")
            args.append(val)
    if since is not None:
        where.append(f"started>={mark}")
        args.append(since)
    if until is not None:
        where.append(f"started<{mark}")
        args.append(until)
    q = f"SELECT {_COLS} FROM {table}" + (" WHERE " + " AND ".join(where) if where else "")
    q += " ORDER BY started, stream, seq" if stream is None else " ORDER BY seq"
    if limit is not None:
        q += f" LIMIT {int(limit)}"
    return q, args


def _entry(r) -> Entry:
    return Entry(stream=r[0], seq=r[1], kind=r[2], req_hash=r[3], request=json.loads(r[4]), status=r[5],
                 result=None if r[6] is None else json.loads(r[6]), episode=r[7], sandbox=r[8], host=r[9],
                 writer=r[10], started=r[11], finished=r[12])


def _stream(r) -> StreamInfo:
    return StreamInfo(stream=r[0], episode=r[1], image=r[2], layers=json.loads(r[3]), writer=r[4], created=r[5],
                      meta=json.loads(r[6]), parent=r[7], parent_step=r[8])


class JournaledLogStore(SQLiteLogStore):
    """SQLite as the index, a per-process append-only journal as the write-ahead: the default.

    `append` (or `begin`) and `complete` are one `write(2)` each to this process's journal (O_APPEND),
    which is on the way to disk the moment it returns: a kill -9 right after loses nothing. A
    background thread folds the journal into SQLite every `flush_s` in one transaction, so the hot
    path costs no SQLite commit. Each journal is flock'ed by its process; when a stream is taken over, the
    journals of dead processes are folded first (their PENDING tail becomes UNKNOWN as usual).

    Guarantees are the SQLite store's for a process crash. Differences: another process sees a live
    writer's newest entries up to `flush_s` late, and a seq conflict between two live writers of one
    stream is not refused at write time (leases keep writers exclusive; the owner recorded by
    `open_stream` wins when journals are folded).
    """

    def __init__(self, path: str | os.PathLike, durable: bool = False, flush_s: float = 0.05):
        super().__init__(path, durable)
        self.journal_dir = self.path.with_name(self.path.name + ".journal")
        self.journal_dir.mkdir(parents=True, exist_ok=True)
        self.flush_s = flush_s
        self._lock = threading.Lock()
        # held over a whole flush: a reader's flush must wait for one in progress (the flusher thread's),
        # or it finds the buffer empty and reads SQLite before that transaction commits
        self._flush_lock = threading.Lock()
        self._buf: list[list] = []
        self._fd: int | None = None
        self._pid = -1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._frags: dict[tuple, tuple[str, str, str]] = {}  # the constant parts of a stream's journal lines
        self._names: dict[str, bytes] = {}  # stream name -> its JSON

    # ------------------------------------------------------------------ journal
    def _journal(self) -> int:
        if self._fd is None or self._pid != _pid:
            import atexit
            import fcntl
            import uuid

            p = self.journal_dir / f"{os.getpid()}-{uuid.uuid4().hex[:8]}.jsonl"
            fd = os.open(p, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)  # held while this process lives: the liveness mark
            self._fd, self._pid, self._journal_path = fd, _pid, p
            self._thread = threading.Thread(target=self._flusher, name="trajlog-flush", daemon=True)
            self._thread.start()
            atexit.register(self.close)
        return self._fd

    def _write(self, rec: list, line: bytes | None = None) -> None:
        line = line or (json.dumps(rec, separators=(",", ":")) + "\n").encode()
        with self._lock:
            os.write(self._fd if self._pid == _pid and self._fd is not None else self._journal(), line)
            self._buf.append(rec)
        if self._durable and self._fd is not None:
            os.fsync(self._fd)

    def _flusher(self) -> None:
        while not self._stop.wait(self.flush_s):
            self.flush()

    def flush(self) -> None:
        with self._flush_lock:
            with self._lock:
                recs, self._buf = self._buf, []
            if recs:
                self._apply(recs)

    def _apply(self, recs: list[list]) -> None:
        with self._conn.transaction() as db:
            for r in recs:
                if r[0] in ("P", "Pt"):  # SQLite gets request and result as JSON text (Pt: already text)
                    v = list(r[1])
                    v[4] = v[4] if r[0] == "Pt" else json.dumps(v[4])
                    v[6] = None if v[6] is None else json.dumps(v[6])
                    db.execute(f"INSERT OR IGNORE INTO entries({_COLS}) VALUES(?,?,?,?,?,?,?,?,?,?,?,?,?)", v)
                elif r[0] in ("D", "Dt"):  # Dt: the result is JSON already, text or UTF-8 (in-memory records only)
                    status, result, finished, stream, seq = r[1]
                    if isinstance(result, bytes):  # Dt straight from `complete`: JSON as UTF-8
                        result = result.decode()
                    db.execute("UPDATE entries SET status=?, result=?, finished=? WHERE stream=? AND seq=? "
                               "AND status != ?", (status, result if r[0] == "Dt" else json.dumps(result),
                                                   finished, stream, seq, DONE))
                elif r[0] == "X":
                    db.execute("DELETE FROM entries WHERE stream=? AND seq=? AND status=?", (*r[1], PENDING))

    def recover(self) -> int:
        """Fold the journals of dead processes into SQLite; returns how many were folded."""
        import fcntl

        n = 0
        for p in sorted(self.journal_dir.glob("*.jsonl")):
            if getattr(self, "_journal_path", None) == p:
                continue
            try:
                fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # its process is alive and flushes it itself
                recs = []
                with os.fdopen(os.dup(fd), "rb") as f:
                    for line in f:
                        if not line.endswith(b"\n"):
                            break  # torn last write of a crash: never returned to anyone
                        recs.append(json.loads(line))
                if recs:
                    self._apply(recs)
                p.unlink(missing_ok=True)
                n += 1
            finally:
                os.close(fd)
        return n

    # ------------------------------------------------------------------ LogStore
    def open_stream(self, stream, *, episode, image, layers, writer, meta=None) -> int:
        self.flush()
        self.recover()
        return super().open_stream(stream, episode=episode, image=image, layers=layers, writer=writer, meta=meta)

    def append(self, e: Entry) -> bool:
        req = e.request_json if e.request_json is not None else json.dumps(e.request)
        # built field by field: the request as JSON inside the record, not re-encoded
        line = (f'["P",[{_j(e.stream)},{_j(e.seq)},{_j(e.kind)},{_j(e.req_hash)},{req},{_j(e.status)},'
                f'{_j(e.result)},{_j(e.episode)},{_j(e.sandbox)},{_j(e.host)},{_j(e.writer)},{_j(e.started)},'
                f'{_j(e.finished)}]]\n').encode()
        self._write(["Pt", [e.stream, e.seq, e.kind, e.req_hash, req, e.status, e.result, e.episode, e.sandbox,
                            e.host, e.writer, e.started, e.finished]], line)
        return True

    def begin(self, stream, seq, kind, req_hash, request, request_json, episode, sandbox, host, writer) -> bool:
        # append(), without the Entry: the line from the stream's constant parts (JSON made once) and the rest
        started = time.time()
        req = request_json if request_json is not None else json.dumps(request)
        key = (stream, kind, episode, sandbox, host, writer)
        frag = self._frags.get(key)
        if frag is None:
            if len(self._frags) >= 256:
                self._frags.clear()
            frag = self._frags[key] = (f'["P",[{_j(stream)},', f",{_j(kind)},",
                                       f",{_j(PENDING)},null,{_j(episode)},{_j(sandbox)},{_j(host)},{_j(writer)},")
        line = f"{frag[0]}{int(seq)}{frag[1]}{_j(req_hash)},{req}{frag[2]}{started!r},null]]\n".encode()
        self._write(["Pt", [stream, seq, kind, req_hash, req, PENDING, None, episode, sandbox, host, writer, started,
                            None]], line)
        return True

    def complete(self, stream, seq, result, status=DONE):
        if isinstance(result, ModelResult):  # result.json_bytes(), inline
            body = result.model.__pydantic_serializer__.to_json(result.model)
        else:
            body = json.dumps(result).encode()
        now = time.time()
        # the journal line holds the result as JSON, not as a string of JSON: built by hand, no re-encoding;
        # the in-memory record keeps the bytes, decoded when it is folded into SQLite
        name = self._names.get(stream)
        if name is None:
            if len(self._names) >= 256:
                self._names.clear()
            name = self._names[stream] = _j(stream).encode()
        line = b'["D",[%s,%s,%r,%s,%d]]\n' % (_STATUS_JSON.get(status) or _j(status).encode(), body, now, name, seq)
        self._write(["Dt", [status, body, now, stream, seq]], line)

    def discard(self, stream, seq):
        self._write(["X", [stream, seq]])

    def get(self, stream, seq):
        self.flush()
        return super().get(stream, seq)

    def branch_streams(self, copies, *, episode, step) -> int:
        self.flush()  # the sources' newest entries may still be in this process's journal only
        return super().branch_streams(copies, episode=episode, step=step)

    def entries(self, stream=None, **kw):
        self.flush()
        return super().entries(stream, **kw)

    def close(self) -> None:
        self._stop.set()
        if self._fd is not None and self._pid == _pid:
            self.flush()
            os.close(self._fd)
            self._journal_path.unlink(missing_ok=True)  # everything in it is in SQLite now
            self._fd = None
        super().close()
