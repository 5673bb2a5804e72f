"""A minimal busybox root filesystem, the smallest useful base layer (demo, tests, benchmarks)."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from ..core.errors import BuildError

BUSYBOX_CANDIDATES = ("/bin/busybox", "/usr/bin/busybox")


def find_busybox() -> str:
    for p in BUSYBOX_CANDIDATES:
        if os.path.exists(p):
            return p
    found = shutil.which("busybox")
    if not found:
        raise BuildError("busybox not found: install busybox-static (make setup does it)")
    return found


def make_busybox_tree(dest: Path) -> Path:
    """Write a rootfs with a static busybox and one symlink per applet into `dest`."""
    bb = find_busybox()
    dest = Path(dest)
    for d in ("bin", "sbin", "usr/bin", "usr/sbin", "etc", "root", "tmp", "proc", "sys", "dev", "var/tmp", "work"):
        (dest / d).mkdir(parents=True, exist_ok=True)
    os.chmod(dest / "tmp", 0o1777)
    os.chmod(dest / "var/tmp", 0o1777)
    shutil.copy2(bb, dest / "bin/busybox")
    os.chmod(dest / "bin/busybox", 0o755)
    applets = subprocess.run([bb, "--list-full"], capture_output=True, text=True, check=True).stdout.split()
    for a in applets:
        link = dest / a
        if link.name == "busybox" or link.exists() or link.is_symlink():
            continue
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to("/bin/busybox")
    (dest / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n")
    (dest / "etc/group").write_text("root:x:0:\nnogroup:x:65534:\n")
    (dest / "etc/hosts").write_text("127.0.0.1 localhost\n::1 localhost\n")
    (dest / "etc/os-release").write_text('NAME="Shoal busybox"\nID=shoal-busybox\n')
    return dest
