"""pack_diff snapshots, restore, fork (identity rules, isolation, partial failure) and branching."""
from __future__ import annotations

import time

import pytest

from shoal import ImageNotFound, InvalidArgument, Sandbox


def test_snapshot_captures_changes_and_restores(root, base_image, host):
    with Sandbox.create(base_image, root=root, env={"SECRET": "parent-only"}) as sb:
        sb.commands.run("mkdir -p /work/repo && echo v1 > /work/repo/state && rm /etc/hosts && "
                        "echo residue > /work/answer.txt")
        snap = sb.snapshot(exclude=["work/answer.txt"])
        assert snap.layers[:-1] == list(sb.info().layers) and snap.layer == snap.layers[-1]
        assert sb.commands.run("cat /work/repo/state").stdout == "v1\n"  # the source keeps running
        sb.commands.run("echo v2 > /work/repo/state")
        with Sandbox.create(from_snapshot=snap.id, root=root) as restored:
            assert restored.id != sb.id
            assert restored.files.read("/work/repo/state") == "v1\n"  # state at snapshot time
            assert not restored.files.exists("/etc/hosts")  # deletions (whiteouts) carried
            assert not restored.files.exists("/work/answer.txt")  # residue excluded
            assert "SECRET" not in restored.commands.run("env").stdout


def test_snapshot_freezes_processes_while_capturing(root, base_image):
    with Sandbox.create(base_image, root=root) as sb:
        # the writer replaces /c atomically; the snapshot is crash-consistent, so /c is always whole
        h = sb.commands.start("i=0; while true; do i=$((i+1)); echo $i > /c.tmp; mv /c.tmp /c; done")
        time.sleep(0.2)
        for _ in range(5):
            snap = sb.snapshot()
            assert sb.info().state.value == "running"  # thawed afterwards
            with Sandbox.create(from_snapshot=snap, root=root) as r:
                first = r.files.read("/c")
                assert first.strip().isdigit() and first.endswith("\n")
                time.sleep(0.05)
                assert r.files.read("/c") == first  # nothing runs in the restored copy
        h.kill()


def test_fork_children_are_isolated_with_fresh_identity(root, base_image):
    with Sandbox.create(base_image, root=root, env={"TOKEN": "abc"}, ttl=600, memory_mb=200) as parent:
        parent.commands.run("echo base > /data.txt; echo 00000000000000000000000000000000 > /etc/machine-id")
        res = parent.fork(3)
        try:
            assert res.ok and len(res.sandboxes) == 3
            kids = res.sandboxes
            ids = {k.id for k in kids}
            assert len(ids) == 3 and parent.id not in ids
            hosts = {k.commands.run("hostname").stdout.strip() for k in kids}
            assert hosts == ids
            machine_ids = {k.files.read("/etc/machine-id").strip() for k in kids}
            assert len(machine_ids) == 3 and "0" * 32 not in machine_ids
            for k in kids:
                info = k.info()
                assert "TOKEN" not in info.env and info.ttl is None  # not copied unless asked
                assert info.limits.memory_mb == 200
                assert k.files.read("/data.txt") == "base\n"
            kids[0].commands.run("echo child0 > /data.txt")
            assert kids[1].files.read("/data.txt") == "base\n"
            assert parent.files.read("/data.txt") == "base\n"
            parent.commands.run("echo parent > /data.txt")
            assert kids[2].files.read("/data.txt") == "base\n"
            assert "sleep" not in kids[0].commands.run("ps").stdout  # processes are not carried
        finally:
            res.kill_all()


def test_fork_copies_env_and_ttl_only_when_asked(root, base_image):
    with Sandbox.create(base_image, root=root, env={"TOKEN": "abc"}, ttl=600) as parent:
        res = parent.fork(1, copy_env=True, inherit_ttl=True)
        try:
            kid = res.sandboxes[0].info()
            assert kid.env["TOKEN"] == "abc" and kid.ttl is not None and kid.ttl <= 600
        finally:
            res.kill_all()


def test_fork_reports_partial_failure_per_child(root, base_image, host):
    with Sandbox.create(base_image, root=root) as parent:
        rt = host.backend("container")
        saved = rt.max_sandboxes
        import os

        rt.max_sandboxes = len(os.listdir(host.settings.sandboxes_dir)) + 2  # room for two children
        try:
            res = parent.fork(4)
        finally:
            rt.max_sandboxes = saved
        try:
            assert len(res.sandboxes) == 2 and [i for i, _ in res.failed] == [2, 3]
            assert not res.ok and all("limit" in str(e) for _, e in res.failed)
            assert all(k.commands.run("echo up").stdout == "up\n" for k in res.sandboxes)
        finally:
            res.kill_all()


def test_branching_to_any_depth_folds_deep_stacks(root, base_image, host):
    sb = Sandbox.create(base_image, root=root)
    base_depth = len(sb.info().layers)
    limit = host.settings.max_stack_depth
    try:
        for level in range(limit + 2):
            sb.commands.run(f"echo {level} >> /history; rm -f /gone-{level - 1}; touch /gone-{level}")
            res = sb.fork(1)
            assert res.ok
            sb.kill()
            sb = res.sandboxes[0]
            assert len(sb.info().layers) <= limit
        hist = sb.files.read("/history").split()
        assert hist == [str(i) for i in range(limit + 2)]
        names = {e.name for e in sb.files.list("/")}
        assert f"gone-{limit + 1}" in names and not any(n.startswith("gone-") and n != f"gone-{limit + 1}"
                                                        for n in names)
        assert len(sb.info().layers) == limit > base_depth
    finally:
        sb.kill()


def test_bad_snapshot_references(root, base_image):
    with pytest.raises(InvalidArgument, match="snapshot id"):
        Sandbox.create(from_snapshot="nope", root=root)
    with pytest.raises(ImageNotFound):
        Sandbox.create(from_snapshot="snap-000000000000", root=root)
    with pytest.raises(InvalidArgument, match="not both"):
        Sandbox.create(base_image, from_snapshot="snap-000000000000", root=root)
    with Sandbox.create(base_image, root=root) as sb:
        with pytest.raises(InvalidArgument):
            sb.fork(0)


def test_cli_snapshot_fork_and_fold(root, base_image, host):
    import os
    import subprocess
    import sys

    env = dict(os.environ, SHOAL_ROOT=str(root))
    shoal = [sys.executable, "-m", "shoal.cli"]
    with Sandbox.create(base_image, root=root) as sb:
        sb.commands.run("echo cli > /cli.txt")
        r = subprocess.run(shoal + ["snapshot", sb.id], env=env, capture_output=True, text=True)
        assert r.returncode == 0 and r.stdout.startswith("snap-")
        snap_id = r.stdout.split()[0]
        r = subprocess.run(shoal + ["fork", sb.id, "-n", "2"], env=env, capture_output=True, text=True)
        kids = r.stdout.split()
        assert r.returncode == 0 and len(kids) == 2 and all(k.startswith("sb-") for k in kids)
        for k in kids:
            assert Sandbox.connect(k, root=root).files.read("/cli.txt") == "cli\n"
            host.backend("container").kill(k)
    r = subprocess.run(shoal + ["image", "fold", f"snapshots/{snap_id}", "--to", "folded:1", "--threshold-mb", "100"],
                       env=env, capture_output=True, text=True)
    assert r.returncode == 0 and "-> 1 layers" in r.stdout
    with Sandbox.create("folded:1", root=root) as sb:
        assert sb.files.read("/cli.txt") == "cli\n"
