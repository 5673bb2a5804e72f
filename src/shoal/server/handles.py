"""Live per-sandbox objects the daemon keeps between requests: background commands and sessions.

Each one holds host file descriptors (a control socket, pipes) and memory (output ring buffers),
so an untrusted client that opens them in a loop must hit a cap, not exhaust the daemon. The table
caps how many one sandbox may hold, makes room by forgetting finished commands (oldest first), and
closes whatever it drops.
"""
from __future__ import annotations

import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ..core import errors as E


class HandleTable:
    def __init__(self, prefix: str, what: str, cap: int, finished: Callable[[Any], bool] = lambda _: False):
        self.prefix, self.what, self.cap = prefix, what, cap
        self._finished = finished
        self._by_sandbox: dict[str, OrderedDict[str, Any]] = {}
        self._lock = threading.Lock()

    def add(self, sandbox_id: str, obj: Any) -> str:
        """Keep `obj` under a fresh id; raises QuotaExceeded (and closes obj) if the sandbox is full."""
        evicted = []
        with self._lock:
            mine = self._by_sandbox.setdefault(sandbox_id, OrderedDict())
            for key in list(mine):
                if len(mine) < self.cap:
                    break
                if self._finished(mine[key]):
                    evicted.append(mine.pop(key))
            full = len(mine) >= self.cap
            if not full:
                key = f"{self.prefix}-{secrets.token_hex(6)}"
                mine[key] = obj
        for old in evicted:
            _close(old)
        if full:
            _close(obj)
            raise E.QuotaExceeded(f"sandbox {sandbox_id} already holds {self.cap} live {self.what}s "
                                  f"(the per-sandbox cap); close or kill some first")
        return key

    def get(self, sandbox_id: str, key: str) -> Any:
        with self._lock:
            mine = self._by_sandbox.get(sandbox_id)
            obj = mine.get(key) if mine is not None else None
        if obj is None:
            raise E.SandboxNotFound(f"{self.what} {key} not found in sandbox {sandbox_id}")
        return obj

    def pop(self, sandbox_id: str, key: str) -> None:
        with self._lock:
            mine = self._by_sandbox.get(sandbox_id)
            obj = mine.pop(key, None) if mine is not None else None
        if obj is not None:
            _close(obj)

    def drop_sandbox(self, sandbox_id: str) -> None:
        """The sandbox is gone: close everything it held."""
        with self._lock:
            objs = list(self._by_sandbox.pop(sandbox_id, {}).values())
        for obj in objs:
            _close(obj)

    def prune(self, live: set[str]) -> None:
        """Drop entries of sandboxes that ended on their own (TTL, OOM, crash)."""
        with self._lock:
            gone = [sid for sid in self._by_sandbox if sid not in live]
        for sid in gone:
            self.drop_sandbox(sid)

    def count(self) -> int:
        with self._lock:
            return sum(len(m) for m in self._by_sandbox.values())


def _close(obj: Any) -> None:
    try:
        obj.close()
    except Exception:  # closing is best effort: the sandbox may already be gone
        pass
