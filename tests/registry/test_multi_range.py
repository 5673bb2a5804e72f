"""Coalesced lazy reads against the real registry: several ranges of a blob in one multi-range GET
(206 multipart/byteranges), a lazy layer's chunks fetched that way still verified one by one (a
corrupt one rejected), and a server that answers a multi-range GET otherwise is read range by range."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from shoal.core.errors import CorruptChunk
from shoal.lazy.cache import ChunkCache
from shoal.lazy.chunks import build_index
from shoal.lazy.layer import LazyLayer, prefetch_chunks
from shoal.registry.client import _byteranges
from shoal.registry.origin import RegistryOrigin


@pytest.fixture(scope="module")
def blob(registry, tmp_path_factory):
    data = os.urandom((3 << 20) + 4321)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    with registry.client() as cl:
        cl.upload_blob("shoal/multi", digest, data=data)
    path = Path(tmp_path_factory.mktemp("multi")) / "blob"
    path.write_bytes(data)
    return {"data": data, "digest": digest, "index": build_index("sha256:" + "b" * 64, path, chunk_size=128 << 10)}


def test_several_ranges_in_one_request(registry, blob):
    data, digest = blob["data"], blob["digest"]
    ranges = [(0, 100), (1 << 20, 5000), ((3 << 20), 4321), (777, 1)]
    with registry.client() as cl:
        mark = registry.mark()
        got = cl.read_blob_ranges("shoal/multi", digest, ranges)
        assert got == [data[o:o + n] for o, n in ranges]
        assert cl.multi_range is True
        gets = [r for r in registry.requests(mark) if r[0] == "GET" and "/blobs/" in r[1] and r[2] != 401]
        assert len(gets) == 1  # one request for the four ranges


def test_prefetch_in_multi_range_reads_verifies_each_chunk(registry, blob, tmp_path):
    index, data = blob["index"], blob["data"]
    with registry.client() as cl:
        origin = RegistryOrigin(cl)
        cache = ChunkCache(tmp_path / "chunks")
        layer = LazyLayer(index, origin, f"shoal/multi@{blob['digest']}", cache)
        mark = registry.mark()
        order = [20, 3, 4, 11, 0, 24, 7]  # scattered: five runs
        assert prefetch_chunks(layer, order, workers=2) == len(order)
        gets = [r for r in registry.requests(mark) if r[0] == "GET" and "/blobs/" in r[1] and r[2] != 401]
        assert len(gets) == 1  # one batch, one multi-range GET
        assert layer.read(0, len(data)) == data

        # a chunk whose bytes are wrong in a multi-range answer is rejected, its neighbours kept
        bad_cache = ChunkCache(tmp_path / "bad")
        bad = LazyLayer(index, origin, f"shoal/multi@{blob['digest']}", bad_cache)
        real = origin.read_ranges

        def flip(key, ranges):
            out = [bytearray(x) for x in real(key, ranges)]
            out[1][5] ^= 0xFF  # in the second run
            return [bytes(x) for x in out]

        origin.read_ranges = flip  # type: ignore[method-assign]
        with pytest.raises(CorruptChunk):
            bad.ensure_chunks([0, 1, 5, 9])
        assert bad_cache.chunks() == {index.chunks[i] for i in (0, 1, 9)}


def test_byteranges_parser():
    body = (b"--XB\r\nContent-Type: application/octet-stream\r\nContent-Range: bytes 10-13/100\r\n\r\nabcd\r\n"
            b"--XB\r\nContent-Range: bytes 50-51/100\r\n\r\nzz\r\n--XB--\r\n")
    assert _byteranges(body, "XB") == {10: b"abcd", 50: b"zz"}
