"""The create path stays O(1) in live sandboxes (docs/density-create.md): no per-sandbox mount in the
host mount namespace, one shared sysfs template bound read-only, and the upper still reachable by
the host (files API, snapshots, fork)."""
from __future__ import annotations

import os
from pathlib import Path

from shoal import Host, Sandbox
from shoal.backends.container.templates import SYSFS_TEMPLATE


def _host_mounts_under(path: Path) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f if line.split()[4].startswith(str(path) + "/")]


def test_live_sandboxes_add_no_mount_to_the_host_namespace(root, base_image):
    """Every clone(CLONE_NEWNS) copies the host's mount table: a mount per live sandbox there made
    each create O(N). 12 live sandboxes (tmpfs and ext4 uppers) leave the host's table untouched."""
    sbs = []
    try:
        for i in range(12):
            sbs.append(Sandbox.create(base_image, root=root, upper="disk" if i % 4 == 0 else "tmpfs", disk_mb=32))
        for sb in sbs:
            sb.commands.run("echo x > /tmp/x")
        sandboxes_dir = Host.get(root).settings.sandboxes_dir
        assert _host_mounts_under(sandboxes_dir) == []
    finally:
        for sb in sbs:
            sb.kill()


def test_upper_is_readable_by_the_host_and_snapshots_fork_work(root, base_image):
    host = Host.get(root)
    with Sandbox.create(base_image, root=root) as sb:
        sb.commands.run("mkdir -p /work && echo v1 > /work/state")
        upper = host.backend("container").upper_dir(sb.id)
        assert (upper / "work" / "state").read_text() == "v1\n"
        assert not str(upper).startswith(str(root))  # not a host mount point under the root
        snap = sb.snapshot()
        sb.commands.run("echo v2 > /work/state")
        with Sandbox.create(from_snapshot=snap, root=root) as restored:
            assert restored.files.read("/work/state") == "v1\n"
        res = sb.fork(2)
        try:
            assert res.ok
            for child in res.sandboxes:
                assert child.files.read("/work/state") == "v2\n"
                child.commands.run("echo mine > /work/state")
            assert sb.files.read("/work/state") == "v2\n"
        finally:
            res.kill_all()


def test_sandbox_sys_is_the_shared_read_only_sysfs_template(root, base_image):
    """/sys is a bind of the host's one sysfs template (no superblock per sandbox), read-only, and
    shows a network namespace with only `lo`, never the host's interfaces."""
    with Sandbox.create(base_image, root=root) as a, Sandbox.create(base_image, root=root) as b:
        dev = os.stat(SYSFS_TEMPLATE).st_dev
        for sb in (a, b):
            assert int(sb.commands.run("stat -c %d /sys").stdout) == dev
            assert sb.commands.run("ls /sys/class/net").stdout.split() == ["lo"]
            r = sb.commands.run("echo 1 > /sys/kernel/rcu_expedited; echo rc=$?; touch /sys/x 2>&1")
            assert "rc=1" in r.stdout and "Read-only file system" in r.stdout
            assert "ro" in sb.commands.run("grep ' /sys ' /proc/mounts").stdout.split()[3].split(",")


def test_masked_proc_dirs_are_binds_of_one_shared_empty_read_only_dir(root, base_image):
    """Hidden /proc directories (acpi, scsi, ...) are the host's one empty read-only tmpfs, bound:
    empty, unwritable, and the same superblock in every sandbox (not a new tmpfs each)."""
    from shoal.backends.container.templates import EMPTY_DIR

    masked = [d for d in ("acpi", "scsi", "driver") if os.path.isdir(f"/proc/{d}")]
    if not masked:
        import pytest

        pytest.skip("this host's /proc has none of the masked directories")
    dev = os.stat(EMPTY_DIR).st_dev
    with Sandbox.create(base_image, root=root) as a, Sandbox.create(base_image, root=root) as b:
        for sb in (a, b):
            for d in masked:
                assert int(sb.commands.run(f"stat -c %d /proc/{d}").stdout) == dev
                assert sb.commands.run(f"ls -A /proc/{d}").stdout == ""
                r = sb.commands.run(f"mkdir /proc/{d}/x 2>&1; touch /proc/{d}/y 2>&1; echo rc=$?")
                assert "Read-only file system" in r.stdout and "rc=1" in r.stdout


