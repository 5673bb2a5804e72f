"""The lazy loader's Range GETs on kept-alive `http.client` connections (shoal.registry.fastget),
against the real registry (TLS, basic auth): the auth flow still runs (the first read's 401 goes the
httpx way, then every read reuses one connection with the header it earned), the bytes are the
blob's, a missing blob is the typed LayerNotFound, a registry restarted under a kept-alive
connection is read again on a new one, and one that is down or never answers is OriginUnavailable
within the timeout (never a second wait on the httpx path)."""
from __future__ import annotations

import hashlib
import os
import socket
import time

import pytest
from registryctl import RegistryServer

from shoal.core.errors import LayerNotFound, OriginUnavailable
from shoal.registry.client import RegistryClient


@pytest.fixture(scope="module")
def blob(registry):
    data = os.urandom(1 << 20)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    with registry.client() as cl:
        cl.upload_blob("shoal/fastget", digest, data=data)
    return data, digest


def test_range_reads_reuse_one_connection_after_the_auth_flow(registry, blob):
    data, digest = blob
    with registry.client() as cl:
        assert cl._fast is not None
        mark = registry.mark()
        for off in (0, 4096, 700_000, (1 << 20) - 10):
            assert cl.read_blob("shoal/fastget", digest, off, 128 << 10) == data[off:off + (128 << 10)]
        # the first read met the 401 here and went the httpx way (which answered the challenge; the
        # refused connection is dropped); the others came here with the header it earned, on one
        # kept-alive connection
        assert cl._fast.requests == 3 and cl._fast.connects == 2
        codes = [c for m, p, c in registry.requests(mark) if m == "GET" and "/blobs/" in p]
        assert codes.count(401) == 2 and codes.count(206) == 4  # the 401: here, then to httpx (once)
        with pytest.raises(LayerNotFound):  # a 404 goes the httpx way: the typed error
            cl.read_blob("shoal/fastget", "sha256:" + "0" * 64, 0, 10)


def test_a_restarted_registry_is_read_again_and_a_dead_one_is_unavailable(registry, blob):
    data, digest = blob
    own = RegistryServer(share=registry)
    try:
        with own.client(timeout=2.0) as cl:
            assert cl.read_blob("shoal/fastget", digest, 10, 100) == data[10:110]
            assert cl.read_blob("shoal/fastget", digest, 20, 100) == data[20:120]
            assert cl._fast is not None and cl._fast.connects == 2  # the 401's, then one kept alive
            own.stop()
            own.start()  # the kept-alive connection is dead now: retried once on a new one
            assert cl.read_blob("shoal/fastget", digest, 30, 100) == data[30:130]
            assert cl._fast.connects == 3
            own.stop()
            t = time.monotonic()
            with pytest.raises(OriginUnavailable):
                cl.read_blob("shoal/fastget", digest, 40, 100)
            assert time.monotonic() - t < 2.0
    finally:
        own.close()


def test_a_registry_that_never_answers_times_out_once():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)  # connections complete in the backlog; nothing ever answers
    try:
        port = srv.getsockname()[1]
        with RegistryClient(f"127.0.0.1:{port}", plain_http=True, timeout=0.5, anonymous=True) as cl:
            t = time.monotonic()
            with pytest.raises(OriginUnavailable, match="timed out"):
                cl.read_blob("shoal/x", "sha256:" + "1" * 64, 0, 4096)
            took = time.monotonic() - t
            assert 0.4 < took < 0.9, took  # one timeout, not the httpx path's second one after it
    finally:
        srv.close()
