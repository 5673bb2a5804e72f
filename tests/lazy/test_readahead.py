"""Read-ahead on first touches for layers without a prefetch list (shoal.lazy.readahead): a real
Range server (and a fault proxy in front of it), a real chunk cache, a real thread pool."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
from servers import FaultProxy, RangeServer

from shoal.lazy import readahead
from shoal.lazy.cache import ChunkCache
from shoal.lazy.chunks import build_index
from shoal.lazy.http import HttpOrigin
from shoal.lazy.layer import LazyLayer
from shoal.lazy.readahead import ChunkReadahead

CHUNK = 128 << 10


@pytest.fixture
def served(tmp_path):
    d = tmp_path / "srv"
    d.mkdir()
    data = os.urandom(64 * CHUNK + 999)
    (d / "blob").write_bytes(data)
    s = RangeServer(d)
    yield s, data, build_index("sha256:" + "b" * 64, d / "blob", chunk_size=CHUNK)
    s.close()


def _fetched(index, server) -> list[int]:
    out: list[int] = []
    for _, _, rng in server.gets("blob"):
        lo, hi = (int(x) for x in rng.removeprefix("bytes=").split("-"))
        out += list(index.chunks_for(lo, hi + 1 - lo))
    return out


def test_the_window_grows_along_a_run_and_isolated_touches_ask_for_nothing():
    asked: list[list[int]] = []
    ra = ChunkReadahead(1000, 16, asked.append, lambda i: False)
    assert ra.note([500]) == []  # an isolated miss: itself only
    assert ra.note([700]) == [] and ra.note([300]) == []
    assert ra.note([501]) == [502, 503]  # a run of 2: 2 ahead
    assert ra.note([502]) == [504, 505, 506]  # run of 3: window 4, 1 of it already asked for
    assert ra.note([503]) == [507, 508, 509, 510, 511]  # run of 4: window 8
    assert ra.note([504]) == [512, 513, 514, 515, 516, 517, 518, 519, 520]  # window 16: the cap
    for i in range(505, 513):  # at least half of the window still ahead: no new request
        assert ra.note([i]) == [], i
    assert ra.note([513]) == list(range(521, 530))  # 7 ahead of 16: topped up to 16
    assert max(len(a) for a in asked) <= 16
    assert ChunkReadahead(1000, 0, asked.append, lambda i: False).note([1, 2, 3]) == []  # cap 0: off


def test_a_second_touch_in_a_block_fetches_the_rest_of_the_block():
    ra = ChunkReadahead(100, 0, lambda c: None, lambda i: i == 21, cluster=8)
    assert ra.note([19]) == [] and ra.note([26]) == []  # one touch per block: nothing
    assert ra.note([22]) == [16, 17, 18, 20, 23]  # block 16-23 now has 19 and 22; 21 is cached
    assert ra.note([29]) == [24, 25, 27, 28, 30, 31]  # out of order, below and above: block 24-31
    assert ra.note([17]) == []  # its block was asked for already
    assert ra.note([99]) == [] and ra.note([97]) == [96, 98]  # the last block is short


def test_cached_chunks_are_not_asked_for_and_the_layer_end_bounds_the_window():
    ra = ChunkReadahead(10, 16, lambda c: None, lambda i: i == 4)
    assert ra.note([2, 3]) == [5]  # a run of 2: chunks 4-5, of which 4 is cached
    ra = ChunkReadahead(10, 16, lambda c: None, lambda i: False)
    ra.note([0, 1, 2, 3, 4, 5])
    assert all(ra.asked)  # the window stopped at the last chunk


def test_a_sequential_first_read_needs_far_fewer_requests_and_fetches_nothing_twice(served, tmp_path):
    s, data, index = served
    cache = ChunkCache(tmp_path / "chunks")
    with HttpOrigin(s.url) as o, ThreadPoolExecutor(4) as pool:
        layer = LazyLayer(index, o, "blob", cache)
        layer.readahead = readahead.for_layer(layer, pool, max_chunks=8, cluster=0, budget=1000)
        s.reset()
        for i in range(40):  # a small read in each chunk, in order: what a relaid-out first run does
            off = i * CHUNK + 4096
            assert layer.read(off, 4096) == data[off:off + 4096]
        pool.shutdown(wait=True)
        got = _fetched(index, s)
        assert sorted(got) == sorted(set(got)), "a chunk was fetched twice"
        assert set(range(40)) <= set(got)
        assert max(got) < 40 + 8  # at most one window past the end of the run
        assert len(s.gets("blob")) <= 20, s.gets("blob")  # 40 GETs without read-ahead (measured: ~11)


def test_scattered_reads_fetch_only_what_they_touch(served, tmp_path):
    s, data, index = served
    cache = ChunkCache(tmp_path / "chunks")
    with HttpOrigin(s.url) as o, ThreadPoolExecutor(4) as pool:
        layer = LazyLayer(index, o, "blob", cache)
        layer.readahead = readahead.for_layer(layer, pool, max_chunks=8, cluster=0, budget=1000)
        s.reset()
        touched = list(range(0, 64, 3)) + [1]  # every third chunk, then one after the first
        for i in touched:
            assert layer.read(i * CHUNK, 100) == data[i * CHUNK:i * CHUNK + 100]
        pool.shutdown(wait=True)
        # the only run (0, 1) asks for 2-3; 3 was touched already, so only 2 more
        assert sorted(_fetched(index, s)) == sorted(set(touched) | {2})


def test_a_failed_read_ahead_keeps_nothing_and_the_next_demand_read_recovers(served, tmp_path):
    s, data, index = served
    p = FaultProxy(s.port)
    cache = ChunkCache(tmp_path / "chunks")
    try:
        with HttpOrigin(p.url, timeout=2.0) as o, ThreadPoolExecutor(4) as pool:
            layer = LazyLayer(index, o, "blob", cache)
            assert layer.read(0, 2 * CHUNK) == data[:2 * CHUNK]  # no read-ahead yet
            layer.readahead = readahead.for_layer(layer, pool, max_chunks=8, cluster=0, budget=1000)
            p.corrupt = True
            assert layer.readahead is not None
            assert layer.readahead.note([0, 1]) == [2, 3]  # fetched through the flipping proxy
            pool.shutdown(wait=True)  # the read-ahead failed (logged), in the background
            assert not cache.has(index.chunks[2])  # the proxy flips one byte per body: chunk 2's
            assert not list((tmp_path / "chunks/.tmp").iterdir())
            p.corrupt = False
            layer.readahead = None  # its pool is shut down
            assert layer.read(2 * CHUNK, 2 * CHUNK) == data[2 * CHUNK:4 * CHUNK]  # a demand read fetches
            assert cache.has(index.chunks[2])
    finally:
        p.stop()


def test_defaults_and_switches(served, tmp_path, monkeypatch):
    s, data, index = served
    for v in ("SHOAL_LAZY_MISS_READAHEAD_KB", "SHOAL_LAZY_MISS_CLUSTER_KB", "SHOAL_LAZY_MISS_READAHEAD_BUDGET_PCT"):
        monkeypatch.delenv(v, raising=False)
    with HttpOrigin(s.url) as o, ThreadPoolExecutor(1) as pool:
        layer = LazyLayer(index, o, "blob", ChunkCache(tmp_path / "chunks"))
        ra = readahead.for_layer(layer, pool)  # the default: sequential, 1 MiB, 0.5 % of the layer
        assert ra is not None and ra.max == 8 and ra.cluster == 0 and ra.budget == 0  # 65 chunks: 0
        monkeypatch.setenv("SHOAL_LAZY_MISS_READAHEAD_KB", "0")
        assert readahead.for_layer(layer, pool) is None  # off: a miss fetches its own chunks only
        monkeypatch.setenv("SHOAL_LAZY_MISS_CLUSTER_KB", "512")
        monkeypatch.setenv("SHOAL_LAZY_MISS_READAHEAD_BUDGET_PCT", "10")
        ra = readahead.for_layer(layer, pool)
        assert ra is not None and ra.cluster == 4 and ra.budget == 6


def test_the_budget_bounds_unused_read_ahead_and_used_guesses_free_it():
    asked: list[list[int]] = []
    ra = ChunkReadahead(1000, 16, asked.append, lambda i: False, budget=5)
    ra.note([100])
    ra.note([101])  # run of 2: 102-103
    ra.note([102])  # 102 was a guess that came true; window 4: 104-106
    assert ra.outstanding == 4  # 103-106 asked for, not read yet
    assert ra.note([103]) == [107, 108]  # window 8 wants 107-111: room for 5 - 3 = 2, nearest first
    assert ra.outstanding == 5 and ra.refused == 3
    assert ra.note([500]) == [] and ra.note([501]) == []  # a new run: the budget is spent, nothing asked
    assert not ra.asked[502]  # refused chunks are not marked asked: they may be asked for later
    for i in (104, 105):  # guesses used: room again, and the refused part of the window comes
        ra.note([i])
    assert ra.outstanding <= 5 and sum(ra.unused) == ra.outstanding
    ra2 = ChunkReadahead(1000, 16, lambda c: None, lambda i: False, budget=0)
    assert ra2.note([1]) == [] and ra2.note([2]) == []  # budget 0: no read-ahead at all


def test_the_budget_caps_the_bytes_of_wrong_guesses_over_a_whole_layer(served, tmp_path, monkeypatch):
    """Reads that look sequential but never use what was read ahead (pairs of touches 4 chunks apart):
    without a budget each pair costs a window of guesses; with a budget of 3 chunks the guesses
    fetched and never used stay <= 3 however many pairs there are."""
    s, data, index = served
    pairs = [(i, i + 1) for i in range(0, 60, 4)]

    def wasted(budget: int | None) -> int:
        cache = ChunkCache(tmp_path / f"chunks-{budget}")
        with HttpOrigin(s.url) as o, ThreadPoolExecutor(4) as pool:
            layer = LazyLayer(index, o, "blob", cache)
            layer.readahead = readahead.for_layer(layer, pool, max_chunks=8, cluster=0, budget=budget)
            s.reset()
            for a, b in pairs:
                for i in (a, b):
                    assert layer.read(i * CHUNK, 100) == data[i * CHUNK:i * CHUNK + 100]
            pool.shutdown(wait=True)
            got = set(_fetched(index, s))
        return len(got - {i for p in pairs for i in p})

    assert wasted(1000) >= 10  # no budget to speak of (the old behaviour): every pair asks for 2 more
    assert wasted(3) <= 3
    monkeypatch.setenv("SHOAL_LAZY_MISS_READAHEAD_BUDGET_PCT", "5")  # 5 % of 65 chunks: 3
    assert readahead.budget_chunks(len(index.chunks), CHUNK) == 3


def test_a_corrupt_read_ahead_chunk_is_never_kept_and_does_not_eat_the_budget_for_ever(served, tmp_path):
    s, data, index = served
    p = FaultProxy(s.port)
    cache = ChunkCache(tmp_path / "chunks")
    try:
        with HttpOrigin(p.url, timeout=2.0) as o, ThreadPoolExecutor(4) as pool:
            layer = LazyLayer(index, o, "blob", cache)
            layer.readahead = ra = readahead.for_layer(layer, pool, max_chunks=8, cluster=0, budget=4)
            assert ra is not None
            assert layer.read(0, 100) == data[:100]
            p.corrupt = True
            assert ra.note([1]) == [2, 3]  # run 0-1: 2-3 read ahead through the flipping proxy
            pool.shutdown(wait=True)  # the read-ahead failed in the background (logged)
            assert not cache.has(index.chunks[2])  # the flipped byte is in chunk 2: never kept
            for j in (2, 3):  # whatever was kept is right
                f = cache.path(index.chunks[j])
                if f.exists():
                    assert f.read_bytes() == data[j * CHUNK:(j + 1) * CHUNK]
            assert not list((tmp_path / "chunks/.tmp").iterdir())
            assert not ra.unused[2] and ra.outstanding <= 1  # a failed guess gives its budget back
            p.corrupt = False
            assert layer.read(2 * CHUNK, 2 * CHUNK) == data[2 * CHUNK:4 * CHUNK]  # a demand read fetches
            assert cache.has(index.chunks[2]) and ra.outstanding == 0
    finally:
        p.stop()
