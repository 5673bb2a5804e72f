"""The sandbox's root switch (pivot_root, then the old root detached; docs/density-create.md weighs an
MS_MOVE + chroot instead) must leave nothing of the host's file system reachable from inside. These
tests try, as root in the sandbox, to reach a marker file on the host's root file system."""
from __future__ import annotations

import secrets
import subprocess
from pathlib import Path

import pytest

from shoal import Sandbox

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def escape_layer(host, tmp_path_factory):
    d = tmp_path_factory.mktemp("root-escape")
    (d / "usr/local/bin").mkdir(parents=True)
    subprocess.run(["gcc", "-static", "-O1", "-o", str(d / "usr/local/bin/root_escape"), str(HERE / "root_escape.c")],
                   check=True)
    return host.store.build_from_dir(d, name="security-root-escape").digest


@pytest.fixture
def host_marker():
    """A file on the host's root file system itself (not on /tmp or /run, which are mounts of their own
    that the sandbox's namespace detaches): what sits under the sandbox's overlay."""
    path = Path("/") / f".shoal-escape-{secrets.token_hex(4)}"
    path.write_text("host")
    try:
        yield path
    finally:
        path.unlink()


def _run(sb, *argv: str) -> dict[str, str]:
    out = sb.commands.run(list(argv), timeout=20).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def test_the_host_root_under_the_sandbox_root_is_unreachable(host, base_image, escape_layer, host_marker):
    with Sandbox.create(base_image, layers=[escape_layer], memory_mb=128, disk_mb=16, root=host.settings.root) as sb:
        r = _run(sb, "root_escape", str(host_marker))
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
