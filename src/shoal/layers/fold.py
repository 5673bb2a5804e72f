"""Layer folding: merge consecutive layers into one that behaves identically as a lower.

Layers are applied bottom to top onto a staging tree with overlayfs semantics, keeping the markers
that must still act on the layers *below* the folded range:
  * a whiteout (0/0 char device) removes the path from the staging tree and stays as a whiteout;
  * an opaque directory replaces the staging directory and stays opaque;
  * a directory that replaces a whiteout or a non-directory becomes opaque (as overlayfs itself
    does on copy-up), so it cannot merge with an older directory further down.
A plain overlayfs mount of the range could not be used: it hides whiteouts, which would then stop
hiding files in the layers underneath.
"""
from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from .archive import OPAQUE_XATTR, make_whiteout, remove_path


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(0, 0)


def _xattrs(path: str) -> dict[str, bytes]:
    out = {}
    try:
        for n in os.listxattr(path, follow_symlinks=False):
            out[n] = os.getxattr(path, n, follow_symlinks=False)
    except OSError:
        pass
    return out


def _copy_meta(src: str, dst: str, st: os.stat_result, skip_opaque: bool = False) -> None:
    os.chown(dst, st.st_uid, st.st_gid, follow_symlinks=False)
    if not stat.S_ISLNK(st.st_mode):
        os.chmod(dst, stat.S_IMODE(st.st_mode))
    for name, value in _xattrs(src).items():
        if skip_opaque and name == OPAQUE_XATTR:
            continue
        try:
            os.setxattr(dst, name, value, follow_symlinks=False)
        except OSError:
            pass
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def apply_layer(src: str, dst: str) -> None:
    """Apply the layer tree `src` on top of the staging tree `dst` (both directories)."""
    for entry in os.scandir(src):
        s = entry.path
        d = os.path.join(dst, entry.name)
        st = os.lstat(s)
        try:
            old = os.lstat(d)
        except FileNotFoundError:
            old = None
        if _is_whiteout(st):
            remove_path(d)
            make_whiteout(d)
            continue
        if stat.S_ISDIR(st.st_mode):
            opaque = _xattrs(s).get(OPAQUE_XATTR) == b"y"
            replaces = old is not None and (not stat.S_ISDIR(old.st_mode))
            if opaque or replaces:
                remove_path(d)
                old = None
            if old is None:
                os.mkdir(d)
            _copy_meta(s, d, st)
            if opaque or replaces:
                os.setxattr(d, OPAQUE_XATTR, b"y")
            apply_layer(s, d)
            os.utime(d, ns=(st.st_atime_ns, st.st_mtime_ns))
            continue
        remove_path(d)
        if stat.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(s), d)
        elif stat.S_ISREG(st.st_mode):
            shutil.copyfile(s, d)
        else:
            os.mknod(d, st.st_mode, st.st_rdev)
        _copy_meta(s, d, st)


def fold_trees(layer_dirs: list[Path], staging: Path) -> Path:
    """Merge mounted layer trees (bottom -> top) into `staging` (an empty directory)."""
    for ld in layer_dirs:
        apply_layer(str(ld), str(staging))
    if layer_dirs:
        top = os.lstat(layer_dirs[-1])
        os.chmod(staging, stat.S_IMODE(top.st_mode))
    return staging
