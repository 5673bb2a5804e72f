"""Registries redirect blob GETs to their storage (S3, a CDN): the registry's credentials must never
follow to that other origin (another host, scheme or port), on any path that fetches blobs: eager
pulls, lazy chunk reads (through the lazy daemon), range and multi-range reads, and plain HTTP
origins. Real servers on loopback: the session's docker-registry (TLS + basic auth) behind
distribution's `redirect` storage middleware, and a Range-capable file server on its storage
directory as "S3", on another port (HTTPS: same scheme and host, other port; HTTP: other scheme
too). The storage server records every Authorization header it gets; the registry rejects requests
without credentials, so a pull that works shows they went where they belong. Also: no credential
(password, basic value, bearer token, presigned signature) appears in an error or a log line."""
from __future__ import annotations

import base64
import logging

import pytest
from registryctl import RegistryServer, trust
from servers import RangeServer, Redirector

from shoal.core.errors import OriginUnavailable, RegistryError
from shoal.registry import RegistryClient, pull

from .conftest import PASSWORD, USER

BASIC = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()


@pytest.fixture(scope="module", params=["https-other-port", "http-other-port"])
def storage(request, registry):
    """The session registry's storage served as "S3" on another port, and a registry process of its
    own on the same storage that redirects every blob GET there."""
    tls = (registry.cert, registry.key) if request.param.startswith("https") else None
    s3 = RangeServer(registry.storage, tls=tls)
    reg = RegistryServer(share=registry, redirect_to=s3.url)
    trust(reg.addr)
    yield reg, s3
    reg.close()
    s3.close()


def _no_credentials_reached(s3: RangeServer) -> None:
    blobs = [a for a in s3.authorizations if "/blobs/" in a[1]]
    assert blobs, "the registry did not redirect a blob GET to storage"
    assert all(a[2] is None for a in s3.authorizations), s3.authorizations


def _redirected(reg: RegistryServer, since: int) -> bool:
    return any(m == "GET" and "/blobs/" in p and st == 307 for m, p, st in reg.requests(since))


@pytest.mark.parametrize("fast_get", ["1", "0"])
def test_eager_pull_and_range_reads_send_no_credentials_to_storage(storage, lazy_pushed, fresh_host, monkeypatch,
                                                                   fast_get):
    reg, s3 = storage
    monkeypatch.setenv("SHOAL_REGISTRY_FAST_GET", fast_get)  # the kept-alive http.client path, then httpx only
    s3.reset()
    mark = reg.mark()
    with reg.client() as cl:
        res = pull(fresh_host.store, f"{reg.addr}/shoal/lazy:1", client=cl)  # config, indexes, layer blobs
        assert res.fetched and _redirected(reg, mark)
        blob = lazy_pushed["push"].layers[-1].blob
        assert cl.read_blob("shoal/lazy", blob, 4096, 1000) == _bytes(reg, blob)[4096:5096]
        got = cl.read_blob_ranges("shoal/lazy", blob, [(0, 100), (65536, 100), (200000, 50)])
        whole = _bytes(reg, blob)
        assert got == [whole[0:100], whole[65536:65636], whole[200000:200050]]
        assert cl.stat_blob("shoal/lazy", blob) == len(whole)
    _no_credentials_reached(s3)


def _bytes(reg: RegistryServer, digest: str) -> bytes:
    return reg.blob_path(digest).read_bytes()


def test_lazy_chunk_reads_through_the_daemon_send_no_credentials_to_storage(storage, lazy_pushed, make_root,
                                                                            creds):
    reg, s3 = storage
    h = make_root()
    with reg.client() as cl:
        res = pull(h.store, f"{reg.addr}/shoal/lazy:1", client=cl, lazy=True)
    assert res.lazy == [lazy_pushed["busybox"], lazy_pushed["layer"]]
    s3.reset()
    mark = reg.mark()
    mnt = h.store.ensure_mounted(res.image.layers)[-1]
    assert (mnt / "data/hello.txt").read_text() == "hello, lazily\n"
    with open(mnt / "data/big.bin", "rb") as f:  # chunks read by the lazy daemon, on demand
        f.seek(5 << 20)
        assert f.read(4096) == lazy_pushed["big"][5 << 20:(5 << 20) + 4096]
    assert _redirected(reg, mark)
    _no_credentials_reached(s3)


