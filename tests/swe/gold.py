"""All 68 gold patches through the full grader, once per test session (shared by the suite's
validity test and the red-team's no-false-positive test: the slowest part of both)."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from shoal.tasks.swe import evaluate

_cache: dict[str, tuple[dict, float]] = {}
_lock = threading.Lock()


def gold_reports(host, tasks) -> tuple[dict, float]:
    """({instance_id: Report}, seconds it took) for every task's gold patch."""
    key = str(host.settings.root)
    with _lock:
        if key not in _cache:
            t0 = time.monotonic()
            with ThreadPoolExecutor(2) as pool:
                reports = dict(pool.map(lambda t: (t.instance_id, evaluate(host, t, t.patch)[0]), tasks))
            _cache[key] = (reports, time.monotonic() - t0)
        return _cache[key]
