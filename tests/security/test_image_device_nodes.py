"""An image may carry device nodes. The sandbox's root is uid 0 on the host, and overlayfs opens a
special file of a lower layer with the overlay mount's flags, not the layer mount's `nodev` (checked
by hand: a char 1:11 node in a nodev EROFS lower reads the host's /dev/kmsg through the overlay).
Probe: char 1:11 (/dev/kmsg: the host kernel's log, host-global, and writable by root)."""
from __future__ import annotations

import io
import os
import tarfile

KMSG = (1, 11)
PROBE = ("for d in kmsg; do if dd if=/opt/$d bs=4096 count=1 2>/dev/null | grep -q .; "
         "then echo OPENED $d; else echo refused $d; fi; done")


def test_a_tar_layer_s_device_nodes_are_left_out(host):
    """A registry's (or `shoal layer import`'s) tar layer: device nodes other than the 0/0 whiteout
    form are not extracted at all."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, kind, (maj, mi) in (("opt/kmsg", tarfile.CHRTYPE, KMSG), ("opt/disk", tarfile.BLKTYPE, (8, 0))):
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.devmajor, info.devminor = kind, 0o666, maj, mi
            tf.addfile(info)
        info = tarfile.TarInfo("opt/keep")
        info.size = 3
        tf.addfile(info, io.BytesIO(b"ok\n"))
    buf.seek(0)
    layer = host.store.build_from_tar(stream=buf, source="test:device-nodes").digest
    mnt = host.store.ensure_mounted([layer])[0]
    assert sorted(os.listdir(mnt / "opt")) == ["keep"]


def test_the_host_kernel_log_does_not_open_through_an_erofs_layer_s_node(host, base_image, make_sandbox,
                                                                         tmp_path):
    """A native EROFS layer (pushed by a tenant, pulled as is) keeps its device nodes. The read of
    /dev/kmsg through one is refused twice: by `nodev` on the sandbox's overlay, and by the dropped
    CAP_SYSLOG. A device that checks no capability is in test_device_nodes_in_images.py."""
    tree = tmp_path / "dev-tree"
    (tree / "opt").mkdir(parents=True)
    os.mknod(tree / "opt/kmsg", 0o20666, os.makedev(*KMSG))
    os.chmod(tree / "opt/kmsg", 0o666)
    layer = host.store.build_from_dir(tree, source="test:device-nodes-erofs").digest
    host.store.create_image("devnodes-erofs:1", ["busybox", layer])
    sb = make_sandbox("devnodes-erofs:1", memory_mb=128, disk_mb=16)
    r = sb.commands.run(PROBE)
    assert r.exit_code == 0, r.stderr
    assert "OPENED" not in r.stdout, r.stdout
