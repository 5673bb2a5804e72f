"""Admission for rollouts: at most N episodes at once per worker, and a host-wide creation rate.

The rate limiter is a leaky bucket kept in a lock file, so every worker process on a host shares
it (the way Prime Intellect's verifiers caps sandbox creation per host): each start reserves the
next free slot `1/rate` seconds after the previous one and sleeps until it comes.
"""
from __future__ import annotations

import asyncio
import fcntl
import os
import struct
import time
from pathlib import Path


class HostRateLimiter:
    def __init__(self, path: str | os.PathLike, rate_per_s: float):
        if rate_per_s <= 0:
            raise ValueError(f"creation rate must be > 0 per second, got {rate_per_s}")
        self.path, self.interval = Path(path), 1.0 / rate_per_s
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def reserve(self) -> float:
        """Reserve the next slot; returns how long to wait for it (seconds)."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            raw = os.pread(fd, 8, 0)
            nxt = struct.unpack("d", raw)[0] if len(raw) == 8 else 0.0
            now = time.time()
            slot = max(now, nxt)
            os.pwrite(fd, struct.pack("d", slot + self.interval), 0)
            return slot - now
        finally:
            os.close(fd)

    async def acquire(self) -> None:
        wait = self.reserve()
        if wait > 0:
            await asyncio.sleep(wait)
