"""A sandbox's CFS quota is written ahead, on a pool of empty cpu cgroups (quotapool.py): every quota
write walks all task groups on the host, O(live sandboxes). The cap must still hold for a sandbox whose
cgroup came from the pool."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from shoal import Sandbox
from shoal.backends.container.quotapool import PREFIX, QuotaPool


def _pool_dirs(parent: Path) -> set[str]:
    return {d.name for d in parent.iterdir() if d.name.startswith(PREFIX)}


def test_a_sandbox_from_the_pool_is_capped(host, base_image):
    cg = host.backend("container").cgroups
    if cg.version != 1 or cg.quota_pool is None:
        pytest.skip("the quota pool is for cgroup v1 (v2 has no cgroup rename)")
    parent = cg.mounts["cpu"] / cg.parent
    with Sandbox.create(base_image, cpu=0.5, memory_mb=64, root=host.settings.root):
        pass  # the first create of a quota value asks the pool for it
    deadline = time.monotonic() + 10
    while len(_pool_dirs(parent)) < cg.quota_pool.size and time.monotonic() < deadline:
        time.sleep(0.05)
    ready = _pool_dirs(parent)
    assert ready, "the pool prepared no cgroup"
    with Sandbox.create(base_image, cpu=0.5, memory_mb=64, root=host.settings.root) as sb:
        cpu_dir = cg.mounts["cpu"] / cg.parent / sb.id
        assert (cpu_dir / "cpu.cfs_quota_us").read_text().strip() == "50000"
        assert ready - _pool_dirs(parent), "the create did not take a prepared cgroup"
        # two busy loops for 1.5 s: the cap holds them to half a core
        usage = cpu_dir / "cpuacct.usage"
        before = int(usage.read_text()) if usage.exists() else None
        t0 = time.monotonic()
        sb.commands.run("for i in 1 2; do (while :; do :; done) & done; sleep 1.5; kill $(jobs -p)", timeout=20)
        wall = time.monotonic() - t0
        if before is not None:
            used = (int(usage.read_text()) - before) / 1e9
            assert used < 0.5 * wall + 0.25, (used, wall)
        else:
            stat = (cpu_dir / "cpu.stat").read_text()
            assert "nr_throttled 0" not in stat, stat


def test_stale_pool_cgroups_are_swept_and_never_listed_as_sandboxes(host):
    cg = host.backend("container").cgroups
    if cg.version != 1:
        pytest.skip("cgroup v1 only")
    parent = cg.mounts["cpu"] / cg.parent
    dead = 2 ** 22 + 7  # above pid_max's default, never a live pid here
    stale = parent / f"{PREFIX}{dead}-0"
    stale.mkdir()
    try:
        assert stale.name not in cg.list_ids()
        assert QuotaPool.sweep_stale(parent) >= 1
        assert not stale.exists()
    finally:
        if stale.exists():
            stale.rmdir()


def test_a_dead_process_pool_under_another_root_is_swept_at_start(host):
    """A daemon stopped by a signal never runs its atexit, and a test root's parent is never used
    again: every backend start sweeps the pools of dead processes under every Shoal parent."""
    cg = host.backend("container").cgroups
    if cg.version != 1:
        pytest.skip("cgroup v1 only")
    other = cg.mounts["cpu"] / "shoal-pooltest0"
    stale = other / f"{PREFIX}{2 ** 22 + 7}-0"
    stale.mkdir(parents=True)
    try:
        cg.prepare_parent()
        assert not stale.exists()
    finally:
        if stale.exists():
            stale.rmdir()
        other.rmdir()


def test_cpu_quota_off_makes_cpu_a_weight_with_no_quota(host, base_image, monkeypatch, tmp_path):
    """[density] cpu_quota = false: `cpu` sets the group's weight and no quota is written (no walk of the
    host's task groups per create); busy loops are never throttled."""
    from shoal import Host
    from shoal.config import load_settings
    from shoal.core.errors import InvalidArgument

    cg = host.backend("container").cgroups
    monkeypatch.setattr(cg, "cpu_quota", False)
    with Sandbox.create(base_image, cpu=0.5, memory_mb=64, root=host.settings.root) as sb:
        d = cg._dir("cpu", sb.id)
        if cg.version == 1:
            assert (d / "cpu.cfs_quota_us").read_text().strip() == "-1"
            assert (d / "cpu.shares").read_text().strip() == "512"
        else:
            assert (d / "cpu.max").read_text().split()[0] == "max"
            assert (d / "cpu.weight").read_text().strip() == "50"
        sb.commands.run("for i in 1 2; do (while :; do :; done) & done; sleep 1; kill $(jobs -p)", timeout=20)
        stat = dict(line.split() for line in (d / "cpu.stat").read_text().splitlines())
        assert stat["nr_throttled"] == "0", stat
    cfg = tmp_path / "c.toml"
    monkeypatch.setenv("SHOAL_CONFIG", str(cfg))
    cfg.write_text('[density]\ncpu_quota = "no"\n')
    with pytest.raises(InvalidArgument, match="density.cpu_quota must be true"):
        load_settings(tmp_path / "r")
    cfg.write_text("[density]\ncpu_quota = false\n")
    assert load_settings(tmp_path / "r").cpu_quota is False
    assert Host.get(tmp_path / "r").backend("container").cgroups.cpu_quota is False
