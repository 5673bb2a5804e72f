"""Admission control: the daemon refuses work beyond capacity with a retryable error, instead of
queueing until clients time out (the failure E2B/Modal users hit at >= 128 concurrent creates)."""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

from ..core.errors import QuotaExceeded


@dataclass
class AdmissionConfig:
    max_sandboxes: int = 1024
    max_starting: int = 32  # sandboxes being created at the same time
    creates_per_s: float = 200.0  # token-bucket refill rate
    create_burst: int = 400
    memory_mb: int = 0  # sum of memory limits of live sandboxes; 0 = 4x physical memory (overcommit)
    starting_wait_s: float = 2.0  # how long a create may wait for a STARTING slot before refusal
    commands_per_sandbox: int = 64  # background commands tracked per sandbox (finished ones make room)
    sessions_per_sandbox: int = 16


class Admission:
    def __init__(self, cfg: AdmissionConfig | None = None):
        self.cfg = cfg or AdmissionConfig()
        if not self.cfg.memory_mb:
            with open("/proc/meminfo") as f:
                total_kb = int(f.readline().split()[1])
            self.cfg.memory_mb = 4 * total_kb // 1024
        self._starting = threading.BoundedSemaphore(self.cfg.max_starting)
        self._lock = threading.Lock()
        self._tokens = float(self.cfg.create_burst)
        self._stamp = time.monotonic()
        self.refusals = 0

    def _refuse(self, msg: str) -> QuotaExceeded:
        self.refusals += 1
        return QuotaExceeded(msg)

    def _take_token(self) -> None:
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.cfg.create_burst, self._tokens + (now - self._stamp) * self.cfg.creates_per_s)
            self._stamp = now
            if self._tokens < 1:
                raise self._refuse(f"creation rate limit ({self.cfg.creates_per_s:g}/s) reached; retry shortly")
            self._tokens -= 1

    @contextmanager
    def creating(self, live: int, live_memory_mb: int, memory_mb: int):
        """Hold a STARTING slot while one sandbox is created; refuse when the host is full."""
        if live >= self.cfg.max_sandboxes:
            raise self._refuse(f"host is at its sandbox limit ({self.cfg.max_sandboxes}); retry later")
        if live_memory_mb + memory_mb > self.cfg.memory_mb:
            raise self._refuse(f"host memory commitment would exceed {self.cfg.memory_mb} MiB; retry later")
        self._take_token()
        if not self._starting.acquire(timeout=self.cfg.starting_wait_s):
            raise self._refuse(f"{self.cfg.max_starting} sandboxes are already starting; retry shortly")
        try:
            yield
        finally:
            self._starting.release()

    @property
    def starting(self) -> int:
        return self.cfg.max_starting - self._starting._value
