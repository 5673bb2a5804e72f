"""What the E2B front knows beyond the Shoal backend: API keys -> tenants, and per sandbox the E2B view
(template, metadata, access token, end time, paused) plus its envd processes and watchers.

The sandboxes themselves live in the backend; this is the front's index of the ones it created,
in memory and, when given a path, written through to SQLite so a restarted front finds them again
(background processes are not kept: they end with the front that started them).
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.errors import InvalidArgument

KEY_PREFIX = "e2b_"
ENVD_VERSION = "0.6.13"  # the envd whose protocol the front speaks; >= 0.6.4 turns on every SDK path


def new_api_key() -> str:
    """E2B's format: `e2b_` + 40 hex digits (the SDK checks `e2b_` + hex client-side)."""
    return KEY_PREFIX + secrets.token_hex(20)


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class Keys:
    """API key -> tenant. Keys are stored hashed (sha256) in a JSON file, mode 0600."""

    def __init__(self, path: Path | None = None, keys: dict[str, str] | None = None):
        self.path = path
        self._given = {_hash(key): tenant for key, tenant in (keys or {}).items()}
        self._by_hash: dict[str, str] = dict(self._given)
        self._seen: tuple[int, int, int] | None = None  # the key file's (inode, size, mtime) when last read
        self._reload()

    def _reload(self) -> None:
        """Re-read the key file when it changed (`shoal e2b key create/revoke` in another process): a
        revoked key stops working at the next request, without a restart. One stat() per lookup."""
        if self.path is None:
            return
        try:
            st = self.path.stat()
        except FileNotFoundError:
            seen = None
        else:
            seen = (st.st_ino, st.st_size, st.st_mtime_ns)
        if seen == self._seen:
            return
        data = json.loads(self.path.read_text()) if seen is not None else {}
        self._by_hash = {**{h: t for h, t in data.get("keys", {}).items()}, **self._given}
        self._seen = seen

    def tenant(self, key: str | None) -> str | None:
        if not key:
            return None
        self._reload()
        return self._by_hash.get(_hash(key))

    def create(self, tenant: str) -> str:
        if not tenant or not tenant.replace("-", "").replace("_", "").isalnum() or len(tenant) > 64:
            raise InvalidArgument(f"tenant names are 1-64 letters, digits, '-' or '_', got {tenant!r}")
        self._reload()  # keep the keys other processes added meanwhile
        key = new_api_key()
        self._by_hash[_hash(key)] = tenant
        self._save()
        return key

    def revoke_tenant(self, tenant: str) -> int:
        self._reload()
        gone = [h for h, t in self._by_hash.items() if t == tenant]
        for h in gone:
            del self._by_hash[h]
            self._given.pop(h, None)
        self._save()
        return len(gone)

    def tenants(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self._by_hash.values():
            out[t] = out.get(t, 0) + 1
        return out

    def _save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"keys": self._by_hash}, f)
        os.replace(tmp, self.path)


@dataclass
class Box:
    """One sandbox as E2B sees it."""

    id: str
    tenant: str
    template: str
    token: str
    metadata: dict[str, str]
    started: float
    end: float
    cpu: int
    memory_mb: int
    disk_mb: int
    home: str = "/"  # where relative paths and commands start: /home/user when the image has it
    has_home: bool = False
    paused: bool = False
    paused_left: float = 0.0  # seconds of lifetime left when paused (the clock stops meanwhile)
    procs: dict[int, Any] = field(default_factory=dict)  # pid -> envd.Proc
    watchers: dict[str, Any] = field(default_factory=dict)  # id -> envd.Watcher
    accounts: dict[str, Any] = field(default_factory=dict)  # envd's cache of the sandbox's passwd/group
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def state(self) -> str:
        return "paused" if self.paused else "running"

    def close_watchers(self) -> None:
        """Free the watches its polling watchers hold (the box is gone from the front)."""
        ws, self.watchers = list(self.watchers.values()), {}
        for w in ws:
            if getattr(w, "handle", None) is not None:
                w.handle.close()

    def expired(self, now: float | None = None) -> bool:
        return not self.paused and (now or time.time()) >= self.end


