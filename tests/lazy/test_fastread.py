"""The C fast path of the lazy daemon's FUSE server (shoal.lazy.fastread, native/fastread.c): a real
FUSE mount served in this process; every read reaches the server (FOPEN_DIRECT_IO), so which side
answered it is known. No timing assertions: what is checked is who answers and the bytes."""
from __future__ import annotations

import errno
import os
import threading

import pytest

from shoal.lazy import fastread, fuse

CHUNK = 16 << 10


class ChunkFiles:
    """A FastSource: one file `f` kept as chunk files on disk; only `allowed` chunks are registered."""

    def __init__(self, d, data: bytes):
        self.data = data
        self.fds: dict[int, int] = {}
        self.allowed: set[int] = set()
        self.python_reads = 0
        self.lock = threading.Lock()
        for i in range(0, -(-len(data) // CHUNK)):
            p = d / f"c{i}"
            p.write_bytes(data[i * CHUNK:(i + 1) * CHUNK])
            self.fds[i] = os.open(p, os.O_RDONLY)

    def lookup(self, name: str) -> int | None:
        return len(self.data) if name == "f" else None

    def names(self) -> list[str]:
        return ["f"]

    def read(self, name: str, offset: int, size: int) -> bytes:
        with self.lock:
            self.python_reads += 1
        return self.data[offset:offset + size]

    def chunk_size(self, name: str) -> int | None:
        return CHUNK

    def chunk_fds(self, name: str, offset: int, size: int) -> list[tuple[int, int]]:
        first, last = offset // CHUNK, (offset + size - 1) // CHUNK
        return [(i, self.fds[i]) for i in range(first, last + 1) if i in self.allowed]


@pytest.fixture
def served(tmp_path):
    try:
        fast = fastread.load(fuse.MAX_PAGES * 4096, fastread.build().parent)
    except RuntimeError as e:
        pytest.skip(f"no C compiler: {e}")
    assert fast is not None
    (tmp_path / "chunks").mkdir()
    data = os.urandom(10 * CHUNK + 1234)  # a short last chunk
    src = ChunkFiles(tmp_path / "chunks", data)
    srv = fuse.FuseServer(tmp_path / "mnt", src, threads=2, open_flags=fuse.FOPEN_DIRECT_IO, fast=fast)
    srv.mount()
    srv.start()
    yield srv, src, fast, tmp_path / "mnt" / "f"
    fuse.unmount(tmp_path / "mnt")
    srv.wait()
    for fd in src.fds.values():
        os.close(fd)


def _pread(path, size: int, offset: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, size, offset)
    finally:
        os.close(fd)


def test_registered_chunks_are_served_in_c_with_the_right_bytes(served):
    srv, src, fast, f = served
    src.allowed = set(src.fds)
    data = src.data
    assert _pread(f, len(data), 0) == data  # first read: Python, which registers the chunks
    before_py, before_c = src.python_reads, fast.reads()
    for off, n in [(0, 100), (CHUNK - 10, 20), (3 * CHUNK + 7, 2 * CHUNK + 5), (len(data) - 50, 500),
                   (0, len(data)), (len(data) + 10, 10)]:
        assert _pread(f, n, off) == data[off:off + n], (off, n)
    assert src.python_reads == before_py  # none of these reached Python
    assert fast.reads() >= before_c + 5


def test_a_read_spanning_an_unregistered_chunk_goes_to_python(served):
    srv, src, fast, f = served
    src.allowed = set(src.fds) - {4}
    data = src.data
    assert _pread(f, len(data), 0) == data
    before = src.python_reads
    assert _pread(f, 2 * CHUNK, 3 * CHUNK + 100) == data[3 * CHUNK + 100:5 * CHUNK + 100]  # spans chunk 4
    assert src.python_reads == before + 1
    c = fast.reads()
    assert _pread(f, 100, 6 * CHUNK) == data[6 * CHUNK:6 * CHUNK + 100]
    assert fast.reads() == c + 1


def test_a_short_chunk_file_is_eio_never_zeros(served, tmp_path):
    srv, src, fast, f = served
    short = tmp_path / "short"
    short.write_bytes(src.data[2 * CHUNK:2 * CHUNK + 100])  # chunk 2, truncated
    os.close(src.fds[2])
    src.fds[2] = os.open(short, os.O_RDONLY)
    src.allowed = {2}
    assert _pread(f, 10, 2 * CHUNK) == src.data[2 * CHUNK:2 * CHUNK + 10]  # Python; registers chunk 2
    with pytest.raises(OSError) as e:
        _pread(f, 1000, 2 * CHUNK)  # C: the file ends before the chunk does
    assert e.value.errno == errno.EIO
