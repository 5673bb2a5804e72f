"""Pooled memory cgroups (memory_cgroup="pooled", docs/density.md "Pooled memory cgroups"): sandboxes
share one memory cgroup per pool of [density] memory_pool_size, limited to the sum of their memory_mb;
their pids, cpu and freezer cgroups stay their own. Runs on v1 (here) and v2 (`make test-vm`): on v2
a pooled sandbox's cgroup sits below its pool's, without the memory controller.

Allocations are busybox `dd bs=<N>M` (an N MiB anonymous buffer), as in test_oom_safety.py."""
from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest

from shoal import Sandbox
from shoal.config import load_settings
from shoal.core.errors import InvalidArgument, SandboxOutOfMemory

MiB = 1 << 20


def alloc(mib: int) -> str:
    return f"dd if=/dev/zero of=/dev/null bs={mib}M count=1"


@pytest.fixture
def pools(host):
    """The backend's pools with a small pool size for the test (restored after); every sandbox the
    test makes through `make` is killed at the end."""
    cg = host.backend("container").cgroups
    assert cg.pools is not None
    size = cg.pools.size
    made: list[Sandbox] = []

    def make(size_: int | None = None, **kw) -> Sandbox:
        if size_ is not None:
            cg.pools.size = size_
        kw.setdefault("memory_mb", 48)
        kw.setdefault("disk_mb", 16)
        sb = Sandbox.create(kw.pop("image"), root=host.settings.root, memory_cgroup="pooled", **kw)
        made.append(sb)
        return sb

    yield cg, make
    for sb in made:
        with contextlib.suppress(Exception):
            sb.kill()
    cg.pools.size = size


def pool_cgroups(cg) -> list[Path]:
    return sorted((cg.mounts["memory"] / cg.parent).glob("mempool-*"))


def limit_mib(cg, pool_dir: Path) -> int:
    name = "memory.max" if cg.version == 2 else "memory.limit_in_bytes"
    return int((pool_dir / name).read_text()) // MiB


def memcg_of(cg, pid: int) -> str:
    """The memory cgroup the kernel charges the process to (v1: its memory line; v2: the nearest
    ancestor-or-self of its cgroup with the memory controller on)."""
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    if cg.version == 1:
        return next(l.split(":", 2)[2] for l in lines if "memory" in l.split(":")[1].split(","))
    path = next(l.split(":", 2)[2] for l in lines if l.startswith("0::"))
    while path != "/" and not (cg.mounts["memory"] / path.lstrip("/") / "memory.max").exists():
        path = str(Path(path).parent)
    return path


def test_pooled_sandboxes_share_one_memory_cgroup_per_pool(host, base_image, pools):
    """K+1 pooled sandboxes: 2 memory cgroups, not K+1; each sandbox's processes are charged to its
    pool, it has no memory cgroup of its own, and its pids/cpu/freezer cgroups are its own."""
    cg, make = pools
    before = set(pool_cgroups(cg))
    k = 3
    sbs = [make(k, image=base_image) for _ in range(k + 1)]
    new = set(pool_cgroups(cg)) - before
    assert len(new) == 2, new
    charged = {}
    for sb in sbs:
        pid = sb.info().init_pid
        charged[sb.id] = memcg_of(cg, pid)
        assert charged[sb.id].rsplit("/", 1)[-1].startswith("mempool-"), charged[sb.id]
        assert not (cg.mounts["memory"] / cg.parent / sb.id).exists()
        if cg.version == 2:
            assert not (cg._dir("pids", sb.id) / "memory.max").exists()  # no memcg of its own below the pool
        assert pid in cg.procs(sb.id)  # its own pids cgroup
        assert sb.info().memory_bytes is None  # no per-sandbox usage in a pool
    assert sorted(len([s for s in charged.values() if s == p]) for p in set(charged.values())) == [1, k]
    assert {len(v) for p, v in cg.pools.pools().items() if cg.mounts["memory"] / cg.parent / p in new} == {1, k}
    # a sandbox with its own memory cgroup beside them is unchanged
    with Sandbox.create(base_image, memory_mb=48, disk_mb=16, root=host.settings.root) as own:
        assert cg.pool_of(own.id) is None
        assert memcg_of(cg, own.info().init_pid).endswith("/" + own.id)
        assert own.info().memory_bytes


