"""What a sandbox wrote under given paths, read from its overlay's writable upper on the host
(`SandboxBackend.written_under`). Anything there (a file, a whiteout for a removal, an opaque or
redirected directory, a directory replaced by a link) is no longer the image's; a directory copied up
only because something below it was written is not counted itself, its contents are."""
from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from ...core.errors import InvalidArgument


def _xattr(p: str, name: str) -> bytes | None:
    with contextlib.suppress(OSError):
        return os.getxattr(p, name, follow_symlinks=False)
    return None


def _changed_dir(p: str) -> bool:
    return _xattr(p, "trusted.overlay.opaque") == b"y" or _xattr(p, "trusted.overlay.redirect") is not None


def _walk_to(upper: Path, rel: list[str], out: list[str]) -> str | None:
    """The upper's directory for `rel` if the path is still the image's all the way down (None if the
    upper holds nothing there, or when a component was replaced: that one is added to `out`)."""
    cur = str(upper)
    for i, part in enumerate(rel):
        cur = os.path.join(cur, part)
        try:
            st = os.lstat(cur)
        except FileNotFoundError:
            return None  # the upper holds nothing from here down
        if not stat.S_ISDIR(st.st_mode) or _changed_dir(cur):
            out.append("/" + "/".join(rel[:i + 1]))
            return None
    return cur


def _scan(upper: Path, rel: list[str], out: list[str], limit: int) -> None:
    cur = _walk_to(upper, rel, out)
    if cur is None:
        return
    for top, dirs, files in os.walk(cur):  # never follows links
        sub = ("/" + "/".join(rel) + top[len(cur):]).rstrip("/")
        for d in dirs:
            full = os.path.join(top, d)
            if os.path.islink(full) or _changed_dir(full):
                out.append(f"{sub}/{d}")
        out.extend(f"{sub}/{f}" for f in files)
        if len(out) >= limit:
            return


def written_under(upper: Path, paths: list[str], limit: int = 20) -> list[str]:
    out: list[str] = []
    for path in paths:
        parts = [p for p in path.split("/") if p]
        if not path.startswith("/") or not parts or ".." in parts or any("*" in p for p in parts[:-1]):
            raise InvalidArgument(f"written_under takes absolute paths (a * only at the end), got {path!r}")
        if parts[-1].endswith("*"):
            prefix, parent = parts[-1][:-1], _walk_to(upper, parts[:-1], out)
            names = sorted(n for n in os.listdir(parent) if n.startswith(prefix)) if parent else []
            for n in names:
                _scan(upper, parts[:-1] + [n], out, limit)
        else:
            _scan(upper, parts, out, limit)
        if len(out) >= limit:
            break
    return out[:limit]
