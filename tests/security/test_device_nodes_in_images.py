"""A tenant's native EROFS layer is taken as it is, device nodes included, and overlayfs opens a lower
layer's special file with the overlay mount's flags (not the layer mount's `nodev`). Sandbox root is
uid 0 on the host, so without `nodev` on the rootfs overlay a node in an image opens the host device
it names: input devices, GPUs, /dev/kvm, /dev/uinput. The probe is char 1:5 (/dev/zero): harmless,
and any node that opens proves the hole (checked: it opened before the overlay was nodev)."""
from __future__ import annotations

import os

ZERO = os.makedev(1, 5)


def test_a_device_node_in_an_image_layer_does_not_open_in_the_sandbox(host, make_sandbox, tmp_path):
    tree = tmp_path / "dev-tree"
    (tree / "opt").mkdir(parents=True)
    os.mknod(tree / "opt/zero", 0o20666, ZERO)
    os.chmod(tree / "opt/zero", 0o666)
    layer = host.store.build_from_dir(tree, source="test:device-node-layer").digest
    host.store.create_image("devnode-layer:1", ["busybox", layer])
    sb = make_sandbox("devnode-layer:1", memory_mb=64, disk_mb=16)
    listed = sb.commands.run("ls -l /opt/zero")
    assert listed.stdout.startswith("c"), listed  # the node is there, as the image has it
    r = sb.commands.run("dd if=/opt/zero of=/dev/null bs=4 count=1")
    assert r.exit_code != 0 and "Permission denied" in r.stderr, r
    # the sandbox's own /dev still works: it is a separate mount
    ok = sb.commands.run("dd if=/dev/zero of=/dev/null bs=4 count=1")
    assert ok.exit_code == 0, ok
