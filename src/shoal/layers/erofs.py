"""Building EROFS images (mkfs.erofs) and mounting them once per host.

Mounting prefers a file-backed EROFS mount through the new mount API (fsopen / fsconfig /
fsmount / move_mount, Linux >= 6.12) so no loop device is involved; older kernels fall back to
`mount -o loop`.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

from ..errors import BuildError

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long

# generic syscall numbers, identical on x86_64 and aarch64
_SYS_MOVE_MOUNT, _SYS_FSOPEN, _SYS_FSCONFIG, _SYS_FSMOUNT = 429, 430, 431, 432
_FSOPEN_CLOEXEC = 0x1
_FSCONFIG_SET_STRING, _FSCONFIG_CMD_CREATE = 1, 6
_FSMOUNT_CLOEXEC = 0x1
_MOUNT_ATTR_RDONLY, _MOUNT_ATTR_NODEV = 0x1, 0x4
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
_AT_FDCWD = -100


def mkfs_available() -> bool:
    return shutil.which("mkfs.erofs") is not None


def build_image(src_dir: Path, out: Path, compression: str | None = None, exclude: list[str] = ()) -> None:
    """Build an EROFS image of `src_dir` into `out` (xattrs and device nodes kept).

    `exclude`: paths relative to `src_dir` left out with their subtrees."""
    if not mkfs_available():
        raise BuildError("mkfs.erofs not found: install erofs-utils (make setup does it)")
    cmd = ["mkfs.erofs", "--quiet"]
    if compression:
        cmd.append(f"-z{compression}")
    cmd += [f"--exclude-path={p}" for p in exclude]
    cmd += [str(out), str(src_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"mkfs.erofs failed for {src_dir}: {proc.stderr.strip() or proc.stdout.strip()}")


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def mount_file_backed(image: Path, target: Path) -> None:
    """Mount `image` read-only at `target` with the new mount API (no loop device)."""
    sc = _libc.syscall
    fs_fd = _check(sc(_SYS_FSOPEN, b"erofs", _FSOPEN_CLOEXEC), "fsopen(erofs)")
    try:
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
    proc = subprocess.run(["mount", "-t", "erofs", "-o", "ro,nodev,loop", str(image), str(target)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise OSError(f"loop mount of {image} failed: {proc.stderr.strip()}")


def mount_image(image: Path, target: Path) -> str:
    """Mount an EROFS image; returns the method used ("file-backed" or "loop")."""
    try:
        mount_file_backed(image, target)
        return "file-backed"
    except OSError as e:
        if e.errno not in (22, 38, 19):  # EINVAL (no file source support), ENOSYS, ENODEV
            raise
    mount_loop(image, target)
    return "loop"


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
