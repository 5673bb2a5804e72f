"""The episode queue's state machine and the host-wide creation-rate limiter (no sandboxes)."""
from __future__ import annotations

import multiprocessing as mp
import time

import pytest

from shoal.core.errors import InvalidArgument
from shoal.rollout.queue import EpisodeQueue
from shoal.rollout.ratelimit import HostRateLimiter


def test_leases_attempts_pause_and_resume(tmp_path):
    q = EpisodeQueue(tmp_path / "q.db", max_attempts=2)
    (eid,) = q.submit(["t1"], {"kind": "null"})
    c = q.claim("w1", "n1", lease_s=0.2)
    assert (c.id, c.attempts, c.resumed) == (eid, 1, False)
    assert q.claim("w2", "n1") is None  # leased
    q.heartbeat([eid], "w1", lease_s=0.2)
    time.sleep(0.3)  # w1 died: no more heartbeats
    c2 = q.claim("w2", "n2", lease_s=5)
    assert (c2.id, c2.attempts, c2.resumed) == (eid, 2, True)
    assert not q.finish(eid, "w1", {"reward": 1.0})  # the dead worker's late write is refused
    assert q.fail(eid, "w2", "boom") == "failed"  # 2 attempts used up
    assert q.counts()["failed"] == 1 and "boom" in q.get(eid)["error"]
    (e2,) = q.submit(["t2"], {"kind": "null"})
    q.claim("w3", "n1")
    q.pause(e2, "w3", "endpoint down")
    assert q.counts()["paused"] == 1 and q.claim("w3", "n1") is None
    assert q.resume_paused() == 1
    c3 = q.claim("w3", "n1")
    assert c3.id == e2 and q.finish(e2, "w3", {"reward": 1.0, "x": [1]})
    assert q.records() == [{"reward": 1.0, "x": [1]}] and q.counts()["reward"] == 1.0
    with pytest.raises(InvalidArgument):
        q.submit([], {"kind": "null"})


def _reserve(path, n, out):
    lim = HostRateLimiter(path, 50.0)
    out.extend([time.time() + lim.reserve() for _ in range(n)])


def test_creation_rate_is_shared_by_processes(tmp_path):
    path = tmp_path / "bucket"
    with mp.Manager() as m:
        slots = m.list()
        procs = [mp.Process(target=_reserve, args=(path, 10, slots)) for _ in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        got = sorted(slots)
    gaps = [b - a for a, b in zip(got, got[1:])]
    assert len(got) == 20 and min(gaps) >= 0.02 - 0.005  # 50/s: one slot per 20 ms, across both processes
    assert got[-1] - got[0] >= 19 * 0.02 - 0.01
    with pytest.raises(ValueError):
        HostRateLimiter(path, 0)