def test_pool_limit_follows_its_members_and_an_empty_pool_is_removed(host, base_image, pools):
    cg, make = pools
    before = set(pool_cgroups(cg))
    a = make(8, image=base_image, memory_mb=40)
    b = make(image=base_image, memory_mb=60)
    c = make(image=base_image, memory_mb=80, ttl=2)
    (pool,) = set(pool_cgroups(cg)) - before
    assert limit_mib(cg, pool) == 180
    b.kill()
    assert limit_mib(cg, pool) == 120
    # a member that ends on its own (its TTL) is dropped at the pool's next change
    deadline = time.monotonic() + 15
    while (host.settings.sandboxes_dir / c.id).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    d = make(image=base_image, memory_mb=30)
    assert cg.pool_of(d.id) == pool.name
    assert limit_mib(cg, pool) == 70
    a.kill()
    d.kill()
    assert not pool.exists()  # no member left: the pool's cgroup is gone, and its registry entry
    assert pool.name not in cg.pools.pools()


def test_runaway_in_a_pool_is_oom_killed_and_named_while_its_neighbour_lives(host, base_image, pools):
    """Past the pool's limit the kernel OOM-kills inside the pool: the runaway (the biggest task) goes,
    its sandbox's tombstone names the pool's limit, the neighbour is untouched."""
    cg, make = pools
    runaway = make(2, image=base_image, memory_mb=48, oom_kill="sandbox")
    neighbour = make(image=base_image, memory_mb=48, oom_kill="sandbox")
    assert cg.pool_of(runaway.id) == cg.pool_of(neighbour.id)
    neighbour.commands.start("sleep 300")  # a live process the OOM killer could have taken
    with pytest.raises(SandboxOutOfMemory, match="its memory pool .* reached its limit of 96 MiB"):
        runaway.commands.run(alloc(200), timeout=30)
    assert (host.settings.tombstones_dir / runaway.id).read_text() == "oom 96 pooled"
    assert not (host.settings.tombstones_dir / neighbour.id).exists()
    assert neighbour.commands.run("echo alive", timeout=10).stdout == "alive\n"
    assert neighbour.commands.run("pidof sleep", timeout=10).stdout.strip()
    # oom_kill="command" in a pool: the command reports it, its sandbox lives on
    cmd = make(image=base_image, memory_mb=48)
    r = cmd.commands.run(alloc(200), timeout=30)
    assert r.oom_killed and r.exit_code == 137, r
    assert cmd.commands.run("echo alive", timeout=10).stdout == "alive\n"
    assert neighbour.commands.run("echo alive", timeout=10).stdout == "alive\n"


def test_a_background_command_oom_killed_in_a_pool_ends_its_own_sandbox(host, base_image, pools):
    """oom_kill="sandbox" in a pool: a background command (commands.start) that the OOM killer takes
    ends its sandbox with the pool's tombstone, with nobody waiting on its handle; the neighbour, whose
    supervisor sees the same pool count grow, lives on."""
    cg, make = pools
    runaway = make(2, image=base_image, memory_mb=48, oom_kill="sandbox")
    neighbour = make(image=base_image, memory_mb=48, oom_kill="sandbox")
    assert cg.pool_of(runaway.id) == cg.pool_of(neighbour.id)
    neighbour.commands.start("sleep 300")
    runaway.commands.start(alloc(200))
    path = host.settings.tombstones_dir / runaway.id
    deadline = time.monotonic() + 15
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert path.exists() and path.read_text() == "oom 96 pooled"
    with pytest.raises(SandboxOutOfMemory, match="its memory pool"):
        runaway.info()
    assert not (host.settings.tombstones_dir / neighbour.id).exists()
    assert neighbour.commands.run("pidof sleep", timeout=10).stdout.strip()


