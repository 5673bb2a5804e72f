"""HttpOrigin against a real Range server, and the chunk cache: verified, single-flight, capped."""
from __future__ import annotations

import os
import threading
import time

import pytest
from servers import RangeServer

from shoal.core.errors import CorruptChunk, LayerNotFound, OriginUnavailable
from shoal.lazy.cache import ChunkCache
from shoal.lazy.chunks import ChunkIndex, build_index
from shoal.lazy.http import HttpOrigin
from shoal.lazy.layer import LazyLayer
from shoal.lazy.origin import BlobStat, Origin


@pytest.fixture
def blob(tmp_path):
    d = tmp_path / "srv"
    (d / "b").mkdir(parents=True)
    data = os.urandom((5 << 20) + 12345)
    (d / "b/blob.bin").write_bytes(data)
    s = RangeServer(d)
    yield {"server": s, "data": data, "dir": d, "index": build_index("sha256:" + "a" * 64, d / "b/blob.bin")}
    s.close()


def _chunks_of(index: ChunkIndex, ranges: list[str]) -> list[int]:
    """The chunk numbers a list of `bytes=lo-hi` Range headers fetched (each must start on a chunk)."""
    out: list[int] = []
    for g in ranges:
        lo, hi = (int(x) for x in g.removeprefix("bytes=").split("-"))
        assert lo % index.chunk_size == 0, g
        out += list(index.chunks_for(lo, hi + 1 - lo))
    return out


def test_stat_read_list(blob):
    s, data = blob["server"], blob["data"]
    with HttpOrigin(s.url) as o:
        assert o.stat("b/blob.bin").size == len(data)
        assert o.read("b/blob.bin", 1000, 5000) == data[1000:6000]
        assert o.read("b/blob.bin", len(data) - 10, 100) == data[-10:]
        assert o.list("b/") == ["b/blob.bin"]
        with pytest.raises(LayerNotFound):
            o.stat("b/nope")
    assert s.gets("blob.bin")[0][2] == "bytes=1000-5999"  # a real Range read, not the whole blob


def test_credentials_stay_out_of_repr_and_errors(blob, tmp_path):
    s = RangeServer(blob["dir"], auth="user:s3cret")
    try:
        with HttpOrigin(f"http://user:s3cret@127.0.0.1:{s.port}/") as o:
            assert o.read("b/blob.bin", 0, 10) == blob["data"][:10]
            assert "s3cret" not in repr(o)
        with HttpOrigin(f"http://user:wrong-s3cret@127.0.0.1:{s.port}/") as o:
            with pytest.raises(OriginUnavailable) as e:
                o.read("b/blob.bin", 0, 10)
            assert "s3cret" not in str(e.value) and "HTTP 401" in str(e.value)
    finally:
        s.close()


def test_down_and_slow_origin_fail_within_the_timeout(blob, range_server):
    from servers import FaultProxy

    p = FaultProxy(blob["server"].port)
    try:
        with HttpOrigin(p.url, timeout=1.0) as o:
            p.delay = 3.0
            t = time.monotonic()
            with pytest.raises(OriginUnavailable):
                o.read("b/blob.bin", 0, 10)
            assert time.monotonic() - t < 2.0
            p.stop()
            with pytest.raises(OriginUnavailable):
                o.read("b/blob.bin", 0, 10)
    finally:
        p.stop()


def test_64_concurrent_readers_fetch_each_chunk_once(blob, tmp_path):
    s, data, index = blob["server"], blob["data"], blob["index"]
    cache = ChunkCache(tmp_path / "chunks")
    with HttpOrigin(s.url) as o:
        layer = LazyLayer(index, o, "b/blob.bin", cache)
        s.reset()
        barrier = threading.Barrier(64)
        out: dict[int, bytes] = {}
        errors: list[BaseException] = []

        def reader(n: int) -> None:
            try:
                barrier.wait()
                off = (n * 97_003) % (len(data) - 3 << 20)  # overlapping reads across all chunks
                out[n] = layer.read(off, 3 << 20) if n % 2 else layer.read(0, len(data))
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=reader, args=(n,)) for n in range(64)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        for n, got in out.items():
            off = (n * 97_003) % (len(data) - 3 << 20)
            assert got == (data[off:off + (3 << 20)] if n % 2 else data)
        ranges = [r[2] for r in s.gets("blob.bin")]
        got = _chunks_of(index, ranges)  # coalesced Range GETs: consecutive chunks in one request
        assert sorted(got) == list(range(len(index.chunks))), ranges  # each chunk fetched exactly once
        assert cache.fetches == len(index.chunks)


