"""cpu cgroups made ahead of time with their CFS quota already written (issue 16, density-create.md).

Writing a quota (`cpu.cfs_quota_us`, v2 `cpu.max`) walks every task group on the host
(`tg_set_cfs_bandwidth` -> `__cfs_schedulable` -> `walk_tg_tree`), so a create that writes one pays
O(live sandboxes). The pool pays that walk on a background thread: a few empty cpu cgroups per quota
value wait under the Shoal parent as `.pool-<pid>-<n>`, and a create renames one to the sandbox's id
(cgroup v1 allows a rename within the same parent; v2 has no rename, so there the pool stays off and
the create writes the quota itself). The cap is the same: the quota is on the sandbox's own cgroup
before its init is placed in it. A pool directory is empty (no task ever joins it); one left behind by
a dead process is removed by the next `sweep_stale()` (at the next backend start).
"""
from __future__ import annotations

import contextlib
import itertools
import os
import threading
from pathlib import Path

PREFIX = ".pool-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class QuotaPool:
    def __init__(self, parent: Path, quota_file: str, size: int = 4):
        self.parent = parent  # the Shoal parent cgroup in the cpu hierarchy
        self.quota_file = quota_file
        self.size = size
        self._ready: dict[int, list[Path]] = {}
        self._wanted: set[int] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._names = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False

    def take(self, quota: int, target: Path) -> bool:
        """Rename a prepared cgroup with `quota` onto `target`; False when none is ready (the caller
        then makes its own). Asks the background thread to keep `size` of this quota ready."""
        with self._lock:
            ready = self._ready.get(quota)
            d = ready.pop() if ready else None
            self._wanted.add(quota)
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._refill, name="shoal-quota-pool", daemon=True)
                self._thread.start()
        self._wake.set()
        if d is None:
            return False
        try:
            os.rename(d, target)
        except OSError:
            with contextlib.suppress(OSError):
                d.rmdir()
            return False
        return True

    def _refill(self) -> None:
        while not self._closed:
            self._wake.wait(1.0)
            self._wake.clear()
            while not self._closed:
                with self._lock:
                    short = [q for q in self._wanted if len(self._ready.get(q, ())) < self.size]
                if not short:
                    break
                for q in short:
                    d = self.parent / f"{PREFIX}{os.getpid()}-{next(self._names)}"
                    try:
                        d.mkdir()
                        with open(d / self.quota_file, "w") as f:
                            f.write(str(q))
                    except OSError:
                        with contextlib.suppress(OSError):
                            d.rmdir()
                        with self._lock:  # this quota cannot be prepared here: stop asking
                            self._wanted.discard(q)
                        continue
                    with self._lock:
                        if not self._closed:
                            self._ready.setdefault(q, []).append(d)
                            continue
                    with contextlib.suppress(OSError):  # closed meanwhile
                        d.rmdir()

    def close(self) -> None:
        """Stop refilling and remove the prepared cgroups."""
        self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            dirs = [d for ds in self._ready.values() for d in ds]
            self._ready.clear()
        for d in dirs:
            with contextlib.suppress(OSError):
                d.rmdir()

    @staticmethod
    def sweep_stale(parent: Path) -> int:
        """Remove pool cgroups whose process is gone; how many."""
        n = 0
        with contextlib.suppress(OSError):
            for d in parent.iterdir():
                if not d.name.startswith(PREFIX):
                    continue
                try:
                    pid = int(d.name[len(PREFIX):].split("-")[0])
                except ValueError:
                    continue
                if not _pid_alive(pid):
                    with contextlib.suppress(OSError):
                        d.rmdir()
                        n += 1
        return n
