"""Superblocks per sandbox (issue 16): each one registers a memcg-aware shrinker, and every shrinker id
widens the shrinker_info of every memory cgroup on the host, so a sandbox's superblocks cost kernel
memory in proportion to all sandboxes (docs/density.md, "Where the kernel memory goes"). /dev/shm is a
directory of the /dev tmpfs, with its own mount flags, not a tmpfs of its own."""
from __future__ import annotations

from pathlib import Path

from shoal import Sandbox


def own_superblocks(pid: int) -> dict[str, str]:
    """dev id -> fs type of the mounts in the process's namespace that the host's namespace lacks."""
    host = {line.split()[2] for line in Path("/proc/self/mountinfo").read_text().splitlines()}
    out = {}
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        f = line.split()
        if f[2] not in host:
            out[f[2]] = f[f.index("-") + 1]
    return out


def mount_opts(pid: int, target: str) -> tuple[str, set[str]]:
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        f = line.split()
        if f[4] == target:
            return f[2], set(f[5].split(","))
    raise AssertionError(f"{target} is not a mount point")


def test_dev_shm_shares_the_dev_tmpfs_and_keeps_its_own_flags(host, base_image):
    with Sandbox.create(base_image, memory_mb=128, disk_mb=16, root=host.settings.root) as sb:
        pid = sb.info().init_pid
        assert pid
        sbs = own_superblocks(pid)
        # the overlay root, /dev (with /dev/shm in it), /dev/pts, /proc; the upper tmpfs is detached
        assert sorted(sbs.values()) == ["devpts", "overlay", "proc", "tmpfs"], sbs
        dev_id, dev_opts = mount_opts(pid, "/dev")
        shm_id, shm_opts = mount_opts(pid, "/dev/shm")
        assert shm_id == dev_id
        assert {"nosuid", "noexec"} <= dev_opts
        assert {"nosuid", "nodev"} <= shm_opts and "noexec" not in shm_opts, shm_opts
        r = sb.commands.run("stat -c %a /dev/shm && echo hi > /dev/shm/x && cat /dev/shm/x && "
                            "cp /bin/busybox /dev/shm/busybox && /dev/shm/busybox true && echo ran")
        assert r.stdout.split() == ["1777", "hi", "ran"], (r.stdout, r.stderr)
        # the space is bounded: the tmpfs is 64 MiB of shm + 1 MiB of /dev
        r = sb.commands.run("dd if=/dev/zero of=/dev/shm/big bs=1M count=100 2>&1; ls -l /dev/shm/big")
        size = int(r.stdout.split()[-5])
        assert 60 << 20 <= size <= 66 << 20, r.stdout
        # the devices still work, and no device node can be made to work under /dev/shm
        assert sb.commands.run("echo x > /dev/null && head -c 4 /dev/urandom | wc -c").stdout.strip() == "4"
