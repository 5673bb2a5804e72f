"""More tries at the host's root file system from inside a sandbox (a red-team review of the root
switch; test_root_switch.py has the first ones): the classic chroot escape from every
mount of the sandbox, fds and /proc links of every process the sandbox sees, the mount, handle,
namespace and debugging calls. Each must leave the host's root out of reach."""
from __future__ import annotations

import pytest

from shoal import Sandbox

from .conftest import tool_layer


@pytest.fixture(scope="module")
def escape_layer(host, tmp_path_factory):
    return tool_layer(host, tmp_path_factory, "root_escape_more")


def test_no_way_up_to_the_host_root(host, base_image, escape_layer, host_marker, switch):
    with Sandbox.create(base_image, layers=[escape_layer], memory_mb=128, disk_mb=16, root=host.settings.root) as sb:
        out = sb.commands.run(["root_escape_more", str(host_marker)], timeout=30).stdout
        r = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
        assert r["marker_after"] == "no", out
        for k in ("proc_self_root_dotdot", "proc1_root_marker"):
            assert r[k] == "no", out
        assert r["outside"] == "0", out
        # init is not dumpable: no way into its root, cwd, program or fds
        for k in ("proc1_root_open", "proc1_cwd_open", "proc1_exe_open", "proc1_fd3_open"):
            assert r[k] != "ok", out
        for via in ("tmp", "shm", "root"):
            assert r[f"{via}_escape"] == "no" and r[f"{via}_fd_root"] == "no" and r[f"{via}_fd_proc"] == "no", out
        for k in ("setns_mnt", "setns_self_mnt", "unshare_mnt", "unshare_user", "name_to_handle_at",
                  "open_by_handle_at", "open_tree", "fsopen", "fspick", "mount_setattr", "statmount", "listmount",
                  "open_tree_attr", "mount_bind", "mount_move", "umount_root", "pivot_root", "ptrace_init",
                  "process_vm_readv", "pidfd_getfd", "io_uring_setup"):
            assert r[k] != "ok", (k, out)


def test_the_mount_table_names_no_host_path(host, base_image, switch):
    """Not only the mount points: no field of /proc/self/mountinfo (sources, options such as
    overlayfs's lowerdir=) names a path of the host (Shoal's root, the layers' mount points)."""
    with Sandbox.create(base_image, memory_mb=128, disk_mb=16, root=host.settings.root) as sb:
        text = sb.commands.run("cat /proc/self/mountinfo /proc/self/mounts").stdout
        assert str(host.settings.root) not in text, text
        assert "/var/" not in text and "/work/" not in text, text
