"""The sandbox's root switch must leave nothing of the host's file system reachable from inside. There
are two (docs/density-create.md): by default init copies the host's template mount namespace (one
empty read-only tmpfs), moves its overlay onto that namespace's "/" and chroots into it; with
SHOAL_ROOT_SWITCH=pivot_root (and on kernels that cannot build the overlay detached, before 6.15) it
copies the host's namespace, pivot_roots and detaches the old root. These tests try, as root in the
sandbox, to reach a marker file on the host's root file system, under each switch."""
from __future__ import annotations

import os

import pytest

from shoal import Sandbox

from .conftest import template_switch_kernel, tool_layer, tool_results


@pytest.fixture(scope="module")
def escape_layer(host, tmp_path_factory):
    return tool_layer(host, tmp_path_factory, "root_escape")


# Joins a sandbox's mount namespace (the caller's root becomes the top of what covers the namespace's
# root: the overlay), takes the overlay off the namespace (MNT_DETACH), joins again and looks at what
# was under it. A throwaway sandbox only: its processes keep their root, but their mount table is gone.
_UNDER_THE_ROOT = """
import ctypes, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
tmpl, sandbox = os.open(sys.argv[1], os.O_RDONLY), os.open(sys.argv[2], os.O_RDONLY)
def enter(fd):
    if libc.setns(fd, 0x20000) != 0:  # CLONE_NEWNS
        sys.exit(f"setns: {os.strerror(ctypes.get_errno())}")
enter(tmpl)
t = os.stat("/")
enter(sandbox)
top = os.stat("/")
if libc.umount2(b"/", 2) != 0:  # MNT_DETACH
    sys.exit(f"umount2: {os.strerror(ctypes.get_errno())}")
enter(sandbox)
under = os.stat("/")
print(json.dumps({"top_is_template": [top.st_dev, top.st_ino] == [t.st_dev, t.st_ino],
                  "under_is_template": [under.st_dev, under.st_ino] == [t.st_dev, t.st_ino],
                  "under_ls": os.listdir("/")}))
"""


def test_the_host_root_under_the_sandbox_root_is_unreachable(host, base_image, escape_layer, host_marker, switch):
    with Sandbox.create(base_image, layers=[escape_layer], memory_mb=128, disk_mb=16, root=host.settings.root) as sb:
        r = tool_results(sb, ["root_escape", str(host_marker)])
        assert r["dotdot"] == "no", r
        # CAP_SYS_CHROOT is kept (Docker's default set), so the chroot itself works; the walk up stops
        # at the overlay's root: the namespace's root (pivot_root), or the mount on the template's
        # root, which ".." crosses back into
        assert r["chroot_escape_chroot"] == "ok", r
        assert r["chroot_escape"] == "no", r
        # at worst the template's empty root; never anything else
        assert r["escape_at"] in ("sandbox_root", "empty"), r
        assert r["umount_root"] != "ok" and r["after_umount"] == "no", r
        assert r["bin_busybox"] == "yes", r  # still inside the sandbox's own root


def test_under_the_sandbox_root_is_the_empty_template_or_what_pivot_root_left(host, base_image, switch):
    """Under the template switch, what the overlay covers in the sandbox's namespace is the template's
    empty root (the same tmpfs as /run/shoal/ns/mnt's root) and nothing else; under pivot_root it is not
    (a copy of the host's namespace root mount: the template switch was not used)."""
    import json
    import subprocess
    import sys

    from shoal.backends.container.templates import MNTNS_FILE

    if switch == "template" and not template_switch_kernel():
        pytest.skip(f"kernel {os.uname().release}: init falls back to pivot_root before 6.15")
    with Sandbox.create(base_image, memory_mb=128, disk_mb=16, root=host.settings.root) as sb:
        pid = sb.info().init_pid
        assert pid and MNTNS_FILE.exists()
        out = subprocess.run([sys.executable, "-c", _UNDER_THE_ROOT, str(MNTNS_FILE), f"/proc/{pid}/ns/mnt"],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        r = json.loads(out.stdout)
        assert not r["top_is_template"], r
        if switch == "template":
            assert r["under_is_template"] and r["under_ls"] == [], r
        else:
            assert not r["under_is_template"], r


def test_the_sandbox_mount_table_shows_none_of_the_host(host, base_image, switch):
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
        assert sb.commands.run("stat -c %d:%i /..").stdout == sb.commands.run("stat -c %d:%i /").stdout
