"""Cgroup parents of Shoal roots that no longer exist: recorded when made, removed at the next start.

Every root has its own parent cgroup (`shoal-<root tag>`, and `shoal-<root tag>-gv` for gVisor) in each
hierarchy. A root removed with `rm -rf` (a test's, a benchmark's) leaves those behind, empty, for the rest
of the boot. That is not only untidy: on current kernels every memory cgroup keeps a `shrinker_info` as
wide as the most superblocks the host has had at once (kmalloc-1k, never shrunk), so after a fill to
20,000 sandboxes each empty left-over parent held 1.9 MiB of unreclaimable slab; 1,492 of them, left by
test runs, held 2.9 GiB (docs/density.md).

So the parent's owner is recorded in /run (a boot's cgroups, a boot's records), and a backend starting on
any root removes the parents whose root is gone. Only empty cgroups can be removed (rmdir fails with
EBUSY on one that holds a task or a child), so a sandbox still running from a deleted root keeps its
cgroups, and its record stays for a later sweep.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path

OWNERS_DIR = Path("/run/shoal/cgroup-owners")
SUFFIXES = ("", "-gv")  # the container backend's parent, and the gVisor backend's (made by runsc)


def record_owner(parent: str, root: Path, owners_dir: Path = OWNERS_DIR) -> None:
    """Record that cgroup parent `parent` belongs to `root` (idempotent; atomic for concurrent starts)."""
    owners_dir.mkdir(parents=True, exist_ok=True)
    rec = owners_dir / parent
    want = str(Path(root).resolve())
    with contextlib.suppress(OSError):
        if rec.read_text() == want:
            return
    tmp = owners_dir / f".{parent}.{os.getpid()}"
    tmp.write_text(want)
    os.replace(tmp, rec)


def _remove_tree(d: Path) -> bool:
    """rmdir `d` and the cgroups below it, deepest first; False if any is still in use (or not ours)."""
    if not d.is_dir():
        return True
    ok = True
    for sub, _dirs, _files in sorted(os.walk(d), key=lambda t: -t[0].count("/")):
        try:
            os.rmdir(sub)
        except FileNotFoundError:
            pass
        except OSError:  # EBUSY: a task or a child cgroup still in it
            ok = False
    return ok


def sweep_orphans(hierarchies: Iterable[Path], keep: str, owners_dir: Path = OWNERS_DIR) -> list[str]:
    """Remove the cgroup parents (every hierarchy, both suffixes) of recorded roots that no longer
    exist, except `keep`; returns the parents removed whole. A parent still in use keeps its record."""
    removed: list[str] = []
    try:
        records = [p for p in owners_dir.iterdir() if not p.name.startswith(".")]
    except FileNotFoundError:
        return removed
    mounts = list(dict.fromkeys(hierarchies))
    for rec in records:
        if rec.name == keep:
            continue
        try:
            root = rec.read_text()
        except OSError:
            continue
        if not root or Path(root).exists():
            continue
        if all([_remove_tree(m / (rec.name + s)) for m in mounts for s in SUFFIXES]):
            with contextlib.suppress(OSError):
                rec.unlink()
            removed.append(rec.name)
    return removed
