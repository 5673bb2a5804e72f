"""The trajectory log: every operation persisted with its result before the result is returned, and
fast-forward for a client that restarts and replays its episode.

A `Stream` is a cursor over one stream's entries. Each `call(kind, request, execute)`:

- at the head of the log: writes the entry PENDING, runs `execute()`, writes the result (DONE) and
  only then returns it;
- behind the head (a restarted client replaying): the request's hash must equal the logged one. If
  it does, the logged result is returned and nothing runs (fast-forward). If it does not, the two
  histories differ: `TrajectoryDivergence`, and the stream stops serving;
- on an entry whose writer died mid-operation, or whose sandbox was lost with its host while the
  operation was in flight (UNKNOWN): `UnknownOutcome`. The caller decides what
  the outcome was (`settle`), e.g. tells the agent that the command was interrupted; it is never
  re-run blindly.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

from ..core.errors import HostUnavailable, SandboxLost, TrajectoryDivergence, UnknownOutcome
from ..core.sqlite import is_postgres_url
from .store import DONE, PENDING, UNKNOWN, Entry, JournaledLogStore, LogStore, StreamInfo


def canonical(kind: str, request: dict) -> tuple[str, str]:
    """(canonical JSON of the request, sha256 of kind + it): key order and whitespace do not matter."""
    blob = json.dumps(request, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return blob, hashlib.sha256(f"{kind}\n{blob}".encode("utf-8", "surrogatepass")).hexdigest()


def request_hash(kind: str, request: dict) -> str:
    return canonical(kind, request)[1]


def _head_or_entry(stream: Stream) -> Entry | None:
    # past the entries that existed when this writer took the stream over, only it writes: no lookup
    if stream.cursor >= stream.size:
        return None
    return stream.log.store.get(stream.name, stream.cursor)


class Outcome:
    """What `Stream.call` returns: the result plus where it came from."""

    __slots__ = ("result", "seq", "replayed", "unknown")

    def __init__(self, result: dict, seq: int, replayed: bool, unknown: bool = False):
        self.result, self.seq, self.replayed, self.unknown = result, seq, replayed, unknown


class Stream:
    def __init__(self, log: TrajectoryLog, name: str, *, episode: str | None, sandbox: str | None,
                 writer: str, size: int):
        self.log, self.name, self.episode, self.sandbox, self.writer = log, name, episode, sandbox, writer
        self.cursor = 0
        self.size = size  # entries in the log when this writer took the stream over
        self.replayed = 0  # how many calls were served from the log
        self.executed = 0
        self.diverged = False

    @property
    def replaying(self) -> bool:
        return self.cursor < self.size

    def _lookup(self, kind: str, request: dict) -> tuple[Outcome | None, tuple[str, str]]:
        """The logged outcome at the cursor (fast-forward), or None when the cursor is at the head."""
        if self.diverged:
            raise TrajectoryDivergence(f"stream {self.name} diverged at seq {self.cursor}; start a new stream",
                                       self.name, self.cursor)
        blob_h = canonical(kind, request)
        h = blob_h[1]
        seq = self.cursor
        entry = _head_or_entry(self)
        if entry is None:
            return None, blob_h
        if entry.req_hash != h or entry.kind != kind:
            self.diverged = True
            raise TrajectoryDivergence(
                f"stream {self.name} seq {seq}: the log holds {entry.kind} {_brief(entry.request)} but the "
                f"replayed request is {kind} {_brief(request)}; replay stopped", self.name, seq)
        if entry.status == DONE or (entry.status == UNKNOWN and entry.result is not None):
            self.cursor += 1
            self.replayed += 1
            return Outcome(entry.result or {}, seq, True, unknown=entry.status == UNKNOWN), blob_h
        raise UnknownOutcome(f"stream {self.name} seq {seq}: {kind} {_brief(request)} was in flight when "
                             f"its writer ({entry.writer}) died; its outcome is unknown", self.name, seq, request)

    def _begin(self, kind: str, request: dict, blob_h: tuple[str, str]) -> int:
        seq = self.cursor
        e = Entry(stream=self.name, seq=seq, kind=kind, req_hash=blob_h[1], request=request, episode=self.episode,
                  sandbox=self.sandbox, host=self.log.host, writer=self.writer, request_json=blob_h[0])
        if not self.log.store.append(e):
            raise TrajectoryDivergence(f"stream {self.name} seq {seq} was written by another writer meanwhile",
                                       self.name, seq)
        return seq

    def _end(self, seq: int, result: dict) -> Outcome:
        self.log.store.complete(self.name, seq, result)
        self.cursor += 1
        self.executed += 1
        return Outcome(result, seq, False)

    def _failed(self, seq: int, exc: Exception) -> None:
        # the failure is the outcome: logged, and raised again the same way on replay
        self._end(seq, {"__error__": {"type": type(exc).__name__, "message": str(exc)}})

    def call(self, kind: str, request: dict, execute: Callable[[], dict]) -> Outcome:
        done, h = self._lookup(kind, request)
        if done is not None:
            return done
        seq = self._begin(kind, request, h)
        try:
            result = execute()
        except (SandboxLost, HostUnavailable):
            # the sandbox's host died or stopped answering: nobody knows whether the operation ran. The
            # entry stays PENDING (UNKNOWN to the writer that resumes the episode), never a logged result
            raise
        except Exception as exc:
            self._failed(seq, exc)
            raise
        return self._end(seq, result)

    async def acall(self, kind: str, request: dict, execute: Callable[[], Awaitable[dict]],
                    idempotent: bool = False) -> Outcome:
        """`call` for an async operation (an LLM request). `idempotent=True`: a failure leaves no entry
        behind (nothing happened that a replay must reproduce), so the next attempt runs it again."""
        done, h = self._lookup(kind, request)
        if done is not None:
            return done
        seq = self._begin(kind, request, h)
        try:
            result = await execute()
        except BaseException as exc:
            if idempotent:
                self.log.store.discard(self.name, seq)
            elif isinstance(exc, Exception):
                self._failed(seq, exc)
            raise
        return self._end(seq, result)

    def settle(self, result: dict) -> Outcome:
        """Record what the caller decided an UNKNOWN entry at the cursor amounts to, and move on."""
        entry = self.log.store.get(self.name, self.cursor)
        if entry is None or entry.status != UNKNOWN:
            raise ValueError(f"stream {self.name} seq {self.cursor} is not an unsettled UNKNOWN entry")
        self.log.store.complete(self.name, self.cursor, result, status=UNKNOWN)
        self.cursor += 1
        return Outcome(result, self.cursor - 1, True, unknown=True)

    def set_sandbox(self, sandbox_id: str) -> None:
        self.sandbox = sandbox_id


def open_log_store(where: str | os.PathLike) -> LogStore:
    """A `postgresql://` URL: the PostgreSQL store (many hosts); else the journaled SQLite file."""
    if is_postgres_url(where):
        from .store_pg import PgLogStore

        return PgLogStore(str(where))
    return JournaledLogStore(Path(where))


class TrajectoryLog:
    """Opens streams over a `LogStore`; answers provenance queries."""

    def __init__(self, store: LogStore | str | os.PathLike, host: str | None = None):
        self.store = store if isinstance(store, LogStore) else open_log_store(store)
        self.host = host or socket.gethostname()

    def stream(self, name: str, *, episode: str | None = None, sandbox: str | None = None,
               image: str | None = None, layers: list[str] | None = None, writer: str | None = None,
               meta: dict | None = None) -> Stream:
        writer = writer or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        size = self.store.open_stream(name, episode=episode, image=image, layers=list(layers or []), writer=writer,
                                      meta=meta)
        return Stream(self, name, episode=episode, sandbox=sandbox, writer=writer, size=size)

    # ---------------------------------------------------------------- provenance
    def history(self, stream: str) -> list[Entry]:
        return self.store.entries(stream)

    def info(self, stream: str) -> StreamInfo | None:
        return self.store.stream_info(stream)

    def query(self, *, episode: str | None = None, sandbox: str | None = None, kind: str | None = None,
              since: float | None = None, until: float | None = None, limit: int | None = None) -> list[Entry]:
        """What ran where, when, by which episode: entries filtered by any of these, in time order."""
        return self.store.entries(episode=episode, sandbox=sandbox, kind=kind, since=since, until=until, limit=limit)

    def unknown(self, stream: str | None = None) -> list[Entry]:
        return [e for e in self.store.entries(stream) if e.status in (UNKNOWN, PENDING)]


def _brief(request: dict, n: int = 120) -> str:
    s = json.dumps(request, sort_keys=True, ensure_ascii=False)
    return s if len(s) <= n else s[: n - 3] + "..."
