"""A hostile registry's auth challenges and redirects (red-team review, round 2): real servers on
loopback. A TLS registry naming a plain-HTTP token realm gets no credentials sent in clear text; a
malformed realm and a redirect loop are typed errors (RegistryError), not httpx's own exceptions
escaping into a pull or the lazy daemon's prefetch threads."""
from __future__ import annotations

import json
import logging

import pytest
from servers import RangeServer, Redirector

from shoal.core.errors import RegistryError
from shoal.registry import RegistryClient

from .conftest import PASSWORD, USER


def _addr(url: str) -> str:
    return url.removeprefix("https://").removeprefix("http://").rstrip("/")


def test_a_tls_registry_naming_a_plain_http_realm_gets_no_credentials_sent(registry, tmp_path):
    """The realm would get the registry's basic credentials over plain HTTP (readable on the wire)."""
    (tmp_path / "token").write_text(json.dumps({"token": "t"}))
    realm = RangeServer(tmp_path)  # plain HTTP, records every Authorization header
    reg = RangeServer(tmp_path, tls=(registry.cert, registry.key),
                      challenge=f'Bearer realm="{realm.url}token",service="x"')
    try:
        with RegistryClient(_addr(reg.url), username=USER, password=PASSWORD, insecure=True) as cl, \
                pytest.raises(RegistryError, match="not HTTPS"):
            cl.ping()
        assert all(a[2] is None for a in realm.authorizations), realm.authorizations
        # anonymous: no secret to leak, the token is fetched
        with RegistryClient(_addr(reg.url), anonymous=True, insecure=True) as cl, \
                pytest.raises(RegistryError, match="authentication failed"):
            cl.ping()
        assert realm.gets("/token")
    finally:
        reg.close()
        realm.close()


def test_a_malformed_realm_is_a_registry_error(registry, tmp_path):
    reg = RangeServer(tmp_path, tls=(registry.cert, registry.key), challenge='Bearer realm="https://[::1",service="x"')
    try:
        with RegistryClient(_addr(reg.url), username=USER, password=PASSWORD, insecure=True) as cl, \
                pytest.raises(RegistryError, match="malformed realm"):
            cl.ping()
    finally:
        reg.close()


def test_a_redirect_loop_is_a_registry_error():
    loop = Redirector("http://127.0.0.1:1")
    loop.location = f"http://{loop.addr}"  # every request redirected to itself
    try:
        with RegistryClient(loop.addr, plain_http=True, anonymous=True) as cl:
            with pytest.raises(RegistryError, match="redirected more than"):
                cl.get_manifest("shoal/x", "1")
            with pytest.raises(RegistryError, match="redirected more than"):
                cl.read_blob("shoal/x", "sha256:" + "0" * 64, 0, 100)
    finally:
        loop.close()


def test_a_relative_redirect_s_query_is_in_no_log_record(caplog):
    """httpcore logs response headers (DEBUG): a relative Location (the registry's own host, a signed
    storage path) kept its query string, signature and all, in the log (the filter knew only URLs
    with a scheme)."""
    loop = Redirector("/storage/blob?X-Amz-Signature=SECRETSIG&X-Amz-Credential=AKIA", keep_path=False)
    try:
        with caplog.at_level(logging.DEBUG), RegistryClient(loop.addr, plain_http=True, anonymous=True) as cl, \
                pytest.raises(RegistryError, match="redirected more than"):
            cl.get_manifest("shoal/x", "1")
    finally:
        loop.close()
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "/storage/blob?<redacted>" in text  # the records are there, the query is not
    assert "SECRETSIG" not in text and "AKIA" not in text


class _Huge:
    """Answers every request but /token with `status` (and, for 401, a bearer challenge naming its own
    /token) and every /token with 200, each with a body of `size` zero bytes sent as fast as the
    client reads; `sent` counts the body bytes that left."""

    def __init__(self, status: int, size: int = 256 << 20):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.sent = 0
        outer = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_GET(self):
                code = 200 if self.path.startswith("/token") else status
                self.send_response(code)
                if code == 401:
                    self.send_header("WWW-Authenticate", f'Bearer realm="http://{outer.addr}/token",service="x"')
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(size))
                self.end_headers()
                block = b"\0" * (1 << 20)
                try:
                    for _ in range(size >> 20):
                        self.wfile.write(block)
                        outer.sent += len(block)
                except OSError:
                    self.close_connection = True

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        self.addr = f"127.0.0.1:{self.server.server_address[1]}"
        import threading

        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("status", [500, 404, 401])
def test_a_huge_error_or_token_body_is_not_read_whole(status):
    """A hostile registry's error answer (or its token service's) of any size was read whole into the
    puller's memory (the lazy daemon's too: a root process on the host) before its 64 KiB of JSON were
    looked at. Now at most a small bounded head is read: the server manages to send only what the
    socket buffers take."""
    from shoal.core.errors import ShoalError

    srv = _Huge(status)
    try:
        with RegistryClient(srv.addr, plain_http=True, anonymous=True, timeout=5) as cl, pytest.raises(ShoalError):
            cl.get_manifest("shoal/x", "1")
        assert srv.sent < (48 << 20), srv.sent
    finally:
        srv.close()


def test_an_index_pulled_by_digest_cannot_name_its_manifest_by_tag(tmp_path):
    """An image pulled by digest is pinned: the index's bytes are checked against it. Its entry named
    the platform's manifest by whatever string it held, and a tag was fetched unchecked (before the
    fix): the registry (or whoever pushes tags there) could swap a pinned image's content at will."""
    from shoal.registry.client import sha256_digest
    from shoal.registry.pull import resolve_manifest
    from shoal.registry.push import host_platform
    from shoal.registry.reference import parse_reference

    os_name, arch = host_platform()
    index = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
                        "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": "swap",
                                       "size": 100, "platform": {"os": os_name, "architecture": arch}}]}).encode()
    d = tmp_path / "v2/r/manifests"
    d.mkdir(parents=True)
    (d / sha256_digest(index)).write_bytes(index)
    (d / "swap").write_text(json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                                        "config": {"digest": "sha256:" + "1" * 64}, "layers": []}))
    reg = RangeServer(tmp_path)  # serves the files at their paths: a registry answering what it likes
    try:
        with RegistryClient(f"127.0.0.1:{reg.port}", plain_http=True, anonymous=True) as cl, \
                pytest.raises(RegistryError, match="not a sha256 digest"):
            resolve_manifest(cl, parse_reference(f"127.0.0.1:{reg.port}/r@{sha256_digest(index)}"))
        assert not reg.gets("/manifests/swap")
    finally:
        reg.close()
