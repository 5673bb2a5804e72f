"""Test helper: take a Shoal root down completely (sandboxes, layer mounts, files)."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from shoal import Host
from shoal.core.errors import BackendUnavailable


def wipe_root(d: Path) -> None:
    host = Host.get(d)
    for info in host.list():
        try:
            host.kill(info.id)
        except Exception:
            pass
    try:  # a gVisor kill returns at once and releases in the background: let it finish first
        host.backend("gvisor").wait_released(20)  # type: ignore[attr-defined]  # gvisor-only helper
    except (BackendUnavailable, ImportError):
        pass
    host.store.gc()
    for m in (d / "mnt").iterdir() if (d / "mnt").exists() else []:
        subprocess.run(["umount", "-l", str(m)], capture_output=True)
    from shoal.lazy import mount as lazy_mount

    lazy_mount.stop_daemon(d)  # before the files go: a daemon still starting waits on its marker there
    shutil.rmtree(d, ignore_errors=True)


def teardown_root(d: Path) -> None:
    """Take a root down with its lazy daemon and mounts (its daemon log is printed: a failing test shows it)."""
    from shoal.lazy import mount as lazy_mount

    log = d / "lazy/daemon.log"
    if log.exists():
        print(f"--- {log}\n" + log.read_text(errors="replace")[-3000:])
    try:
        wipe_root(d)  # kills sandboxes, gc (unmounts layers, stops the lazy daemon)
    finally:
        for m in (d / "mnt").iterdir() if (d / "mnt").exists() else []:
            os.system(f"umount -l {m} 2>/dev/null")
        lazy_mount.stop_daemon(d)
        shutil.rmtree(d, ignore_errors=True)
