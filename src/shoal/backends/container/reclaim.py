"""Per-sandbox memory reclaim: push a sandbox's cold anonymous memory out to swap (zram).

cgroup v2 has a knob for exactly this (`memory.reclaim`: "reclaim this many bytes from this group").
cgroup v1 has none, so there the group's limit is lowered in steps towards the goal, which makes the
kernel reclaim from that group alone, and then put back: the pages stay out until touched. On both,
the sandbox is frozen meanwhile, so a running one cannot hit the lowered limit with a fresh
allocation (OOM) and the before/after figures are not moved by its own activity.

Swap is what makes anonymous memory reclaimable at all: without an active swap area the call fails
with BackendUnavailable instead of silently reclaiming only page cache. A sandbox's swap allowance
under its own memory pressure stays what it was (`cgroups.CgroupDriver.allow_swap`); on v2 the
reclaim lifts `memory.swap.max` for its duration only.
"""
from __future__ import annotations

import errno
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ...core.contract import ReclaimRequest, ReclaimResult
from ...core.errors import BackendUnavailable, SandboxError
from .cgroups import CgroupDriver

ROUNDS = 12  # lowering steps (v1) / memory.reclaim calls (v2) before settling for what was reached
STEP = 0.6  # v1: each step asks for at most this fraction of the distance still to go, then more
MIN_BYTES = 1 << 20  # v1: the smallest step a lowering asks for
# never aim a group below this: its page tables and kernel memory stay (a python sandbox keeps about
# 0.3 MiB of them); 1 MiB here left half a MiB of anonymous memory in RAM that reclaim could take
MIN_GOAL = 256 << 10


@dataclass(frozen=True)
class MemoryUse:
    """One sandbox cgroup's memory, from memory.stat (anon + shmem: what only swap can take)."""

    charged: int  # bytes the group is charged (v1 usage_in_bytes, v2 memory.current)
    anon: int  # process memory + shmem (the tmpfs upper's pages)
    file: int  # page cache (shared layer files count once, to whichever group read them first)
    swap: int  # bytes in swap


def _read_int(p: Path) -> int:
    return int(p.read_text().split()[0])


def memory_use(cg: CgroupDriver, sandbox_id: str) -> MemoryUse:
    d = cg.memory_dir(sandbox_id)
    stat: dict[str, int] = {}
    for line in (d / "memory.stat").read_text().splitlines():  # reading it flushes the per-cpu stats
        k, _, v = line.partition(" ")
        stat[k] = int(v)
    if cg.version == 2:
        swap = _read_int(d / "memory.swap.current") if (d / "memory.swap.current").exists() else 0
        return MemoryUse(charged=_read_int(d / "memory.current"), anon=stat.get("anon", 0) + stat.get("shmem", 0),
                         file=stat.get("file", 0) - stat.get("shmem", 0), swap=swap)
    # v1: total_* include descendants (a sandbox has none); shmem is counted in cache, not in rss
    shmem = stat.get("total_shmem", 0)
    return MemoryUse(charged=_read_int(d / "memory.usage_in_bytes"), anon=stat.get("total_rss", 0) + shmem,
                     file=stat.get("total_cache", 0) - shmem, swap=stat.get("total_swap", 0))


def swap_active() -> bool:
    with open("/proc/swaps") as f:
        return len(f.read().splitlines()) > 1


def _write(p: Path, value: str) -> None:
    with open(p, "w") as f:
        f.write(value)


def _reclaim_v1(d: Path, use: Callable[[], MemoryUse], anon_goal: int, limit: int) -> None:
    """Lower memory.limit_in_bytes in steps until the group's anonymous memory is at `anon_goal`, then
    put `limit` back. The steps follow anon, not the charge: the kernel drops page cache first, so
    a goal on the charge alone is met with cache gone and the heaps still in RAM."""
    try:
        for _ in range(ROUNDS):
            u = use()
            if u.anon <= anon_goal:
                break
            step = max(MIN_GOAL, u.charged - max(MIN_BYTES, int((u.anon - anon_goal) * STEP)))
            try:
                _write(d / "memory.limit_in_bytes", str(step))
            except OSError as e:
                if e.errno != errno.EBUSY:  # EBUSY: the kernel could not get below it (nothing swappable left)
                    raise
                break
    finally:
        _write(d / "memory.limit_in_bytes", str(limit))


def _reclaim_v2(d: Path, use: Callable[[], MemoryUse], anon_goal: int, swap_max: str, limit: int) -> None:
    """memory.reclaim in rounds until the group's anonymous memory is at `anon_goal`, swap.max lifted
    to the memory limit meanwhile: not to "max", since what goes out stays out and a tenant could
    reclaim, refill and reclaim again, filling the host's swap (v1 needs no such cap: its memsw limit
    bounds memory + swap together)."""
    has_swap = (d / "memory.swap.max").exists()
    if has_swap:
        _write(d / "memory.swap.max", str(max(limit, int(swap_max))))
    try:
        for _ in range(ROUNDS):
            u = use()
            if u.anon <= anon_goal:
                break
            try:
                _write(d / "memory.reclaim", str(max(MIN_BYTES, u.anon - anon_goal)))
            except OSError as e:
                if e.errno != errno.EAGAIN:  # EAGAIN: less than asked was reclaimable this round
                    raise
    finally:
        if has_swap:  # back to the sandbox's allowance; what is out stays out until touched
            _write(d / "memory.swap.max", swap_max)


def reclaim(cg: CgroupDriver, sandbox_id: str, req: ReclaimRequest, limit_bytes: int, swap_max: int) -> ReclaimResult:
    """Push req.target of the sandbox's anonymous memory to swap. The caller holds the sandbox
    (alive, not being reclaimed by anyone else) and freezes it around this call."""
    if not swap_active():
        raise BackendUnavailable("no swap area is active on this host, so anonymous memory cannot be reclaimed: "
                                 "enable Shoal's zram device (zram_mb in the config's density table)")
    d = cg.memory_dir(sandbox_id)
    t0 = time.monotonic()
    try:
        before = memory_use(cg, sandbox_id)
        anon_goal = before.anon - int(req.target * before.anon)

        def use() -> MemoryUse:
            return memory_use(cg, sandbox_id)

        if cg.version == 2:
            _reclaim_v2(d, use, anon_goal, str(swap_max), limit_bytes)
        else:
            _reclaim_v1(d, use, anon_goal, limit_bytes)
        after = memory_use(cg, sandbox_id)
    except FileNotFoundError:
        raise SandboxError(f"sandbox {sandbox_id}: its memory cgroup went away while reclaiming") from None
    return ReclaimResult(sandbox_id=sandbox_id, target=req.target, memory_before=before.charged,
                         memory_after=after.charged, anon_before=before.anon, anon_after=after.anon,
                         swapped=after.swap, duration_s=time.monotonic() - t0, paused=False)
