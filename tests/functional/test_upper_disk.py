"""upper="disk": the writable upper on an ext4 file system (loop device, image under the Shoal root)
instead of a tmpfs. The disk quota holds (ENOSPC past disk_mb), the upper's pages are not pinned in
the sandbox's memory, snapshots and fork work on it, and nothing is left behind after any ending."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from shoal import Host, Sandbox
from shoal.core.contract import CreateRequest, Limits


def _disk(**kw) -> dict:
    return dict(upper="disk", **kw)


def _upper_fs(root: Path, sandbox_id: str) -> str:
    """The file system type under the sandbox's upper, as the host reaches it (the upper is mounted
    in no host mount namespace: its supervisor holds it; see docs/density-create.md)."""
    upper = Host.get(root).backend("container").upper_dir(sandbox_id)
    out = subprocess.run(["stat", "-f", "-c", "%T", str(upper)], capture_output=True, text=True, check=True)
    return {"ext2/ext3": "ext4"}.get(out.stdout.strip(), out.stdout.strip())


def _loops_of(root: Path) -> list[str]:
    out = subprocess.run(["losetup", "-a"], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if str(root) in line]


def _leftovers(root: Path, sandbox_id: str) -> dict:
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split()[4] for line in f if sandbox_id in line]
    images = [p.name for p in (root / "uppers").iterdir() if not p.name.startswith("template-")] \
        if (root / "uppers").exists() else []
    return {"mounts": mounts, "loops": [line for line in _loops_of(root) if sandbox_id in line],
            "images": images, "state_dir": (root / "sandboxes" / sandbox_id).exists()}


def _wait_clean(root: Path, sandbox_id: str, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        left = _leftovers(root, sandbox_id)
        if not any(left.values()) or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def test_disk_upper_is_ext4_on_a_loop_device_and_enforces_disk_mb(root, base_image):
    with Sandbox.create(base_image, root=root, **_disk(disk_mb=64, memory_mb=256)) as sb:
        assert sb.info().limits.upper == "disk"
        assert _upper_fs(root, sb.id) == "ext4"
        upper = Host.get(root).backend("container").upper_dir(sb.id)
        assert os.major(upper.stat().st_dev) == 7  # a loop device
        # the image file is already unlinked: the loop device holds it
        assert next(line for line in _loops_of(root) if sb.id in line).endswith("(deleted))")
        r = sb.commands.run("dd if=/dev/zero of=/fill bs=1M count=100 2>&1; echo rc=$?", timeout=60)
        assert "No space left on device" in r.stdout and "rc=1" in r.stdout
        size = int(sb.commands.run("wc -c < /fill").stdout)
        # ext4 metadata takes a few percent of disk_mb; the rest is usable, nothing more
        assert 56 * 2**20 <= size <= 64 * 2**20
        sb.commands.run("rm /fill")
        assert sb.commands.run("echo again > /a && cat /a").stdout == "again\n"  # space comes back


def test_tmpfs_upper_is_still_the_default(root, base_image):
    with Sandbox.create(base_image, root=root, disk_mb=32) as sb:
        assert sb.info().limits.upper == "tmpfs"
        assert _upper_fs(root, sb.id) == "tmpfs"


def test_disk_upper_pages_are_not_pinned_in_sandbox_memory(root, base_image):
    """128 MiB written by a 64 MiB sandbox: fits on a disk upper (page cache is reclaimable);
    on a tmpfs upper the same file is memory the cgroup cannot reclaim without swap."""
    cmd = "dd if=/dev/zero of=/work.bin bs=1M count=128 2>/dev/null && sync && wc -c < /work.bin"
    with Sandbox.create(base_image, root=root, **_disk(disk_mb=256, memory_mb=64)) as sb:
        r = sb.commands.run(cmd, timeout=120)
        assert r.exit_code == 0 and int(r.stdout) == 128 * 2**20
    with open("/proc/meminfo") as f:
        swap = int(next(line for line in f if line.startswith("SwapTotal")).split()[1])
    if swap == 0:
        with Sandbox.create(base_image, root=root, disk_mb=256, memory_mb=64) as sb:
            r = sb.commands.run(cmd, timeout=120)
            assert r.exit_code != 0  # OOM-killed or ENOMEM: tmpfs pages count against memory_mb


def test_snapshot_restore_and_fork_from_a_disk_upper(root, base_image):
    with Sandbox.create(base_image, root=root, **_disk(disk_mb=64)) as sb:
        sb.commands.run("mkdir -p /work && echo v1 > /work/state && rm /etc/hosts")
        snap = sb.snapshot()
        sb.commands.run("echo v2 > /work/state")
        with Sandbox.create(from_snapshot=snap, root=root) as restored:
            assert restored.files.read("/work/state") == "v1\n"
            assert not restored.files.exists("/etc/hosts")  # the whiteout on ext4 is carried
        res = sb.fork(2)
        try:
            assert res.ok and len(res.sandboxes) == 2
            for child in res.sandboxes:
                assert child.info().limits.upper == "disk"  # children keep the parent's upper kind
                assert _upper_fs(root, child.id) == "ext4"
                assert child.files.read("/work/state") == "v2\n"
                child.commands.run("echo mine > /work/state")
            assert sb.files.read("/work/state") == "v2\n"  # children's uppers are their own
        finally:
            res.kill_all()
        # a child of a disk-upper parent can still choose a tmpfs
        res = sb.fork(1, upper="tmpfs")
        try:
            assert res.ok and res.sandboxes[0].info().limits.upper == "tmpfs"
        finally:
            res.kill_all()


@pytest.mark.parametrize("ending", ["kill", "ttl", "supervisor_killed"])
def test_nothing_left_after_the_sandbox_ends(root, base_image, host, ending):
    sb = Sandbox.create(base_image, root=root, **_disk(disk_mb=32), ttl=1.0 if ending == "ttl" else None)
    sid = sb.id
    sb.commands.run("head -c 4000000 /dev/urandom > /blob")
    assert _leftovers(root, sid)["loops"]
    if ending == "kill":
        sb.kill()
    elif ending == "ttl":
        time.sleep(1.5)
    else:  # host crash of the supervisor: the sweep must release the ext4 mount and its loop device
        meta = host.backend("container")._load(sid)
        os.kill(meta["sup_pid"], signal.SIGKILL)
        deadline = time.monotonic() + 10  # a loaded host may take a while to finish the killed process
        while sid not in (swept := host.backend("container").sweep()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert sid in swept
    assert _wait_clean(root, sid) == {"mounts": [], "loops": [], "images": [], "state_dir": False}


def test_bad_upper_is_a_clear_error():
    with pytest.raises(ValidationError, match="upper"):
        CreateRequest(upper="nfs")
    with pytest.raises(ValidationError, match="upper"):
        Limits(upper="ramdisk")


def test_sweep_removes_an_image_left_by_a_crash_before_its_unlink(root, host):
    uppers = root / "uppers"
    uppers.mkdir(exist_ok=True)
    stale, fresh = uppers / "sb-crashed-000000.img", uppers / "sb-starting-000000.img"
    stale.write_bytes(b"\0" * 4096)
    fresh.write_bytes(b"\0" * 4096)
    old = time.time() - 3600
    os.utime(stale, (old, old))
    host.backend("container").sweep()
    assert not stale.exists()
    assert fresh.exists()  # a create in flight (copied, not yet mounted) is left alone
    fresh.unlink()