def test_a_corrupt_chunk_is_never_kept(blob, tmp_path):
    from servers import FaultProxy

    p = FaultProxy(blob["server"].port)
    cache = ChunkCache(tmp_path / "chunks")
    try:
        with HttpOrigin(p.url) as o:
            layer = LazyLayer(blob["index"], o, "b/blob.bin", cache)
            p.corrupt = True
            with pytest.raises(CorruptChunk):
                layer.read(0, 100)
            assert cache.chunks() == set() and not list((tmp_path / "chunks/.tmp").iterdir())
            p.corrupt = False
            assert layer.read(0, 100) == blob["data"][:100]
            assert cache.chunks() == {blob["index"].chunks[0]}
    finally:
        p.stop()


def test_a_damaged_cache_file_is_fetched_again(blob, tmp_path):
    index = blob["index"]
    with HttpOrigin(blob["server"].url) as o:
        LazyLayer(index, o, "b/blob.bin", ChunkCache(tmp_path / "chunks")).read(0, 10)
        p = ChunkCache(tmp_path / "chunks").path(index.chunks[0])
        os.chmod(p, 0o644)
        p.write_bytes(b"x" * p.stat().st_size)
        fresh = ChunkCache(tmp_path / "chunks")  # a new process: verifies on first use
        assert LazyLayer(index, o, "b/blob.bin", fresh).read(0, 10) == blob["data"][:10]
        assert fresh.fetches == 1


def test_lru_cap_and_gc(blob, tmp_path):
    index = blob["index"]
    with HttpOrigin(blob["server"].url) as o:
        cache = ChunkCache(tmp_path / "chunks", cap_bytes=3 << 20)
        layer = LazyLayer(index, o, "b/blob.bin", cache)
        for i in range(len(index.chunks)):
            layer.ensure_chunk(i)
            time.sleep(0.01)
            os.utime(cache.path(index.chunks[i]), (time.time(), time.time()))
        held = cache.chunks()
        assert sum(cache.path(c).stat().st_size for c in held) <= 3 << 20
        assert index.chunks[-1] in held and index.chunks[0] not in held  # least recently used went first
        assert cache.gc(keep={index.chunks[-1]})["chunks_evicted"] == len(held) - 1
        assert cache.chunks() == {index.chunks[-1]}


class _MemOrigin(Origin):
    """A blob in memory that counts its range reads; `corrupt` flips a byte at those offsets,
    `delay` slows every read."""

    def __init__(self, data: bytes, delay: float = 0.0):
        self.data, self.delay = data, delay
        self.corrupt: set[int] = set()
        self.reads: list[tuple[int, int]] = []
        self._lock = threading.Lock()

    def stat(self, key: str) -> BlobStat:
        return BlobStat(key=key, size=len(self.data))

    def read(self, key: str, offset: int, length: int) -> bytes:
        with self._lock:
            self.reads.append((offset, length))
        time.sleep(self.delay)
        out = bytearray(self.data[offset:offset + length])
        for at in self.corrupt:
            if offset <= at < offset + len(out):
                out[at - offset] ^= 0xFF
        return bytes(out)

    def list(self, prefix: str = "") -> list[str]:
        return ["blob"]


def test_adjacent_missing_chunks_come_in_one_range_read(blob, tmp_path):
    index, data = blob["index"], blob["data"]
    o = _MemOrigin(data)
    cache = ChunkCache(tmp_path / "chunks")
    layer = LazyLayer(index, o, "blob", cache)
    layer.ensure_chunk(2)
    o.reads.clear()
    assert layer.read(100, len(data)) == data[100:]  # chunks 0-1 and 3-5 missing, 2 cached
    assert o.reads == [index.span(0)[:1] + (2 << 20,), (3 << 20, len(data) - (3 << 20))]
    assert cache.fetches == len(index.chunks) and cache.requests == 2
    o.reads.clear()
    assert layer.read(0, len(data)) == data and o.reads == []  # all cached now


