"""Per-sandbox cgroups on v1 (per-controller hierarchies) and v2 (unified) hosts.

Detected once at start: v2 when /sys/fs/cgroup is a cgroup2 mount with the memory controller,
otherwise v1 with memory, pids, cpu and freezer mounted as separate (or co-mounted) hierarchies.
Each sandbox gets `shoal-<root tag>/<id>` in every hierarchy; the supervisor removes them when it ends.
A sandbox with memory_cgroup="pooled" shares a memory cgroup `shoal-<root tag>/mempool-<hex>` with the
other members of its pool (mempools.py): on v1 it has no directory of its own in the memory hierarchy;
on v2 its cgroup is `shoal-<root tag>/mempool-<hex>/<id>`, below the pool, without the memory controller.
"""
from __future__ import annotations

import atexit
import errno
import hashlib
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from ...core.contract import Limits
from ...core.errors import BackendUnavailable, InvalidArgument, SandboxError
from .mempools import PREFIX as MEMPOOL_PREFIX
from .mempools import MemoryPools
from .parents import record_owner, sweep_orphans
from .quotapool import PREFIX as POOL_PREFIX
from .quotapool import QuotaPool

CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_parent(root: Path) -> str:
    """One cgroup parent per Shoal root: sweeping one root's orphans must never touch the sandboxes
    of another root on the same host (tests, benchmarks, a second daemon)."""
    return "shoal-" + hashlib.sha256(str(Path(root).resolve()).encode()).hexdigest()[:10]
CFS_PERIOD_US = 100_000  # the kernel's default period: a new cgroup has it without a write


def cpu_quota_us(cpu: float) -> int | None:
    """The CFS quota for `cpu` cores, or None where a quota would cap nothing (cpu >= the cores this
    process may run on): every quota write walks all the host's task groups (tg_set_cfs_bandwidth),
    O(live sandboxes), so a quota that cannot bind is not written. `cpu` is a cap, never a share."""
    try:
        cores = len(os.sched_getaffinity(0))
    except OSError:
        cores = os.cpu_count() or 1
    if cpu >= cores:
        return None
    return max(1000, int(cpu * CFS_PERIOD_US))


def cpu_weight(cpu: float, version: int) -> int | None:
    """The CFS weight for `cpu` cores when `cpu` is a weight, not a cap ([density] cpu_quota = false):
    v1 cpu.shares 1024 per core, v2 cpu.weight 100 per core, in the kernel's ranges; None for one core
    (the kernel's default already: no write). Unlike a quota, a weight write walks no other group."""
    if cpu == 1.0:
        return None
    if version == 2:
        return min(10_000, max(1, round(cpu * 100)))
    return min(262_144, max(2, round(cpu * 1024)))


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


