"""Building EROFS images (mkfs.erofs) and mounting them once per host.

Mounting prefers a file-backed EROFS mount through the new mount API (fsopen / fsconfig /
fsmount / move_mount, Linux >= 6.12) so no loop device is involved; older kernels (Debian 12's 6.1,
Ubuntu 22.04's 5.15) fall back to `mount -o loop`, whose loop device the kernel detaches by itself
(autoclear) when the mount goes away.

$SHOAL_EROFS_MOUNT forces one path: `loop` (what a pre-6.12 host does, testable on any host) or
`file-backed` (fail instead of falling back); unset or `auto` = try file-backed, then loop.
"""
from __future__ import annotations

import ctypes
import errno
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from ..core.errors import BuildError, InvalidArgument

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long

# generic syscall numbers, identical on x86_64 and aarch64
_SYS_MOVE_MOUNT, _SYS_FSOPEN, _SYS_FSCONFIG, _SYS_FSMOUNT = 429, 430, 431, 432
_FSOPEN_CLOEXEC = 0x1
_FSCONFIG_SET_FLAG, _FSCONFIG_SET_STRING, _FSCONFIG_CMD_CREATE = 0, 1, 6
_FSMOUNT_CLOEXEC = 0x1
_MOUNT_ATTR_RDONLY, _MOUNT_ATTR_NODEV = 0x1, 0x4
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
_AT_FDCWD = -100


def mkfs_available() -> bool:
    return shutil.which("mkfs.erofs") is not None


def build_image(src_dir: Path, out: Path, compression: str | None = None, exclude: Sequence[str] = ()) -> None:
    """Build an EROFS image of `src_dir` into `out` (xattrs and device nodes kept).

    `exclude`: paths relative to `src_dir` left out with their subtrees."""
    if not mkfs_available():
        raise BuildError("mkfs.erofs not found: install erofs-utils (make setup does it)")
    cmd = ["mkfs.erofs", "--quiet"]
    if compression:
        cmd.append(f"-z{compression}")
    cmd += [f"--exclude-path={p}" for p in exclude]
    cmd += [str(out), str(src_dir)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"mkfs.erofs failed for {src_dir}: {proc.stderr.strip() or proc.stdout.strip()}")


FSCK_TIMEOUT_S = 900


