"""SQLite connections for state shared by threads and processes (queue, trajectory log)."""
from __future__ import annotations

import os
import sqlite3
import threading
from pathlib import Path


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
