"""HttpOrigin against a real Range server, and the chunk cache: verified, single-flight, capped."""
from __future__ import annotations

import os
import threading
import time

import pytest
from servers import RangeServer

from shoal.core.errors import CorruptChunk, LayerNotFound, OriginUnavailable
from shoal.lazy.cache import ChunkCache
from shoal.lazy.chunks import build_index
from shoal.lazy.http import HttpOrigin
from shoal.lazy.layer import LazyLayer


@pytest.fixture
def blob(tmp_path):
    d = tmp_path / "srv"
    (d / "b").mkdir(parents=True)
    data = os.urandom((5 << 20) + 12345)
    (d / "b/blob.bin").write_bytes(data)
    s = RangeServer(d)
    yield {"server": s, "data": data, "dir": d, "index": build_index("sha256:" + "a" * 64, d / "b/blob.bin")}
    s.close()


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
        assert len(ranges) == len(index.chunks) == len(set(ranges)), ranges  # each chunk fetched exactly once
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
