"""Content digest of a directory tree.

The digest covers what a sandbox can observe through the layer: paths, file types, permission
bits, ownership, file bytes, symlink targets, device numbers (overlayfs whiteouts are 0/0 char
devices) and extended attributes (overlayfs opaque markers live there). Timestamps are left out on
purpose, so building the same content twice — e.g. from two extractions of one tarball — yields
the same digest and is stored once.
"""
from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

_CHUNK = 1 << 20


def _xattrs(path: str) -> list[tuple[str, bytes]]:
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return []
    out = []
    for n in sorted(names):
        if n.startswith("security.selinux"):
            continue  # host labelling, not content
        try:
            out.append((n, os.getxattr(path, n, follow_symlinks=False)))
        except OSError:
            continue
    return out


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def tree_digest(root: str | os.PathLike, exclude: frozenset[str] | set[str] = frozenset()) -> tuple[str, int, int]:
    """Return ("sha256:<hex>", total file bytes, entry count) for the tree under `root`.

    `exclude` holds paths relative to `root` (no leading slash) left out with their subtrees."""
    root = str(root)
    h = hashlib.sha256(b"shoal-tree-v1\0")
    total = 0
    count = 0

    def visit(rel: str) -> None:
        nonlocal total, count
        full = os.path.join(root, rel) if rel else root
        st = os.lstat(full)
        mode = st.st_mode
        fields = [rel or ".", f"{stat.S_IFMT(mode):o}", f"{stat.S_IMODE(mode):o}", str(st.st_uid), str(st.st_gid)]
        if stat.S_ISREG(mode):
            fields += [str(st.st_size), file_sha256(full)]
            total += st.st_size
        elif stat.S_ISLNK(mode):
            fields.append(os.readlink(full))
        elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
            fields.append(f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}")
        for name, value in _xattrs(full):
            fields.append(f"x:{name}={value.hex()}")
        h.update("\0".join(fields).encode("utf-8", "surrogateescape") + b"\n")
        count += 1
        if stat.S_ISDIR(mode):
            for name in sorted(os.listdir(full)):
                child = os.path.join(rel, name) if rel else name
                if child not in exclude:
                    visit(child)

    if not Path(root).is_dir():
        raise NotADirectoryError(root)
    visit("")
    return "sha256:" + h.hexdigest(), total, count
