"""The episode queue's state machine, on both stores (SQLite, PostgreSQL), and the host-wide
creation-rate limiter (no sandboxes)."""
from __future__ import annotations

import multiprocessing as mp
import time

import pytest

from shoal.core.errors import InvalidArgument
from shoal.rollout.queue import EpisodeQueue, open_queue
from shoal.rollout.ratelimit import HostRateLimiter


@pytest.fixture(params=["sqlite", "postgres"])
def where(request, tmp_path) -> str:
    """Where a queue lives: an SQLite file, or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return str(tmp_path / "q.db")
    return request.getfixturevalue("pg_dsn")


def test_leases_attempts_pause_and_resume(where):
    q: EpisodeQueue = open_queue(where, max_attempts=2)
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


def _claim_all(where: str, worker: str, out, start=None) -> None:
    q = open_queue(where)
    if start is not None:  # all workers open their queue first, then race (a loaded host starts them late)
        start.wait(60)
    while (c := q.claim(worker, "n1", lease_s=60)) is not None:
        out.append((c.id, worker))
        assert q.finish(c.id, worker, {"reward": 1.0, "by": worker})


def test_concurrent_workers_claim_each_episode_exactly_once(where):
    q = open_queue(where)
    ids = q.submit([f"t{i}" for i in range(50)], {"kind": "null"}, repeats=4)
    with mp.Manager() as m:
        got, start = m.list(), m.Barrier(4)
        procs = [mp.Process(target=_claim_all, args=(where, f"w{i}", got, start)) for i in range(4)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        claims = list(got)
    assert sorted(eid for eid, _ in claims) == sorted(ids)  # each claimed once, none lost
    assert len({w for _, w in claims}) > 1  # really concurrent: more than one worker got work
    assert q.counts()["done"] == 200 and q.pending() == 0
    assert [r["by"] for r in q.records()] == [dict(claims)[eid] for eid in ids]  # in submission order


def test_claim_prefers_local_images_then_age(where):
    q = open_queue(where)
    a = q.submit(["a"], {"kind": "null"}, images={"a": "img/a:1"})
    b = q.submit(["b"], {"kind": "null"}, images={"b": "img/b:1"})
    assert q.claim("w", "n", prefer_images={"img/b:1"}).id == b[0]
    assert q.claim("w", "n", prefer_images={"img/zzz:1"}).id == a[0]
    assert q.claim("w", "n") is None


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