def fsck_image(image: Path) -> None:
    """Check an EROFS image from elsewhere (a registry's blob) in userspace before the kernel parses
    it: `fsck.erofs --extract` walks every inode and directory and decodes every file's data.
    A malformed image is BuildError; the host's kernel never mounts it."""
    if shutil.which("fsck.erofs") is None:
        raise BuildError("fsck.erofs not found: install erofs-utils (make setup does it); an EROFS image "
                         "from elsewhere is checked with it before it is mounted")
    try:
        proc = subprocess.run(["fsck.erofs", "--extract", str(image)], check=False, capture_output=True,
                              text=True, errors="replace", timeout=FSCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise BuildError(f"fsck.erofs of {image} ran past {FSCK_TIMEOUT_S} s: refused") from None
    if proc.returncode != 0:
        msg = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
        raise BuildError(f"{image} is not a well-formed EROFS image (fsck.erofs: {' | '.join(msg[-3:])})")


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def mount_file_backed(image: Path, target: Path, flags: Sequence[str] = ()) -> None:
    """Mount `image` read-only at `target` with the new mount API (no loop device). flags: EROFS flag
    options, e.g. ("directio",) (6.13+: read the backing file with direct I/O, so its page cache does
    not hold a second copy of what the mount's own page cache holds)."""
    sc = _libc.syscall
    fs_fd = _check(sc(_SYS_FSOPEN, b"erofs", _FSOPEN_CLOEXEC), "fsopen(erofs)")
    try:
        for flag in flags:
            _check(sc(_SYS_FSCONFIG, fs_fd, _FSCONFIG_SET_FLAG, flag.encode(), None, 0), f"fsconfig({flag})")
        _check(sc(_SYS_FSCONFIG, fs_fd, _FSCONFIG_SET_STRING, b"source", str(image).encode(), 0), "fsconfig(source)")
        _check(sc(_SYS_FSCONFIG, fs_fd, _FSCONFIG_CMD_CREATE, None, None, 0), "fsconfig(create)")
        mnt_fd = _check(sc(_SYS_FSMOUNT, fs_fd, _FSMOUNT_CLOEXEC, _MOUNT_ATTR_RDONLY | _MOUNT_ATTR_NODEV), "fsmount")
        try:
            _check(sc(_SYS_MOVE_MOUNT, mnt_fd, b"", _AT_FDCWD, str(target).encode(), _MOVE_MOUNT_F_EMPTY_PATH),
                   "move_mount")
        finally:
            os.close(mnt_fd)
    finally:
        os.close(fs_fd)


def mount_loop(image: Path, target: Path) -> None:
    # util-linux sets LO_FLAGS_AUTOCLEAR on the loop device it attaches: unmounting frees it
    proc = subprocess.run(["mount", "-t", "erofs", "-o", "ro,nodev,loop", str(image), str(target)],
                          check=False, capture_output=True, text=True)
    if proc.returncode != 0:
        raise OSError(f"loop mount of {image} failed: {proc.stderr.strip()}")


MOUNT_METHODS = ("auto", "file-backed", "loop")
# what a kernel without file-backed EROFS answers: it takes `source` for a block device path and
# fails with ENOTBLK (6.1's get_tree_bdev), EINVAL, or ENOSYS/ENODEV without the new API or erofs
_NO_FILE_BACKED = (errno.ENOTBLK, errno.EINVAL, errno.ENOSYS, errno.ENODEV)


def mount_mode() -> str:
    mode = os.environ.get("SHOAL_EROFS_MOUNT", "").strip().lower() or "auto"
    if mode not in MOUNT_METHODS:
        raise InvalidArgument(f"SHOAL_EROFS_MOUNT={mode!r}: expected one of {', '.join(MOUNT_METHODS)}")
    return mode


def mount_image(image: Path, target: Path) -> str:
    """Mount an EROFS image; returns the method used ("file-backed" or "loop")."""
    mode = mount_mode()
    if mode != "loop":
        try:
            mount_file_backed(image, target)
            return "file-backed"
        except OSError as e:
            if mode == "file-backed":
                raise OSError(e.errno, f"file-backed EROFS mount of {image} failed (SHOAL_EROFS_MOUNT="
                                       f"file-backed; this kernel may predate 6.12): {e.strerror}") from e
            if e.errno not in _NO_FILE_BACKED:
                raise
    mount_loop(image, target)
    return "loop"


def mount_method(target: Path) -> str | None:
    """How `target` is mounted: "loop" (source is a loop device), "file-backed", or None (no EROFS)."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            if left.split(" ")[4] == str(target):
                fstype, source = right.split(" ")[:2]
                if fstype == "erofs":
                    return "loop" if source.startswith("/dev/loop") else "file-backed"
    return None


def loop_devices_for(image: Path) -> list[str]:
    """Loop devices backed by `image` (from sysfs): after unmount and gc there must be none."""
    out = []
    want = os.path.realpath(image)
    for dev in Path("/sys/block").glob("loop*"):
        try:
            backing = (dev / "loop/backing_file").read_text().strip()
        except OSError:
            continue
        if backing.removesuffix(" (deleted)") == want:
            out.append(f"/dev/{dev.name}")
    return sorted(out)


def mounted_targets() -> set[str]:
    """Every mount point in this mount namespace (from /proc/self/mountinfo)."""
    out = set()
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            parts = line.split(b" ")
            out.add(parts[4].decode().replace("\\040", " "))
    return out


def unmount(target: Path, lazy: bool = True) -> None:
    flags = 2 if lazy else 0  # MNT_DETACH
    if _libc.umount2(str(target).encode(), flags) != 0:
        err = ctypes.get_errno()
        if err not in (22, 2):  # not mounted / gone
            raise OSError(err, f"umount {target}: {os.strerror(err)}")
