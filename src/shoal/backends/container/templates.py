"""Host-wide mounts that every container sandbox binds instead of mounting its own copy.

A per-sandbox mount of a kernel file system can cost O(live sandboxes): mounting sysfs in a new
network namespace makes a new superblock, and the kernel's sget() compares it against every sysfs
superblock already there. So the host mounts one template, once, and each sandbox's init binds it
(a bind creates a mount, not a superblock, and walks nothing). See docs/density-create.md.

  /run/shoal/sysfs   sysfs of an empty network namespace, read-only: the sandbox's /sys (its
                     /sys/class/net shows only `lo`, as its own would);
  /run/shoal/netns   that namespace, held alive by a bind of its nsfs file (sysfs alone holds only
                     a passive reference: the namespace would be torn down, `lo` with it);
  /run/shoal/empty   an empty read-only tmpfs, bound over the /proc directories a sandbox must not
                     see (acpi, scsi, ...) instead of a new tmpfs per directory per sandbox;
  /run/shoal/ns/mnt  the template mount namespace, held by a bind of its nsfs file (in a private bind
                     of /run/shoal/ns: such a bind may not propagate): its one mount is an empty
                     read-only tmpfs. A sandbox's init copies it instead of the host's mount table and
                     chroots into its overlay there, instead of pivot_root, which walks every task on
                     the host. SHOAL_ROOT_SWITCH=pivot_root keeps the old way (and the kernel does,
                     where it cannot build the overlay detached: before Linux 6.15).

The templates live in /run (lost at reboot, re-made on the next create) and are shared by every
Shoal root on the host: they hold nothing of any sandbox.
"""
from __future__ import annotations

import ctypes
import fcntl
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

from ...core.errors import SandboxError

TEMPLATE_DIR = Path("/run/shoal")
SYSFS_TEMPLATE = TEMPLATE_DIR / "sysfs"
NETNS_FILE = TEMPLATE_DIR / "netns"
EMPTY_DIR = TEMPLATE_DIR / "empty"
MNTNS_FILE = TEMPLATE_DIR / "ns" / "mnt"
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_SYSFS_MAGIC_FILE = "kernel"  # every sysfs has /sys/kernel; an empty mount point has nothing


def _is_sysfs_mount(path: Path) -> bool:
    return os.path.ismount(path) and (path / _SYSFS_MAGIC_FILE).is_dir()


def _is_empty_ro_mount(path: Path) -> bool:
    return os.path.ismount(path) and not os.access(path, os.W_OK) and not os.listdir(path)


def _ensure(path: Path, present: Callable[[Path], bool], make: Callable[[], None]) -> Path:
    """`path` as `present` says it should be, made now by `make` if it is not (cheap when it is)."""
    if present(path):
        return path
    TEMPLATE_DIR.mkdir(parents=True, exist_ok=True)
    # one creator at a time, across processes (tests, a daemon and a benchmark may share the host)
    with open(TEMPLATE_DIR / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not present(path):
            make()
    return path


def ensure_sysfs_template(helper: str) -> Path:
    """The sysfs template, mounted now if it is not (two stats per create when it is)."""
    def make() -> None:
        proc = subprocess.run([helper, "sysfs-template", str(SYSFS_TEMPLATE), str(NETNS_FILE)],
                              capture_output=True, text=True, stdin=subprocess.DEVNULL, env={})
        if proc.returncode != 0 or not _is_sysfs_mount(SYSFS_TEMPLATE):
            raise SandboxError(f"cannot mount the sysfs template at {SYSFS_TEMPLATE}: "
                               f"{proc.stderr.strip() or 'not a sysfs mount afterwards'}")
    return _ensure(SYSFS_TEMPLATE, _is_sysfs_mount, make)


def ensure_empty_dir() -> Path:
    """An empty, read-only tmpfs (size 0) at EMPTY_DIR, mounted now if it is not."""
    def make() -> None:
        EMPTY_DIR.mkdir(mode=0o555, exist_ok=True)
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.mount(b"tmpfs", str(EMPTY_DIR).encode(), b"tmpfs",
                      _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, b"size=0,mode=0555") != 0:
            err = ctypes.get_errno()
            raise SandboxError(f"cannot mount the empty template at {EMPTY_DIR}: {os.strerror(err)}")
    return _ensure(EMPTY_DIR, _is_empty_ro_mount, make)


def _is_ns_bind(path: Path) -> bool:
    """A bind of an nsfs file (its device is nsfs's, not its directory's)."""
    try:
        return path.stat().st_dev != path.parent.stat().st_dev
    except FileNotFoundError:
        return False


def ensure_mntns_template(helper: str) -> Path | None:
    """The template mount namespace's file, made now if it is not there (two stats per create when it
    is); None where SHOAL_ROOT_SWITCH=pivot_root asks for the old root switch."""
    if os.environ.get("SHOAL_ROOT_SWITCH") == "pivot_root":
        return None

    def make() -> None:
        proc = subprocess.run([helper, "mntns-template", str(MNTNS_FILE)],
                              capture_output=True, text=True, stdin=subprocess.DEVNULL, env={})
        if proc.returncode != 0 or not _is_ns_bind(MNTNS_FILE):
            raise SandboxError(f"cannot make the template mount namespace at {MNTNS_FILE}: "
                               f"{proc.stderr.strip() or 'not a namespace file afterwards'}")
    return _ensure(MNTNS_FILE, _is_ns_bind, make)