def test_a_corrupt_chunk_in_a_coalesced_range_is_rejected(blob, tmp_path):
    index, data = blob["index"], blob["data"]
    o = _MemOrigin(data)
    o.corrupt = {(2 << 20) + 777}  # one byte of chunk 2
    cache = ChunkCache(tmp_path / "chunks")
    layer = LazyLayer(index, o, "blob", cache)
    with pytest.raises(CorruptChunk):
        layer.read(0, 4 << 20)
    assert o.reads == [(0, 4 << 20)]  # one coalesced read of chunks 0-3
    # its good neighbours are verified and kept, the bad chunk never is (nor a temp file of it)
    assert cache.chunks() == {index.chunks[i] for i in (0, 1, 3)}
    assert not list((tmp_path / "chunks/.tmp").iterdir())
    o.corrupt.clear()
    o.reads.clear()
    assert layer.read(0, 4 << 20) == data[:4 << 20]
    assert o.reads == [index.span(2)]  # only the rejected chunk is fetched again


def test_concurrent_coalesced_fetches_are_single_flight(blob, tmp_path):
    """Demand reads and prefetches from many threads and two caches on one directory (as two
    processes would be: the flock side of single-flight) each fetch every chunk once in all."""
    from shoal.lazy.layer import prefetch_chunks

    index, data = blob["index"], blob["data"]
    o = _MemOrigin(data, delay=0.05)
    caches = [ChunkCache(tmp_path / "chunks"), ChunkCache(tmp_path / "chunks")]
    layers = [LazyLayer(index, o, "blob", c) for c in caches]
    barrier = threading.Barrier(24)
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            barrier.wait()
            layer = layers[n % 2]
            if n % 3 == 0:
                prefetch_chunks(layer, [5, 3, 1, 0, 2, 4], workers=3, batch=2)
            else:
                off = (n * 612_345) % len(data)
                assert layer.read(off, 2 << 20) == data[off:off + (2 << 20)]
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    fetched = [i for off, n in o.reads for i in index.chunks_for(off, n)]
    assert sorted(fetched) == list(range(len(index.chunks)))  # each chunk exactly once, in all
    assert sum(c.fetches for c in caches) == len(index.chunks)
    assert len(o.reads) < len(index.chunks) * 2


def test_prefetch_coalesces_the_list(blob, tmp_path):
    from shoal.lazy.layer import prefetch_chunks

    index, data = blob["index"], blob["data"]
    o = _MemOrigin(data)
    layer = LazyLayer(index, o, "blob", ChunkCache(tmp_path / "chunks"))
    assert prefetch_chunks(layer, [4, 0, 1, 5, 3], workers=2, first_batch=16) == 5
    assert sorted(o.reads) == [(0, 2 << 20), (3 << 20, len(data) - (3 << 20))]


def test_prefetch_batches_start_small_and_grow():
    """The list's first chunks go in a small first batch (what a mount and a first exec wait for
    arrives without waiting for a 16 MiB batch), later batches double up to the cap."""
    from shoal.lazy.layer import _batch_sizes, _batches

    assert _batch_sizes(100, 32, 4) == [4, 8, 16, 32, 32, 8]
    assert _batch_sizes(3, 32, 4) == [3]
    order = [9, 8, 0, 1, 2, 3, 4, 5, 6, 7]
    got = _batches(order, batch=8, max_run=64, first=2)
    assert got == [[[8, 9]], [[0, 1, 2, 3]], [[4, 5, 6, 7]]]  # list order between batches, sorted runs within


def test_promotion_assembles_a_verified_image(blob, tmp_path):
    from shoal.lazy.layer import promote

    index, data = blob["index"], blob["data"]

    class Store:
        def image_path(self, digest: str):
            return tmp_path / "layers" / f"{digest.split(':')[1]}.erofs"

    (tmp_path / "layers").mkdir()
    cache = ChunkCache(tmp_path / "chunks")
    layer = LazyLayer(index, _MemOrigin(data), "blob", cache)
    layer.ensure_chunks([0, 1, 2])
    assert promote(Store(), index.layer, layer) is None  # chunks missing: nothing written
    assert list((tmp_path / "layers").iterdir()) == []
    layer.ensure_chunks(list(range(3, len(index.chunks))))
    bad = cache.path(index.chunks[4])
    os.chmod(bad, 0o644)
    good = bad.read_bytes()
    bad.write_bytes(b"x" * len(good))  # a damaged cache file is never promoted
    with pytest.raises(CorruptChunk):
        promote(Store(), index.layer, layer)
    assert list((tmp_path / "layers").iterdir()) == []
    bad.write_bytes(good)
    path = promote(Store(), index.layer, layer)
    assert path is not None and path.read_bytes() == data and path == Store().image_path(index.layer)
