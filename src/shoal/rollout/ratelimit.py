"""Admission for rollouts: at most N episodes at once per worker, and a host-wide creation rate.

The rate limiter is a leaky bucket kept in a lock file, so every worker process on a host that
starts sandboxes on the same backend shares it (the way Prime Intellect's verifiers caps sandbox
creation per host): each start reserves the next free slot `1/rate` seconds after the previous one
and sleeps until it comes. shoald's own admission and tenant quotas still apply behind it.
"""
from __future__ import annotations

import asyncio
import fcntl
import hashlib
import os
import struct
import tempfile
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


def bucket_path(address: str) -> Path:
    """This user's bucket for sandboxes started on `address` (a backend's address): in a private
    directory of the runtime dir, so another user cannot plant or read it."""
    base = Path(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()) / f"shoal-{os.getuid()}"
    base.mkdir(mode=0o700, exist_ok=True)
    st = base.lstat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077 or not base.is_dir() or base.is_symlink():
        raise PermissionError(f"{base} must be a directory owned by uid {os.getuid()} with mode 0700")
    return base / f"rollout-create-{hashlib.sha256(address.encode()).hexdigest()[:16]}.bucket"
