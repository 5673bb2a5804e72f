"""The sandbox's root switch (pivot_root, then the old root detached; docs/density-create.md weighs an
MS_MOVE + chroot instead) must leave nothing of the host's file system reachable from inside. These
tests try, as root in the sandbox, to reach a marker file on the host's root file system."""
from __future__ import annotations

import pytest

from shoal import Sandbox

from .conftest import tool_layer, tool_results


@pytest.fixture(scope="module")
def escape_layer(host, tmp_path_factory):
    return tool_layer(host, tmp_path_factory, "root_escape")


def test_the_host_root_under_the_sandbox_root_is_unreachable(host, base_image, escape_layer, host_marker):
    with Sandbox.create(base_image, layers=[escape_layer], memory_mb=128, disk_mb=16, root=host.settings.root) as sb:
        r = tool_results(sb, ["root_escape", str(host_marker)])
        assert r["dotdot"] == "no", r
        # CAP_SYS_CHROOT is kept (Docker's default set), so the chroot itself works; the walk up stops
        # at the overlay's root, the namespace's root
        assert r["chroot_escape_chroot"] == "ok", r
        assert r["chroot_escape"] == "no", r
        assert r["umount_root"] != "ok" and r["after_umount"] == "no", r
        assert r["bin_busybox"] == "yes", r  # still inside the sandbox's own root


def test_the_sandbox_mount_table_shows_none_of_the_host(host, base_image):
    with Sandbox.create(base_image, memory_mb=128, disk_mb=16, root=host.settings.root) as sb:
        lines = sb.commands.run("cat /proc/self/mountinfo").stdout.splitlines()
        points = [line.split()[4] for line in lines]
        fstypes = {line.split()[4]: line.split(" - ")[1].split()[0] for line in lines}
        assert fstypes["/"] == "overlay", lines
        host_only = {"/var", "/home", "/boot", "/run/shoal", str(host.settings.root)}
        assert not host_only & set(points), points
        assert all(p == "/" or p.startswith(("/dev", "/proc", "/sys", "/tmp")) for p in points), points
        assert len(points) < 40, points
        # "/.." is "/"
        assert sb.commands.run("ls /.. | sort").stdout == sb.commands.run("ls / | sort").stdout
