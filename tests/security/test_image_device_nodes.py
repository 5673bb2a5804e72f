"""An image (pulled from a registry, imported from a tar) may carry device nodes: a layer tar is
extracted as it is (Docker does the same). The sandbox's root is uid 0 on the host, so a block node
naming the host's own disk, planted by the image's author, must not open inside the sandbox."""
from __future__ import annotations

import io
import os
import tarfile

import pytest


def _host_disk() -> tuple[int, int]:
    st = os.stat("/")
    return os.major(st.st_dev), os.minor(st.st_dev)


@pytest.fixture
def device_image(host, base_image):
    major, minor = _host_disk()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, kind, maj, mi in (("opt/disk", tarfile.BLKTYPE, major, minor),
                                    ("opt/kmem", tarfile.CHRTYPE, 1, 2),  # /dev/kmem's numbers
                                    ("opt/kmsg", tarfile.CHRTYPE, 1, 11)):
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.devmajor, info.devminor = kind, 0o666, maj, mi
            tf.addfile(info)
    buf.seek(0)
    layer = host.store.build_from_tar(stream=buf, source="test:device-nodes").digest
    host.store.create_image("devnodes:1", ["busybox", layer])
    return "devnodes:1"


def test_a_device_node_from_an_image_does_not_open_in_the_sandbox(make_sandbox, device_image):
    sb = make_sandbox(device_image, memory_mb=128, disk_mb=16)
    r = sb.commands.run("ls -l /opt; for d in disk kmem kmsg; do "
                        "if head -c 16 /opt/$d >/dev/null 2>&1; then echo OPENED $d; else echo refused $d; fi; done")
    assert r.exit_code == 0, r.stderr
    assert "OPENED" not in r.stdout, r.stdout
    assert r.stdout.count("refused") == 3, r.stdout
