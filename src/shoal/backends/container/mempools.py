"""Pooled memory cgroups: dense idle fleets share one memory cgroup per pool of sandboxes (issue 16).

Why: on Linux 6.x every memory cgroup allocates a `shrinker_info` as wide as the host's high-water mark
of shrinker ids, and every sandbox adds superblocks (overlay, tmpfs, proc, mqueue...), so kernel memory
for N sandboxes that each own a memory cgroup grows as N² (docs/density.md, "Where an idle sandbox's
kernel memory goes"). A sandbox created with memory_cgroup="pooled" joins a pool of at most
`size` sandboxes instead: N/size memory cgroups. Its pids, cpu and freezer cgroups stay its own.

The pool's memory limit is the sum of its members' memory_mb (never set below what the pool uses, so a
member leaving cannot make the kernel OOM-kill a neighbour), and its swap follows [density]
sandbox_swap. A runaway member hurts only its pool: the kernel's OOM killer picks inside it.

Membership lives in files, so every process on one Shoal root (shoald, a CLI, a benchmark's holders)
sees the same pools: under `<root>/mempools/`, `<pool>/<sandbox id>@<memory_mb>` per member and
`by-id/<sandbox id>` -> `<pool>`, changed under one flock. A member whose state dir is gone (it ended
without this module: TTL, its last process exiting) is dropped when its pool is next looked at (a join
that picks it, a member's removal, `sweep()`).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path

from ...core.errors import SandboxError

PREFIX = "mempool-"  # the pool's cgroup directory (and its registry directory) starts with this


def group_prefix(group: str) -> str:
    """Pools of one key (`Limits.memory_pool`: shoald sets the tenant) are named `mempool-<tag>-<hex>`:
    a join looks only at its own key's pools, so sandboxes of different keys never share one. The tag
    is a hash (a key is free text; 64 bits: no tenant can pick a name that lands in another's pools)."""
    return f"{PREFIX}{hashlib.sha256(group.encode()).hexdigest()[:16]}-"


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


class MemoryPools:
    def __init__(self, state: Path, sandboxes_dir: Path, size: int, version: int, mem_parent: Path,
                 swap: float = 0.0):
        self.state = state  # the registry
        self.sandboxes_dir = sandboxes_dir  # a member is live while its state dir exists
        self.size = size
        self.version = version
        self.mem_parent = mem_parent  # the Shoal parent in the memory hierarchy (v2: the unified one)
        self.swap = swap  # [density] sandbox_swap: the pool may swap this fraction of its limit
        self._pool_of: dict[str, str] = {}
        self._hint: dict[str, str] = {}  # per key, the pool this process last joined: tried first
        self._tlock = threading.Lock()  # flock is per open file: threads of one process need their own lock
        self._fd: int | None = None

    # ------------------------------------------------------------------ registry
    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._tlock:
            if self._fd is None:
                (self.state / "by-id").mkdir(parents=True, exist_ok=True)
                self._fd = os.open(self.state / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def pool_of(self, sandbox_id: str) -> str | None:
        """The sandbox's pool, or None when it has a memory cgroup of its own."""
        pool = self._pool_of.get(sandbox_id)
        if pool is None:
            try:
                pool = os.readlink(self.state / "by-id" / sandbox_id)
            except OSError:
                return None
            self._pool_of[sandbox_id] = pool
        return pool

    def pool_dir(self, pool: str) -> Path:
        return self.mem_parent / pool

    def _members(self, pool: str) -> dict[str, int]:
        out = {}
        for name in os.listdir(self.state / pool):
            sid, _, mb = name.rpartition("@")
            if sid and mb.isdigit():
                out[sid] = int(mb)
        return out

    def _drop(self, pool: str, sandbox_id: str, mb: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.state / pool / f"{sandbox_id}@{mb}")
        link = self.state / "by-id" / sandbox_id
        with contextlib.suppress(OSError):
            if os.readlink(link) == pool:
                os.unlink(link)
        self._pool_of.pop(sandbox_id, None)

    def _prune(self, pool: str, members: dict[str, int]) -> dict[str, int]:
        live = {}
        for sid, mb in members.items():
            if os.path.lexists(self.sandboxes_dir / sid):
                live[sid] = mb
            else:
                self._drop(pool, sid, mb)
        return live

    # ------------------------------------------------------------------ the pool's cgroup
    def _make_cgroup(self, pool: str) -> None:
        d = self.pool_dir(pool)
        try:
            d.mkdir()
        except FileExistsError:
            return
        if self.version == 2:
            # the members' cgroups below get pids and cpu but no memory controller: their memory is the pool's
            _write(d / "cgroup.subtree_control", "+pids +cpu")

    def _usage(self, d: Path) -> int:
        try:
            return int((d / ("memory.current" if self.version == 2 else "memory.usage_in_bytes")).read_text())
        except (OSError, ValueError):
            return 0

    def _apply_limit(self, pool: str, total_mb: int, raising: bool) -> None:
        """The pool's limit: its members' memory_mb together, never below what it uses now (a lower
        limit would make the kernel reclaim, then OOM-kill a member that did nothing)."""
        d = self.pool_dir(pool)
        mem = max(total_mb << 20, (self._usage(d) + (2 << 20)) & ~((1 << 20) - 1))
        swap = int(mem * self.swap)
        try:
            if self.version == 2:
                _write(d / "memory.max", str(mem))
                if (d / "memory.swap.max").exists():
                    _write(d / "memory.swap.max", str(swap))
                return
            memsw = d / "memory.memsw.limit_in_bytes"
            # v1 keeps memsw >= limit at every step: a limit going up needs memsw raised first, one going
            # down (a new pool's starts unlimited) is written first
            up = int((d / "memory.limit_in_bytes").read_text()) < mem
            if up and memsw.exists():
                _write(memsw, str(mem + swap))
            _write(d / "memory.limit_in_bytes", str(mem))
            if not up and memsw.exists():
                _write(memsw, str(mem + swap))
        except (OSError, ValueError) as e:
            if raising:
                why = getattr(e, "strerror", None) or e
                raise SandboxError(f"cannot raise memory pool {pool} to {mem >> 20} MiB: {why}") from e
            # lowering: the pool keeps the higher limit (the parent's still bounds it) until its next change

    # ------------------------------------------------------------------ join / leave
    def join(self, sandbox_id: str, memory_mb: int, group: str = "") -> str:
        """Make the sandbox a member of a pool of its key `group` with room (a new pool when none has);
        returns the pool. The pool's limit is raised before any of the sandbox's tasks arrive."""
        with self._locked():
            pool, members = self._choose(group_prefix(group))
            self._make_cgroup(pool)
            (self.state / pool / f"{sandbox_id}@{memory_mb}").touch()  # the member first, then its index
            link = self.state / "by-id" / sandbox_id
            with contextlib.suppress(FileNotFoundError):
                link.unlink()
            os.symlink(pool, link)
            self._pool_of[sandbox_id] = pool
            self._apply_limit(pool, sum(members.values()) + memory_mb, raising=True)
            self._hint[group_prefix(group)] = pool
            return pool

    def _choose(self, prefix: str) -> tuple[str, dict[str, int]]:
        # the key's last pool first, with its ended members dropped (so its limit is exact at every
        # join); then any pool of the key that counts fewer than `size` markers; else a new pool
        hint = self._hint.get(prefix)
        order = [hint] if hint else []
        order += [p for p in os.listdir(self.state) if p.startswith(prefix) and p != hint]
        for i, pool in enumerate(order):
            try:
                members = self._members(pool)
            except FileNotFoundError:
                continue
            if i == 0 or len(members) < self.size:
                members = self._prune(pool, members)
            if len(members) < self.size:
                return pool, members
        pool = prefix + secrets.token_hex(4)
        (self.state / pool).mkdir()
        return pool, {}

    def leave(self, sandbox_id: str) -> bool:
        """Drop the sandbox from its pool (its tasks are gone): lower the pool's limit, or remove the
        pool once no member is left. False when the pool's cgroup could not be removed yet."""
        pool = self.pool_of(sandbox_id)
        if pool is None:
            return True
        with self._locked():
            try:
                members = self._members(pool)
            except FileNotFoundError:
                members = {}
            if sandbox_id in members:
                self._drop(pool, sandbox_id, members.pop(sandbox_id))
            else:
                self._drop(pool, sandbox_id, -1)
            return self._settle(pool, self._prune(pool, members))

    def _settle(self, pool: str, members: dict[str, int]) -> bool:
        if members:
            self._apply_limit(pool, sum(members.values()), raising=False)
            return True
        for key in [k for k, v in self._hint.items() if v == pool]:
            del self._hint[key]
        with contextlib.suppress(OSError):
            (self.state / pool).rmdir()
        try:
            self.pool_dir(pool).rmdir()
        except FileNotFoundError:
            pass
        except OSError:
            return False  # tasks still exiting: sweep() tries again
        return True

    def sweep(self) -> None:
        """Drop ended members from every pool, fix each pool's limit, remove empty pools and pool
        cgroups whose registry entry is gone (a process that died between the two)."""
        with self._locked():
            known = set()
            for pool in os.listdir(self.state):
                if not pool.startswith(PREFIX):
                    continue
                known.add(pool)
                try:
                    members = self._prune(pool, self._members(pool))
                except FileNotFoundError:
                    continue
                self._settle(pool, members)
            if self.mem_parent.is_dir():
                for d in self.mem_parent.iterdir():
                    if d.name.startswith(PREFIX) and d.name not in known:
                        with contextlib.suppress(OSError):
                            d.rmdir()
            for link in (self.state / "by-id").iterdir():
                with contextlib.suppress(OSError):
                    if not (self.state / os.readlink(link)).is_dir():
                        link.unlink()

    def pools(self) -> dict[str, list[str]]:
        """pool -> member ids, as registered (tests, the bench)."""
        out: dict[str, list[str]] = {}
        with contextlib.suppress(FileNotFoundError):
            for pool in os.listdir(self.state):
                if pool.startswith(PREFIX):
                    with contextlib.suppress(FileNotFoundError):
                        out[pool] = sorted(self._members(pool))
        return out