def test_cpu_quota_is_written_only_where_it_caps_something(root, base_image):
    """A quota write walks every task group on the host (O(live sandboxes)): cpu >= the host's cores
    writes none (the cgroup stays unlimited), a smaller cpu writes exactly the asked quota."""
    cores = len(os.sched_getaffinity(0))
    cg = Host.get(root).backend("container").cgroups
    d = cg._dir

    def quota(sid: str) -> int | None:
        if cg.version == 1:
            q = int((d("cpu", sid) / "cpu.cfs_quota_us").read_text())
            assert int((d("cpu", sid) / "cpu.cfs_period_us").read_text()) == 100_000
            return None if q == -1 else q
        q = (d("cpu", sid) / "cpu.max").read_text().split()[0]
        return None if q == "max" else int(q)

    with Sandbox.create(base_image, root=root, cpu=float(cores)) as full, \
            Sandbox.create(base_image, root=root, cpu=0.25) as small:
        assert quota(full.id) is None
        assert quota(small.id) == 25_000


def test_state_dir_count_matches_a_listing(root, base_image):
    """The host limit counts state dirs from the directory's link count (O(1)), not a listing."""
    be = Host.get(root).backend("container")
    sbs = [Sandbox.create(base_image, root=root) for _ in range(3)]
    try:
        assert be.state_dir_count() == len(os.listdir(be.settings.sandboxes_dir)) >= 3
    finally:
        for sb in sbs:
            sb.kill()
    assert be.state_dir_count() == len(os.listdir(be.settings.sandboxes_dir))


def test_the_template_mount_namespace_is_one_empty_read_only_mount(root, base_image):
    """What every sandbox's init copies instead of the host's mount table (docs/density-create.md):
    a namespace whose only mount is an empty, read-only tmpfs, so a walk out of the overlay there finds
    nothing of the host."""
    from shoal.backends.container.templates import MNTNS_FILE

    with Sandbox.create(base_image, root=root):  # makes the template if this host has none yet
        pass
    probe = ("import ctypes, json, os, sys\n"
             "proc = os.open('/proc/self', os.O_RDONLY | os.O_DIRECTORY)\n"
             "libc = ctypes.CDLL(None, use_errno=True)\n"
             "if libc.setns(os.open(sys.argv[1], os.O_RDONLY), 0x20000) != 0:\n"  # CLONE_NEWNS
             "    sys.exit(f'setns: {os.strerror(ctypes.get_errno())}')\n"
             "info = os.read(os.open('mountinfo', os.O_RDONLY, dir_fd=proc), 1 << 16).decode()\n"
             "try:\n"
             "    open('/x', 'w')\n"
             "    wrote = 'yes'\n"
             "except OSError as e:\n"
             "    wrote = e.strerror\n"
             "print(json.dumps({'mountinfo': info.splitlines(), 'ls': os.listdir('/'), 'wrote': wrote}))\n")
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", probe, str(MNTNS_FILE)], capture_output=True, text=True, check=True)
    r = json.loads(out.stdout)
    assert len(r["mountinfo"]) == 1, r
    f = r["mountinfo"][0].split()
    assert f[4] == "/" and f[f.index("-") + 1] == "tmpfs" and "ro" in f[5].split(","), r
    assert r["ls"] == [] and r["wrote"] == "Read-only file system", r


def test_launch_phases_account_for_the_whole_launch(root, base_image):
    """launch_phases() names every step of a launch, Python's and shoal-init's (supervisor and init),
    in order, each a non-negative duration, and together they cover the launch as timed around it:
    a slow create can be attributed to a step (docs/density.md, "The create tail")."""
    import time

    from shoal.backends.container.backend import LAUNCH_STEPS

    t0 = time.monotonic()
    with Sandbox.create(base_image, root=root) as sb:
        wall_ms = (time.monotonic() - t0) * 1e3
        phases = Host.get(root).backend("container").launch_phases(sb.id)
        assert tuple(phases) == LAUNCH_STEPS
        assert all(ms >= 0 for ms in phases.values()), phases
        # the steps are consecutive intervals of one clock: their sum is the launch, within the create
        assert 0.5 * wall_ms < sum(phases.values()) <= wall_ms, (phases, wall_ms)
        assert phases["rootfs"] > 0 and phases["clone"] > 0
