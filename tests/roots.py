"""Test helper: take a Shoal root down completely (sandboxes, layer mounts, files)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from shoal import Host


def wipe_root(d: Path) -> None:
    host = Host.get(d)
    for info in host.list():
        try:
            host.kill(info.id)
        except Exception:
            pass
    host.store.gc()
    for m in (d / "mnt").iterdir() if (d / "mnt").exists() else []:
        subprocess.run(["umount", "-l", str(m)], capture_output=True)
    shutil.rmtree(d, ignore_errors=True)
