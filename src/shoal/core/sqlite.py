"""SQLite connections for state shared by threads and processes (queue, trajectory log)."""
from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path


def is_postgres_url(where: str | os.PathLike) -> bool:
    """Whether a state location (queue, log) names a PostgreSQL database rather than an SQLite file."""
    return isinstance(where, str) and where.startswith(("postgresql://", "postgres://"))


class PerThreadDB:
    """One WAL connection per thread (and per process after a fork): sqlite3 connections must not be
    shared across threads mid-transaction, and never across a fork."""

    def __init__(self, path: str | os.PathLike, synchronous: str = "NORMAL"):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.synchronous = synchronous
        self._local = threading.local()

    def get(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None or getattr(self._local, "pid", None) != os.getpid():
            db = sqlite3.connect(self.path, timeout=60, isolation_level=None, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute(f"PRAGMA synchronous={self.synchronous}")
            self._local.db, self._local.pid = db, os.getpid()
        return db

    def close(self) -> None:
        db = getattr(self._local, "db", None)
        if db is not None:
            db.close()
            self._local.db = None

    def transaction(self, immediate: bool = True) -> contextlib.AbstractContextManager[sqlite3.Connection]:
        """`transaction(self.get())`: this thread's connection inside BEGIN IMMEDIATE ... COMMIT."""
        return transaction(self.get(), immediate)


@contextlib.contextmanager
def transaction(db: sqlite3.Connection, immediate: bool = True) -> Iterator[sqlite3.Connection]:
    """BEGIN (IMMEDIATE: take the write lock now, so two writers cannot both read-then-write) ...
    COMMIT, or ROLLBACK on any exception. For connections opened with isolation_level=None."""
    db.execute("BEGIN IMMEDIATE" if immediate else "BEGIN")
    try:
        yield db
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")
