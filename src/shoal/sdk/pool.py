"""Warm pools: sandboxes created ahead of time per image so `acquire()` costs no creation."""
from __future__ import annotations

import os
import queue
import threading

from ..core.errors import PoolExhausted
from .sandbox import Sandbox


class WarmPool:
    """Keeps `size` ready sandboxes of one image; a background thread refills after each acquire.

    Pooled sandboxes are created without TTLs; `acquire(ttl=..., idle_ttl=...)` sets them at hand-out
    time so the clock starts when the user gets the sandbox, not when the pool made it."""

    def __init__(self, image: str | None = None, size: int = 4, *, layers: list[str] | None = None,
                 root: str | os.PathLike | None = None, **create_kw):
        if size <= 0:
            from ..core.errors import InvalidArgument

            raise InvalidArgument(f"pool size must be > 0, got {size}")
        self.size = size
        self._kw = dict(image=image, layers=layers, root=root, **create_kw)
        self._ready: queue.Queue[Sandbox] = queue.Queue()
        self._want = threading.Event()
        self._stop = threading.Event()
        self.errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._fill, name="shoal-warm-pool", daemon=True)
        self._thread.start()
        self._want.set()

    def _fill(self) -> None:
        while not self._stop.is_set():
            self._want.wait(0.5)
            self._want.clear()
            while not self._stop.is_set() and self._ready.qsize() < self.size:
                try:
                    self._ready.put(Sandbox.create(**self._kw))
                except BaseException as e:  # surfaced through acquire() and .errors
                    self.errors.append(e)
                    self._stop.wait(0.5)
                    break

    def wait_ready(self, timeout: float = 60.0) -> None:
        import time

        deadline = time.monotonic() + timeout
        while self._ready.qsize() < self.size:
            if self.errors:
                raise self.errors[-1]
            if time.monotonic() > deadline:
                raise PoolExhausted(f"warm pool reached {self._ready.qsize()}/{self.size} within {timeout} s")
            time.sleep(0.01)

    def acquire(self, timeout: float = 30.0, ttl: float | None = None, idle_ttl: float | None = None) -> Sandbox:
        try:
            sb = self._ready.get_nowait()
        except queue.Empty:
            try:
                sb = self._ready.get(timeout=timeout)
            except queue.Empty:
                err = f": last error {self.errors[-1]}" if self.errors else ""
                raise PoolExhausted(f"no warm sandbox within {timeout} s{err}") from None
        self._want.set()
        if ttl or idle_ttl:
            sb.set_timeout(ttl, idle_ttl)
        return sb

    def close(self) -> None:
        self._stop.set()
        self._want.set()
        self._thread.join(timeout=30)
        while True:
            try:
                sb = self._ready.get_nowait()
            except queue.Empty:
                break
            try:
                sb.kill()
            except Exception:
                pass

    def __enter__(self) -> WarmPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
