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
