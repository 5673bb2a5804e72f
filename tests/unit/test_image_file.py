"""portsockets.image_file: whether a path a sandbox process runs or maps as code is its image layers'
file, judged from the host by the sandbox's writable upper. A file on the sandbox's other mounts
(/dev and the /dev/shm on it, which allows exec; /proc; /sys) is never in the upper, and is none of the
layers' either (red-team review: an LD_PRELOAD library in /dev/shm counted as the image's code)."""
from __future__ import annotations

import os

from shoal.backends.container.portsockets import image_file


def test_files_on_the_sandboxs_own_mounts_are_not_the_images(tmp_path):
    upper = tmp_path / "upper"
    upper.mkdir()
    assert image_file(upper, "/usr/lib/chromium/chromium")
    assert image_file(upper, "/usr/lib/x86_64-linux-gnu/libc.so.6")
    for path in ("/dev/shm/x.so", "/dev/x.so", "/proc/self/fd/3", "/sys/kernel/x", "/usr/./lib/x.so",
                 "/usr/../dev/shm/x.so", "/memfd:x (deleted)", "relative/x.so"):
        assert not image_file(upper, path), path


def test_files_written_in_the_upper_are_not_the_images(tmp_path):
    upper = tmp_path / "upper"
    (upper / "usr/lib").mkdir(parents=True)
    (upper / "usr/lib/evil.so").write_bytes(b"")
    assert not image_file(upper, "/usr/lib/evil.so")
    assert image_file(upper, "/usr/lib/other.so")
    os.mknod(upper / "usr/bin", 0o600)  # a file (here: a node) where a directory was: all below is replaced
    assert not image_file(upper, "/usr/bin/x11vnc")