_PERSISTED = ("id", "tenant", "template", "token", "metadata", "started", "end", "cpu", "memory_mb", "disk_mb",
              "home", "has_home", "paused", "paused_left")


class BoxStore:
    """The index on disk: one row per sandbox, its fields as JSON (SQLite, WAL)."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        # it holds every sandbox's access token: 0600 before SQLite opens it, since SQLite gives the -wal
        # and -shm files the database's mode at their creation (and they hold the same rows)
        for f in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
            if f.exists() or f == path:
                os.close(os.open(f, os.O_RDWR | os.O_CREAT, 0o600))
                os.chmod(f, 0o600)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS boxes (id TEXT PRIMARY KEY, data TEXT NOT NULL)")
        self._lock = threading.Lock()

    def save(self, box: Box) -> None:
        data = {k: getattr(box, k) for k in _PERSISTED}
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO boxes (id, data) VALUES (?, ?)", (box.id, json.dumps(data)))

    def delete(self, sandbox_id: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM boxes WHERE id = ?", (sandbox_id,))

    def load(self) -> list[Box]:
        with self._lock:
            rows = self._db.execute("SELECT data FROM boxes").fetchall()
        return [Box(**json.loads(r[0])) for r in rows]

    # the snapshots the front made (snapshots.py), in a table of their own
    def save_snapshot(self, snap_id: str, data: dict) -> None:
        with self._lock:
            self._db.execute("CREATE TABLE IF NOT EXISTS snapshots (id TEXT PRIMARY KEY, data TEXT NOT NULL)")
            self._db.execute("INSERT OR REPLACE INTO snapshots (id, data) VALUES (?, ?)", (snap_id, json.dumps(data)))

    def delete_snapshot(self, snap_id: str) -> None:
        with self._lock:
            self._db.execute("CREATE TABLE IF NOT EXISTS snapshots (id TEXT PRIMARY KEY, data TEXT NOT NULL)")
            self._db.execute("DELETE FROM snapshots WHERE id = ?", (snap_id,))

    def load_snapshots(self) -> list[dict]:
        with self._lock:
            self._db.execute("CREATE TABLE IF NOT EXISTS snapshots (id TEXT PRIMARY KEY, data TEXT NOT NULL)")
            rows = self._db.execute("SELECT data FROM snapshots").fetchall()
        return [json.loads(r[0]) for r in rows]

    def close(self) -> None:
        self._db.close()


class Boxes:
    """The front's sandboxes by id, under one lock (handlers run on a thread pool)."""

    def __init__(self, store: BoxStore | None = None) -> None:
        self._boxes: dict[str, Box] = {}
        self._lock = threading.Lock()
        self.store = store

    def add(self, box: Box) -> None:
        with self._lock:
            self._boxes[box.id] = box
        self.save(box)

    def save(self, box: Box) -> None:
        """Write a changed box through to the store (pause, resume, a new end time)."""
        if self.store is not None:
            self.store.save(box)

    def get(self, sandbox_id: str) -> Box | None:
        with self._lock:
            box = self._boxes.get(sandbox_id)
            if box is not None and box.expired():
                del self._boxes[sandbox_id]  # the backend's TTL ended it
                box.close_watchers()
                box = None
                gone = True
            else:
                gone = False
        if gone and self.store is not None:
            self.store.delete(sandbox_id)
        return box

    def pop(self, sandbox_id: str) -> Box | None:
        with self._lock:
            box = self._boxes.pop(sandbox_id, None)
        if box is not None:
            box.close_watchers()
        if self.store is not None:
            self.store.delete(sandbox_id)
        return box

    def all(self) -> list[Box]:
        now = time.time()
        with self._lock:
            gone = [s for s, b in self._boxes.items() if b.expired(now)]
            for sid in gone:
                self._boxes.pop(sid).close_watchers()
            out = list(self._boxes.values())
        if self.store is not None:
            for sid in gone:
                self.store.delete(sid)
        return out
