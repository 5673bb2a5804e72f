"""The cgroup driver on whatever hierarchy this host has (v1 here; v2 in `make test-vm`): limits are not
only written but enforced, the freezer's state is the kernel's, and the sandbox sees its own cgroup only."""
from __future__ import annotations

import time

from shoal import Sandbox


def _cpu_stat(cg, sandbox_id: str) -> dict[str, int]:
    text = (cg._dir("cpu", sandbox_id) / "cpu.stat").read_text()
    return {k: int(v) for k, v in (line.split() for line in text.splitlines())}


def test_v2_parent_delegates_the_controllers(host):
    cg = host.backend("container").cgroups
    if cg.version == 1:
        for c in ("memory", "pids", "cpu", "freezer"):
            assert (cg.mounts[c] / cg.parent).is_dir()
        return
    # "no internal processes": controllers are enabled top-down, the parent holds no task of its own
    for d in (cg.mounts["memory"], cg.mounts["memory"] / cg.parent):
        assert {"memory", "pids", "cpu"} <= set((d / "cgroup.subtree_control").read_text().split()), d
    assert (cg.mounts["memory"] / cg.parent / "cgroup.procs").read_text() == ""


def test_cpu_quota_is_enforced(root, base_image, host):
    """cpu=0.2: a busy loop gets about a fifth of one CPU, and the kernel reports the throttling."""
    cg = host.backend("container").cgroups
    with Sandbox.create(base_image, root=root, cpu=0.2) as sb:
        before = _cpu_stat(cg, sb.id)
        t0 = time.monotonic()
        sb.commands.run("end=$(( $(date +%s) + 2 )); while [ $(date +%s) -lt $end ]; do :; done", timeout=30)
        wall = time.monotonic() - t0
        after = _cpu_stat(cg, sb.id)
    assert after["nr_throttled"] > before["nr_throttled"]
    if "usage_usec" in after:  # v2 (v1 keeps usage in cpuacct)
        used = (after["usage_usec"] - before["usage_usec"]) / 1e6
        assert used / wall < 0.35, (used, wall)


def test_memory_limit_kills_inside_and_is_counted(root, base_image, host):
    cg = host.backend("container").cgroups
    with Sandbox.create(base_image, root=root, memory_mb=64) as sb:
        # a shell variable doubling past the limit: the OOM killer ends it inside the sandbox
        r = sb.commands.run('x=$(head -c 1048576 /dev/zero | tr "\\0" a); while :; do x="$x$x"; done', timeout=60)
        assert r.exit_code == 137
        assert sb.commands.run("echo alive").stdout == "alive\n"  # the sandbox itself survives
        if cg.version == 2:
            events = dict(l.split() for l in (cg._dir("memory", sb.id) / "memory.events").read_text().splitlines())
            assert int(events["oom_kill"]) >= 1
            assert int((cg._dir("memory", sb.id) / "memory.max").read_text()) == 64 << 20


def test_pids_limit_and_freezer_state(root, base_image, host):
    cg = host.backend("container").cgroups
    with Sandbox.create(base_image, root=root, pids=20) as sb:
        r = sb.commands.run("for i in $(seq 40); do sleep 5 & done 2>&1; wait", timeout=30)
        assert "can't fork" in r.stdout + r.stderr or "Resource temporarily unavailable" in r.stdout + r.stderr
        assert cg.pids_current(sb.id) is not None and cg.pids_current(sb.id) <= 20
        sb.pause()
        assert cg.is_frozen(sb.id)
        if cg.version == 2:  # the kernel's own view, not Shoal's bookkeeping
            assert "frozen 1" in (cg._dir("freezer", sb.id) / "cgroup.events").read_text()
        sb.resume()
        assert not cg.is_frozen(sb.id)


def test_sandbox_sees_only_its_own_cgroup(root, base_image, host):
    with Sandbox.create(base_image, root=root) as sb:
        own = sb.commands.run("cat /proc/self/cgroup").stdout
        if host.backend("container").cgroups.version == 2:
            assert own.strip() == "0::/"  # a cgroup namespace rooted at the sandbox's cgroup
        else:
            assert "shoal-" not in own  # v1 paths are relative to the namespace root too


def test_parents_of_removed_roots_are_removed_at_the_next_start(tmp_path):
    """A root removed with rm -rf leaves its parent cgroups behind; the next backend start on any root
    removes them (parents.py: on this kernel each left-over memory cgroup can hold MiBs of slab)."""
    import shutil
    import subprocess

    from shoal import Host
    from shoal.backends.container.parents import OWNERS_DIR

    gone, other = tmp_path / "gone", tmp_path / "other"
    cg = Host.get(gone).backend("container").cgroups
    dirs = [m / cg.parent for m in set(cg.mounts.values())]
    assert all(d.is_dir() for d in dirs) and (OWNERS_DIR / cg.parent).read_text() == str(gone.resolve())
    # a child cgroup with a task keeps its parent (rmdir is refused), and the record stays for later
    busy = cg.mounts["pids"] / cg.parent / "busy"
    busy.mkdir()
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        (busy / "cgroup.procs").write_text(str(sleeper.pid))
        shutil.rmtree(gone)
        Host.get(other).backend("container")
        assert busy.is_dir() and (OWNERS_DIR / cg.parent).exists()
    finally:
        sleeper.kill()
        sleeper.wait()
    time.sleep(0.1)  # the kernel drops the dead task from the cgroup
    Host.get(tmp_path / "third").backend("container")
    assert not any(d.exists() for d in dirs), [d for d in dirs if d.exists()]
    assert not (OWNERS_DIR / cg.parent).exists()
    # the live roots' parents are untouched
    for r in (other, tmp_path / "third"):
        c = Host.get(r).backend("container").cgroups
        assert all((m / c.parent).is_dir() for m in set(c.mounts.values()))