@dataclass
class CgroupDriver:
    version: int
    mounts: dict[str, Path]  # controller -> hierarchy root (v2: all the same path)
    parent: str = "shoal"
    # v1: cpu cgroups with the quota written ahead, off the create path (quotapool.py)
    quota_pool: QuotaPool | None = field(default=None, repr=False)
    # shared memory cgroups of memory_cgroup="pooled" sandboxes (configure_pools)
    pools: MemoryPools | None = field(default=None, repr=False)
    # [density] cpu_quota: a sandbox's `cpu` is a cap (a CFS quota of its own); False: a weight only
    # (cpu_weight), because every quota write walks all the host's task groups: O(live sandboxes)
    cpu_quota: bool = True

    @classmethod
    def detect(cls, parent: str = "shoal") -> CgroupDriver:
        controllers = CGROUP_ROOT / "cgroup.controllers"
        if controllers.exists():  # /sys/fs/cgroup is the unified (v2) hierarchy itself
            have = set(controllers.read_text().split())
            missing = {"memory", "pids", "cpu"} - have
            if missing:
                # e.g. a container whose cgroup was not delegated these controllers
                raise BackendUnavailable(f"cgroup v2 at {CGROUP_ROOT} lacks controllers: {', '.join(sorted(missing))}"
                                         f" (cgroup.controllers has: {' '.join(sorted(have)) or 'none'})")
            return cls(2, {c: CGROUP_ROOT for c in ("memory", "pids", "cpu", "freezer")}, parent)
        mounts: dict[str, Path] = {}
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fstype, _, opts = right.split(" ", 2)
                if fstype != "cgroup":
                    continue
                opt_set = set(opts.strip().split(","))
                for c in ("memory", "pids", "cpu", "freezer"):
                    if c in opt_set:
                        mounts[c] = Path(left.split(" ")[4])
        missing = {"memory", "pids", "cpu", "freezer"} - set(mounts)
        if missing:
            raise BackendUnavailable(f"cgroup controllers not available on this host: {', '.join(sorted(missing))}")
        return cls(1, mounts, parent)

    def configure_pools(self, state: Path, sandboxes_dir: Path, size: int, swap: float = 0.0) -> None:
        """Enable memory_cgroup="pooled": pools of up to `size` sandboxes, registered under `state`."""
        self.pools = MemoryPools(state, sandboxes_dir, size, self.version, self.mounts["memory"] / self.parent, swap)

    # ------------------------------------------------------------------ paths
    def pool_of(self, sandbox_id: str) -> str | None:
        """The sandbox's memory pool, or None when it has a memory cgroup of its own."""
        return self.pools.pool_of(sandbox_id) if self.pools else None

    def dirs(self, sandbox_id: str) -> list[Path]:
        """The sandbox's own cgroup directories (what its supervisor joins, then removes)."""
        pool = self.pool_of(sandbox_id)
        if pool is None:
            return list(dict.fromkeys(m / self.parent / sandbox_id for m in self.mounts.values()))
        if self.version == 2:
            return [self.mounts["pids"] / self.parent / pool / sandbox_id]
        mem = self.mounts["memory"]
        return list(dict.fromkeys(m / self.parent / sandbox_id for m in self.mounts.values() if m != mem))

    def _dir(self, controller: str, sandbox_id: str) -> Path:
        if self.version == 2 or controller == "memory":
            pool = self.pool_of(sandbox_id)
            if pool is not None:
                # v2: the sandbox's cgroup sits below its pool; v1 memory: the pool itself
                return self.mounts[controller] / self.parent / pool / (sandbox_id if self.version == 2 else "")
        return self.mounts[controller] / self.parent / sandbox_id

    def _pooled_memory_dir(self, sandbox_id: str) -> Path | None:
        pool = self.pool_of(sandbox_id)
        return self.mounts["memory"] / self.parent / pool if pool is not None else None

    def _memory_watch_dir(self, sandbox_id: str) -> Path:
        """The memory cgroup whose OOM counters and limit apply to the sandbox: its own, or its pool's."""
        return self._pooled_memory_dir(sandbox_id) or self._dir("memory", sandbox_id)

    def helper_args(self, sandbox_id: str) -> list[str]:
        """shoal-init's cgroup arguments for the sandbox (after create())."""
        args: list[str] = []
        for d in self.dirs(sandbox_id):
            args += ["--cgroup", str(d)]
        pool_dir = self._pooled_memory_dir(sandbox_id)
        if pool_dir is None:
            return args + ["--memory-cgroup", str(self._dir("memory", sandbox_id))]
        if self.version == 1:  # joined, never removed by the supervisor: the pool outlives its members
            args += ["--join-cgroup", str(pool_dir)]
        return args + ["--memory-cgroup", str(pool_dir), "--memory-pooled", "1"]

    # ------------------------------------------------------------------ lifecycle
    def prepare_parent(self, owner: Path | None = None) -> None:
        """Make this root's parent cgroup (and, v1, its quota pool). `owner`: the root it belongs to,
        recorded so that a later start removes it once the root is gone; that start is this one for
        the parents of other roots already gone (parents.py)."""
        if owner is not None:
            try:
                sweep_orphans(set(self.mounts.values()), keep=self.parent)
                record_owner(self.parent, owner)
            except OSError as e:  # a read-only /run: the parent is left for the boot, as before
                logging.getLogger(__name__).warning("cannot record cgroup parent %s for %s: %s",
                                                    self.parent, owner, e)
        if self.version == 2:
            root = CGROUP_ROOT
            parent = root / self.parent
            parent.mkdir(exist_ok=True)
            for d in (root, parent):
                have = set((d / "cgroup.subtree_control").read_text().split())
                want = {"memory", "pids", "cpu"} - have
                if want:
                    try:
                        _write(d / "cgroup.subtree_control", " ".join(f"+{c}" for c in sorted(want)))
                    except OSError as e:
                        # EBUSY: v2's "no internal processes" rule; /sys/fs/cgroup is then not the host's
                        # root but a (container's) cgroup that holds processes itself
                        hint = (" (it holds processes: v2 enables controllers only for cgroups without "
                                "them; run shoal on the host or in a cgroup with delegated children)"
                                if e.errno == errno.EBUSY else "")
                        raise BackendUnavailable(f"cannot enable {' '.join(sorted(want))} in "
                                                 f"{d / 'cgroup.subtree_control'}: {e.strerror}{hint}") from e
        else:
            for m in set(self.mounts.values()):
                (m / self.parent).mkdir(exist_ok=True)
            cpu_parent = self.mounts["cpu"] / self.parent
            # every root's parent, not only this one's: a process killed before its atexit (a daemon
            # stopped by a signal) leaves its pool behind, and a test root's parent is never reused
            for other in self.mounts["cpu"].glob("shoal-*"):
                QuotaPool.sweep_stale(other)
            if self.quota_pool is None:
                self.quota_pool = QuotaPool(cpu_parent, "cpu.cfs_quota_us")
                atexit.register(self.quota_pool.close)

    def create(self, sandbox_id: str, limits: Limits) -> list[Path]:
        pooled = limits.memory_cgroup == "pooled"
        if pooled:
            if self.pools is None:
                raise SandboxError("memory_cgroup='pooled' needs configure_pools() on this cgroup driver")
            shared = [c for c in ("pids", "cpu", "freezer") if self.mounts[c] == self.mounts["memory"]]
            if self.version == 1 and shared:
                raise InvalidArgument(f"memory_cgroup='pooled' needs the v1 memory controller in a hierarchy of its "
                                      f"own; here it is mounted with {', '.join(shared)}")
            self.pools.join(sandbox_id, limits.memory_mb, limits.memory_pool)
        dirs = self.dirs(sandbox_id)
        quota = cpu_quota_us(limits.cpu) if self.cpu_quota else None
        weight = None if self.cpu_quota else cpu_weight(limits.cpu, self.version)
        cpu_dir = self._dir("cpu", sandbox_id)
        try:
            for d in dirs:
                if d == cpu_dir and quota is not None and self.quota_pool and self.quota_pool.take(quota, d):
                    quota = None  # written ahead: the pool's cgroup carries it
                else:
                    d.mkdir()
            mem = limits.memory_mb * 1024 * 1024
            if self.version == 2:
                d = dirs[0]
                if not pooled:  # a pooled sandbox's cgroup has no memory controller: its pool's limit binds
                    _write(d / "memory.max", str(mem))
                    if (d / "memory.swap.max").exists():
                        _write(d / "memory.swap.max", "0")
                _write(d / "pids.max", str(limits.pids))
                if quota is not None:
                    _write(d / "cpu.max", f"{quota} {CFS_PERIOD_US}")
                if weight is not None:
                    _write(d / "cpu.weight", str(weight))
            else:
                if not pooled:
                    m = self._dir("memory", sandbox_id)
                    _write(m / "memory.limit_in_bytes", str(mem))
                    if (m / "memory.memsw.limit_in_bytes").exists():
                        _write(m / "memory.memsw.limit_in_bytes", str(mem))
                _write(self._dir("pids", sandbox_id) / "pids.max", str(limits.pids))
                if quota is not None:  # the period is the kernel's default already: one write, one walk
                    _write(self._dir("cpu", sandbox_id) / "cpu.cfs_quota_us", str(quota))
                if weight is not None:
                    _write(cpu_dir / "cpu.shares", str(weight))
        except OSError as e:
            self.remove(sandbox_id)
            raise SandboxError(f"cannot set up cgroups for {sandbox_id}: {e}") from e
        return dirs

    def remove(self, sandbox_id: str, wait_s: float = 2.0, orphan: bool = False) -> bool:
        """Remove the sandbox's cgroups (retrying while the kernel still reaps its tasks), and its
        membership of a memory pool. orphan: a cgroup the sweep found without a sandbox, which may
        sit below a pool whose registry no longer names it (v2; looked for only then: O(pools))."""
        deadline = time.monotonic() + wait_s
        ok = True
        dirs = self.dirs(sandbox_id)
        if orphan and self.version == 2 and self.pool_of(sandbox_id) is None:
            dirs += list(self.mounts["pids"].joinpath(self.parent).glob(f"{MEMPOOL_PREFIX}*/{sandbox_id}"))
        for d in dirs:
            while True:
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        ok = False
                        break
                    self._kill_all(d)
                    time.sleep(0.01)
        if self.pools is not None:
            ok = self.pools.leave(sandbox_id) and ok
        return ok

    def sweep_pools(self) -> None:
        """Drop ended sandboxes from their memory pools and remove empty pools (backend sweep)."""
        if self.pools is not None:
            self.pools.sweep()

    def _kill_all(self, d: Path) -> None:
        # v2 (Linux >= 5.14): cgroup.kill SIGKILLs every task at once, forks in flight included
        if self.version == 2 and (d / "cgroup.kill").exists():
            try:
                _write(d / "cgroup.kill", "1")
                return
            except OSError:
                pass
        try:
            for pid in (d / "cgroup.procs").read_text().split():
                try:
                    os.kill(int(pid), 9)
                except ProcessLookupError:
                    pass
        except OSError:
            pass

    def list_ids(self) -> set[str]:
        out: set[str] = set()
        for m in set(self.mounts.values()):
            p = m / self.parent
            if not p.is_dir():
                continue
            for x in p.iterdir():
                if x.name.startswith(MEMPOOL_PREFIX) and self.version == 2:  # v2: pooled sandboxes below
                    out.update(y.name for y in x.iterdir() if y.is_dir())
                elif x.is_dir() and not x.name.startswith((POOL_PREFIX, MEMPOOL_PREFIX)):
                    out.add(x.name)
        return out

    # ------------------------------------------------------------------ freezer and stats
    def freeze(self, sandbox_id: str, frozen: bool, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        try:
            self._set_frozen(sandbox_id, frozen, deadline)
        except OSError as e:
            # thawing a sandbox that is being killed: once its tasks die the supervisor removes the
            # cgroup (ENOENT, or ENODEV mid-removal), and there is nothing left to thaw
            if frozen or e.errno not in (errno.ENOENT, errno.ENODEV):
                raise

    def _set_frozen(self, sandbox_id: str, frozen: bool, deadline: float) -> None:
        if self.version == 2:
            d = self._dir("freezer", sandbox_id)
            _write(d / "cgroup.freeze", "1" if frozen else "0")
            want = f"frozen {1 if frozen else 0}"
            while want not in (d / "cgroup.events").read_text():
                if time.monotonic() > deadline:
                    raise SandboxError(f"{sandbox_id}: freezer did not reach {want!r}")
                time.sleep(0.001)
        else:
            d = self._dir("freezer", sandbox_id)
            target = "FROZEN" if frozen else "THAWED"
            _write(d / "freezer.state", target)
            while (d / "freezer.state").read_text().strip() != target:
                if time.monotonic() > deadline:
                    raise SandboxError(f"{sandbox_id}: freezer did not reach {target}")
                _write(d / "freezer.state", target)
                time.sleep(0.001)

    def is_frozen(self, sandbox_id: str) -> bool:
        d = self._dir("freezer", sandbox_id)
        try:
            if self.version == 2:
                return "frozen 1" in (d / "cgroup.events").read_text()
            return (d / "freezer.state").read_text().strip() != "THAWED"
        except OSError:
            return False

    # ------------------------------------------------------------------ CPU class
    def set_cpu_idle(self, sandbox_id: str, idle: bool, missing_ok: bool = False) -> None:
        """Put the sandbox's cgroup in the idle CPU class (priority="idle", and while paused) or back.
        cpu.idle=1 (Linux >= 5.15, v1 and v2) makes the whole group SCHED_IDLE: it runs only on CPU
        time no normal task wants, and its tasks cannot leave it from inside (the group is the unit).
        Older kernels: the lowest weight instead (cpu.weight 1 / cpu.shares 2)."""
        d = self._dir("cpu", sandbox_id)
        try:
            if (d / "cpu.idle").exists():
                _write(d / "cpu.idle", "1" if idle else "0")
            elif self.version == 2:
                _write(d / "cpu.weight", "1" if idle else "100")
            else:
                _write(d / "cpu.shares", "2" if idle else "1024")
        except OSError as e:
            # a sandbox that ends meanwhile: its supervisor removes the cgroup (ENOENT, or ENODEV mid-removal)
            if missing_ok and e.errno in (errno.ENOENT, errno.ENODEV):
                return
            raise SandboxError(f"{sandbox_id}: cannot set its CPU class: {e}") from e

    def cpu_idle(self, sandbox_id: str) -> bool | None:
        """Whether the sandbox's cgroup is in the idle CPU class; None if it is gone."""
        d = self._dir("cpu", sandbox_id)
        try:
            if (d / "cpu.idle").exists():
                return (d / "cpu.idle").read_text().strip() == "1"
            if self.version == 2:
                return int((d / "cpu.weight").read_text()) <= 1
            return int((d / "cpu.shares").read_text()) <= 2
        except (OSError, ValueError):
            return None

    def procs(self, sandbox_id: str) -> list[int]:
        """The sandbox's processes (host pids), from its cgroup."""
        try:
            return [int(p) for p in (self._dir("pids", sandbox_id) / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            return []

    def memory_bytes(self, sandbox_id: str) -> int | None:
        """The sandbox's memory use; None when unreadable or pooled (its pool's use is its members')."""
        if self.pool_of(sandbox_id) is not None:
            return None
        d = self._dir("memory", sandbox_id)
        name = "memory.current" if self.version == 2 else "memory.usage_in_bytes"
        try:
            return int((d / name).read_text())
        except (OSError, ValueError):
            return None

    # ------------------------------------------------------------------ reclaim (reclaim.py)
    def memory_dir(self, sandbox_id: str) -> Path:
        """The sandbox's own memory cgroup (reclaim, usage); a pooled sandbox has none: InvalidArgument."""
        if self.pool_of(sandbox_id) is not None:
            raise InvalidArgument(f"sandbox {sandbox_id} shares a pooled memory cgroup (memory_cgroup='pooled'): "
                                  "per-sandbox memory usage and reclaim are not available for it")
        return self._dir("memory", sandbox_id)

    def allow_swap(self, sandbox_id: str, memory_bytes: int, swap_bytes: int) -> None:
        """Let the sandbox keep up to swap_bytes in swap under its own memory pressure (create()
        allows none: a sandbox at its limit is OOM-killed rather than slowed down by swapping).
        A pooled sandbox's pool carries the swap for all its members (mempools.py): nothing to do."""
        if self.pool_of(sandbox_id) is not None:
            return
        d = self.memory_dir(sandbox_id)
        if self.version == 2:
            if (d / "memory.swap.max").exists():
                _write(d / "memory.swap.max", str(swap_bytes))
        elif (d / "memory.memsw.limit_in_bytes").exists():
            _write(d / "memory.memsw.limit_in_bytes", str(memory_bytes + swap_bytes))

    def pids_current(self, sandbox_id: str) -> int | None:
        try:
            return int((self._dir("pids", sandbox_id) / "pids.current").read_text())
        except (OSError, ValueError):
            return None

    # ------------------------------------------------------------------ OOM (density-oom; memory_dir above)
    def oom_kills(self, sandbox_id: str) -> int | None:
        """Processes of the sandbox the OOM killer has killed so far (its own limit or an ancestor's);
        None when unreadable (gone, or a v1 kernel older than 4.13). A pooled sandbox: its pool's count
        (a neighbour's kill counts too; the exec path pairs it with its command's SIGKILL)."""
        d = self._memory_watch_dir(sandbox_id)
        try:
            text = (d / ("memory.events" if self.version == 2 else "memory.oom_control")).read_text()
        except OSError:
            return None
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return None

    def oom_reason(self, sandbox_id: str, own_before: int | None = None) -> str:
        """The tombstone for an OOM kill just seen: "oom <limit MiB>" when the sandbox's own limit was
        reached (v2: its `oom` count grew past own_before; v1: its peak usage reached its limit; the
        peak is reset), else "oom <aggregate MiB> shared" (all sandboxes together). A pooled sandbox:
        "oom <pool MiB> pooled" when its pool's limit was reached (v1: the pool's peak, not reset: it is
        every member's to read)."""
        pooled = self.pool_of(sandbox_id) is not None
        d = self._memory_watch_dir(sandbox_id)
        own = False
        try:
            if self.version == 2:
                for line in (d / "memory.events").read_text().splitlines():
                    key, _, value = line.partition(" ")
                    if key == "oom":
                        own = int(value) > (own_before or 0)
            else:
                for usage, limit in (("memory.max_usage_in_bytes", "memory.limit_in_bytes"),
                                     ("memory.memsw.max_usage_in_bytes", "memory.memsw.limit_in_bytes")):
                    if (d / usage).exists():
                        peak, lim = int((d / usage).read_text()), int((d / limit).read_text())
                        own = own or peak + (1 << 20) >= lim
                        if not pooled:
                            _write(d / usage, "0")
        except (OSError, ValueError):
            pass
        if own:
            return f"oom {self._limit_mb(d) or 0}" + (" pooled" if pooled else "")
        return f"oom {self.parent_memory_limit_mb() or 0} shared"

    def own_ooms(self, sandbox_id: str) -> int | None:
        """v2: how often the sandbox reached its own limit (memory.events `oom`); None on v1."""
        if self.version != 2:
            return None
        try:
            for line in (self._memory_watch_dir(sandbox_id) / "memory.events").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom":
                    return int(value)
        except (OSError, ValueError):
            pass
        return None

    def _limit_mb(self, d: Path) -> int | None:
        try:
            raw = (d / ("memory.max" if self.version == 2 else "memory.limit_in_bytes")).read_text().strip()
        except OSError:
            return None
        if raw == "max" or int(raw) >= 1 << 50:
            return None
        return int(raw) >> 20

    def parent_memory_dir(self) -> Path:
        """The cgroup holding all of this root's sandboxes: its limit bounds them together."""
        return self.mounts["memory"] / self.parent

    def set_parent_memory_limit(self, limit_mb: int) -> None:
        """Bound all sandboxes together (the aggregate limit): past it the kernel OOM-kills inside the
        sandboxes, never outside them. Sandboxes are never allowed to swap past it either (v2)."""
        d = self.parent_memory_dir()
        value = str(limit_mb << 20)
        try:
            if self.version == 2:
                _write(d / "memory.max", value)
            else:
                _write(d / "memory.limit_in_bytes", value)
        except OSError as e:
            # v1: EBUSY when the sandboxes already use more than the new limit and cannot be reclaimed
            raise SandboxError(f"cannot limit all sandboxes to {limit_mb} MiB ({d}): {e.strerror}") from e

    def parent_memory_limit_mb(self) -> int | None:
        """The aggregate limit now set (None: unlimited or unreadable)."""
        return self._limit_mb(self.parent_memory_dir())
