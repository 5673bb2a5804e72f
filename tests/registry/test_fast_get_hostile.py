"""The lazy loader's Range GETs against a hostile or broken origin (red-team review): an origin that
drip-feeds its answer (one byte at a time, each within the socket timeout) is OriginUnavailable once
the request's timeout has passed, not hours later; an origin that announces a body larger than the
range asked for (up to petabytes) is a typed error, read no further than the range; an origin that
answers another range than the one asked for never gets its bytes into the chunk cache."""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

import pytest

from shoal.core.errors import CorruptChunk, OriginUnavailable, ShoalError
from shoal.registry.client import RegistryClient

DIGEST = "sha256:" + "1" * 64


class Origin:
    """A raw TCP origin: `answer(conn, request_head)` writes whatever it likes."""

    def __init__(self, answer: Callable[[socket.socket, bytes], None]):
        self.answer = answer
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port = self.srv.getsockname()[1]
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(c,), daemon=True).start()

    def _one(self, c: socket.socket) -> None:
        with c:
            try:
                head = b""
                while b"\r\n\r\n" not in head:
                    chunk = c.recv(4096)
                    if not chunk:
                        return
                    head += chunk
                self.answer(c, head)
            except OSError:
                pass

    def close(self) -> None:
        self.stop.set()
        self.srv.close()


def _timed(fn: Callable[[], object], limit: float) -> tuple[object, float]:
    """(result or raised exception, seconds) of fn, given at most `limit` seconds (then it is abandoned)."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001  # reported to the test
            out.append(e)

    t0 = time.monotonic()
    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(limit)
    return (out[0] if out else None), time.monotonic() - t0


def _drip(c: socket.socket, head: bytes) -> None:
    c.sendall(b"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 0-4095/8192\r\nContent-Length: 4096\r\n\r\n")
    for _ in range(4096):  # one byte every 0.2 s: each recv is well within a 1 s socket timeout
        c.sendall(b"x")
        time.sleep(0.2)


def _drip_head(c: socket.socket, head: bytes) -> None:
    c.sendall(b"HTTP/1.1 206 Partial Content\r\n")
    for _ in range(60000):
        c.sendall(b"X")
        time.sleep(0.2)


@pytest.mark.parametrize("answer", [_drip, _drip_head], ids=["body", "headers"])
def test_a_drip_fed_answer_ends_at_the_timeout(answer):
    origin = Origin(answer)
    try:
        with RegistryClient(f"127.0.0.1:{origin.port}", plain_http=True, timeout=1.0, anonymous=True) as cl:
            got, took = _timed(lambda: cl.read_blob("shoal/x", DIGEST, 0, 4096), limit=8)
            assert isinstance(got, OriginUnavailable), (got, took)
            assert took < 3.0, took
    finally:
        origin.close()


def test_a_multi_range_answer_drip_fed_ends_at_the_timeout():
    def answer(c: socket.socket, head: bytes) -> None:
        c.sendall(b"HTTP/1.1 206 Partial Content\r\nContent-Type: multipart/byteranges; boundary=B\r\n"
                  b"Content-Length: 100000\r\n\r\n")
        for _ in range(100000):
            c.sendall(b"y")
            time.sleep(0.2)

    origin = Origin(answer)
    try:
        with RegistryClient(f"127.0.0.1:{origin.port}", plain_http=True, timeout=1.0, anonymous=True) as cl:
            got, took = _timed(lambda: cl.read_blob_ranges("shoal/x", DIGEST, [(0, 100), (4096, 100)]), limit=8)
            assert isinstance(got, OriginUnavailable), (got, took)
            assert took < 3.0, took
    finally:
        origin.close()


def test_an_announced_body_far_larger_than_the_range_is_a_typed_error():
    sent = []

    def answer(c: socket.socket, head: bytes) -> None:
        c.sendall(b"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 0-4095/8192\r\n"
                  b"Content-Length: 1000000000000000\r\n\r\n")
        block = b"z" * 65536
        for _ in range(64):  # 4 MiB, far beyond the 4 KiB asked for, then it hangs up
            c.sendall(block)
            sent.append(len(block))

    origin = Origin(answer)
    try:
        with RegistryClient(f"127.0.0.1:{origin.port}", plain_http=True, timeout=1.0, anonymous=True) as cl:
            got, _ = _timed(lambda: cl.read_blob("shoal/x", DIGEST, 0, 4096), limit=8)
            assert isinstance(got, ShoalError), repr(got)[:300]  # not MemoryError, not bytes
    finally:
        origin.close()


def test_another_range_than_asked_never_reaches_the_chunk_cache(tmp_path):
    """206 with the bytes of another range (a wrong Content-Range): the cache's digest check refuses them."""
    import hashlib

    from shoal.lazy.cache import ChunkCache

    good = b"g" * 4096

    def answer(c: socket.socket, head: bytes) -> None:
        c.sendall(b"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 4096-8191/8192\r\n"
                  b"Content-Length: 4096\r\n\r\n" + b"b" * 4096)

    origin = Origin(answer)
    try:
        with RegistryClient(f"127.0.0.1:{origin.port}", plain_http=True, timeout=1.0, anonymous=True) as cl:
            cache = ChunkCache(tmp_path)
            sha = hashlib.sha256(good).hexdigest()
            with pytest.raises(CorruptChunk):
                cache.get(sha, lambda: cl.read_blob("shoal/x", DIGEST, 0, 4096))
            assert not cache.has(sha)
    finally:
        origin.close()