def test_pause_resume_exec_and_cpu_class_in_a_pool(host, base_image, pools):
    cg, make = pools
    sb = make(4, image=base_image, priority="idle")
    assert cg.cpu_idle(sb.id) is True
    assert sb.commands.run("echo hi", timeout=10).stdout == "hi\n"
    sb.pause()
    assert sb.info().state == "paused" and cg.is_frozen(sb.id)
    sb.resume()
    assert sb.info().state == "running" and not cg.is_frozen(sb.id)
    assert sb.commands.run("echo again", timeout=10).stdout == "again\n"
    # its pids limit is its own
    assert int((cg._dir("pids", sb.id) / "pids.max").read_text()) == sb.info().limits.pids


def test_bad_values_and_what_a_pool_cannot_do_raise_typed_errors(host, base_image, pools, tmp_path, monkeypatch):
    cg, make = pools
    with pytest.raises(InvalidArgument, match="memory_cgroup"):
        Sandbox.create(base_image, root=host.settings.root, memory_cgroup="shared")  # type: ignore[arg-type]
    for bad in ("1", "0", "5000", '"64"', "true"):
        cfg = tmp_path / f"c{len(bad)}.toml"
        cfg.write_text(f"[density]\nmemory_pool_size = {bad}\n")
        monkeypatch.setenv("SHOAL_CONFIG", str(cfg))
        with pytest.raises(InvalidArgument, match="memory_pool_size must be an integer from 2 to 4096"):
            load_settings(tmp_path / "r")
    cfg = tmp_path / "mc.toml"
    cfg.write_text('[density]\nmemory_cgroup = "pool"\n')
    monkeypatch.setenv("SHOAL_CONFIG", str(cfg))
    with pytest.raises(InvalidArgument, match="density.memory_cgroup must be 'own' or 'pooled'"):
        load_settings(tmp_path / "r")
    cfg.write_text('[density]\nmemory_cgroup = "pooled"\nmemory_pool_size = 16\n')
    s = load_settings(tmp_path / "r")
    assert (s.memory_cgroup, s.memory_pool_size) == ("pooled", 16)
    monkeypatch.delenv("SHOAL_CONFIG")
    sb = make(image=base_image)
    with pytest.raises(InvalidArgument, match="pooled memory cgroup"):
        sb.reclaim()


def test_pools_are_kept_apart_by_their_key(host, base_image, pools):
    """Sandboxes of different memory_pool keys (shoald: tenants) never share a pool, even with room;
    the same key shares one."""
    cg, make = pools
    a1 = make(8, image=base_image, memory_pool="job-a")
    b1 = make(image=base_image, memory_pool="job-b")
    a2 = make(image=base_image, memory_pool="job-a")
    none = make(image=base_image)
    assert cg.pool_of(a1.id) == cg.pool_of(a2.id)
    assert len({cg.pool_of(a1.id), cg.pool_of(b1.id), cg.pool_of(none.id)}) == 3
    assert a1.info().limits.memory_pool == "job-a"


def test_sweep_drops_a_member_that_ended_on_its_own_and_removes_its_empty_pool(host, base_image, pools):
    """A member that ends without Shoal (its TTL) stays counted until its pool is next looked at; the
    backend's sweep looks at every pool: the member goes, and with it the emptied pool's cgroup."""
    cg, make = pools
    sb = make(4, image=base_image, memory_mb=40, ttl=1)
    pool = cg.mounts["memory"] / cg.parent / cg.pool_of(sb.id)
    deadline = time.monotonic() + 15
    while (host.settings.sandboxes_dir / sb.id).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.exists() and pool.name in cg.pools.pools()  # nobody has looked at the pool yet
    host.backend("container").sweep()
    assert not pool.exists()
    assert pool.name not in cg.pools.pools()
    assert cg.pool_of(sb.id) is None