def test_a_redirect_target_that_asks_for_credentials_gets_none(registry, lazy_pushed, caplog):
    """Storage answering 401 with a bearer challenge whose realm is its own: the client must not take
    that as its registry's challenge (it would send the registry's basic credentials to the realm,
    that is, to the storage host). It fails, typed, naming the host and nothing secret."""
    greedy = RangeServer(registry.storage, challenge="set below, once the port is known")
    greedy.challenge = f'Bearer realm="{greedy.url}token",service="s3"'
    asking = RegistryServer(share=registry, redirect_to=greedy.url)
    caplog.set_level(logging.DEBUG)
    try:
        blob = lazy_pushed["push"].layers[-1].blob
        with asking.client() as cl, pytest.raises(RegistryError) as e:
            cl.read_blob("shoal/lazy", blob, 0, 100)
        assert greedy.authorizations and all(a[2] is None for a in greedy.authorizations), greedy.authorizations
        assert not any(p.startswith("/token") for _, p, _ in greedy.authorizations)  # its "token service"
        assert f"127.0.0.1:{greedy.port}" in str(e.value) and "not sent" in str(e.value)
        for secret in (PASSWORD, BASIC.split()[1]):
            assert secret not in str(e.value) and secret not in caplog.text
    finally:
        asking.close()
        greedy.close()


def test_http_origin_credentials_stay_with_their_origin(tmp_path, monkeypatch, caplog):
    """HttpOrigin (plain HTTP servers, buckets): basic credentials from the URL and a bearer token
    from the environment reach the origin, not the host it redirects to; errors and logs show neither."""
    from shoal.lazy.http import HttpOrigin

    (tmp_path / "layers").mkdir()
    (tmp_path / "layers/blob").write_bytes(bytes(range(256)) * 64)
    s3 = RangeServer(tmp_path)
    front = Redirector(s3.url)
    token = "tok-SECRET-b3arer-123"
    monkeypatch.setenv("SHOAL_TEST_ORIGIN_TOKEN", token)
    caplog.set_level(logging.DEBUG)
    try:
        for url, env in ((f"http://alice:pw-SECRET-xyz@{front.addr}/", None),
                         (f"http://{front.addr}/", "SHOAL_TEST_ORIGIN_TOKEN")):
            with HttpOrigin(url, token_env=env, timeout=5) as o:
                assert o.read("layers/blob", 300, 10) == (bytes(range(256)) * 64)[300:310]
                assert o.stat("layers/blob").size == 256 * 64
        assert [a[2] is not None for a in front.authorizations] == [True] * len(front.authorizations)
        assert front.authorizations and all(a[2] is None for a in s3.authorizations), s3.authorizations
        # a dead origin: the error names it without the user:password or the token
        dead = Redirector("http://127.0.0.1:1/")  # refused
        with HttpOrigin(f"http://alice:pw-SECRET-xyz@{dead.addr}/", token_env="SHOAL_TEST_ORIGIN_TOKEN",
                        timeout=2) as o, pytest.raises(OriginUnavailable) as e:
            o.read("layers/blob", 0, 10)
        dead.close()
        for secret in ("pw-SECRET-xyz", token):
            assert secret not in str(e.value) and secret not in repr(o) and secret not in caplog.text
    finally:
        front.close()
        s3.close()


def test_registry_errors_show_no_presigned_signature_or_userinfo(caplog, monkeypatch):
    """A registry redirecting to a storage URL that carries credentials of its own (userinfo, an S3
    presigned signature) that cannot be reached: the error names the registry, not the URL."""
    caplog.set_level(logging.DEBUG)
    front = Redirector("http://bob:pw-SECRET-u@127.0.0.1:1/blob?X-Amz-Signature=sig-SECRET-s", keep_path=False)
    try:
        with RegistryClient(front.addr, plain_http=True, username=USER, password=PASSWORD, timeout=3) as cl:
            for call in (lambda: cl.read_blob("r", "sha256:" + "a" * 64, 0, 10),
                         lambda: cl.get_blob("r", "sha256:" + "a" * 64)):
                with pytest.raises((OriginUnavailable, RegistryError)) as e:
                    call()
                for secret in ("pw-SECRET-u", "sig-SECRET-s", PASSWORD):
                    assert secret not in str(e.value) and secret not in caplog.text, str(e.value)
    finally:
        front.close()


def test_a_lazy_layer_s_origin_spec_never_stores_a_url_s_password(fresh_host, tmp_path):
    """An origin URL's user:password would sit in the layer store's JSON (and every copy of the root):
    refused, without echoing it; a token is named by token_env instead."""
    from shoal.core.errors import InvalidArgument
    from shoal.lazy.chunks import build_index

    (tmp_path / "blob").write_bytes(bytes(8192))
    idx = build_index("sha256:" + "cd" * 32, tmp_path / "blob")
    spec = {"kind": "http", "url": "http://alice:pw-SECRET-db@127.0.0.1:1/", "key": "layers/x.erofs"}
    with pytest.raises(InvalidArgument, match="token_env") as e:
        fresh_host.store.add_lazy_layer(idx, spec)
    assert "pw-SECRET-db" not in str(e.value) and fresh_host.store.lazy_digests() == []
    fresh_host.store.add_lazy_layer(idx, {**spec, "url": "http://127.0.0.1:1/", "token_env": "SOME_TOKEN"})
    assert fresh_host.store.lazy_digests() == [idx.layer]
