"""Credentials and TLS against the real registry: where credentials come from, and that they never
show up in an error, a repr or a log line."""
from __future__ import annotations

import base64
import json
import logging

import pytest

from shoal.core.errors import RegistryError
from shoal.registry import RegistryClient, find_credentials, pull

from .conftest import PASSWORD, USER


def test_wrong_password_names_the_registry_not_the_password(registry, other_host, caplog):
    wrong = "definitely-Wrong-pw-42"
    caplog.set_level(logging.DEBUG)
    with registry.client(password=wrong) as cl, pytest.raises(RegistryError) as e:
        pull(other_host.store, f"{registry.addr}/shoal/app:1", client=cl)
    msg = str(e.value)
    assert registry.addr in msg and "authentication failed" in msg and USER in msg
    assert wrong not in msg and wrong not in repr(e.value) and wrong not in caplog.text
    assert base64.b64encode(f"{USER}:{wrong}".encode()).decode() not in caplog.text
    assert wrong not in repr(cl) and wrong not in repr(cl.credentials)


def test_without_credentials_the_error_says_how_to_give_them(registry, monkeypatch, tmp_path):
    monkeypatch.delenv("SHOAL_REGISTRY_USER", raising=False)
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path))  # no config.json there
    with RegistryClient(registry.addr, ca=registry.ca) as cl:
        with pytest.raises(RegistryError, match="requires credentials"):
            cl.ping()


def test_credentials_from_the_environment(registry, monkeypatch, tmp_path):
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path))
    monkeypatch.setenv("SHOAL_REGISTRY_USER", USER)
    monkeypatch.setenv("SHOAL_REGISTRY_PASSWORD", PASSWORD)
    monkeypatch.setenv("SHOAL_REGISTRY_HOST", registry.addr)
    with RegistryClient(registry.addr, ca=registry.ca) as cl:
        cl.ping()
        assert cl.credentials is not None and cl.credentials.source == "env"


def test_credentials_from_the_environment_go_to_the_registry_they_name_only(registry, monkeypatch, tmp_path):
    """SHOAL_REGISTRY_USER / _PASSWORD went to every registry the host pulled from (before the fix):
    a tenant's registry answering `401 Basic` got the operator's credentials for another registry.
    They are now for the registries SHOAL_REGISTRY_HOST names (required with them)."""
    from servers import RangeServer

    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path))
    monkeypatch.setenv("SHOAL_REGISTRY_USER", USER)
    monkeypatch.setenv("SHOAL_REGISTRY_PASSWORD", PASSWORD)
    monkeypatch.setenv("SHOAL_REGISTRY_HOST", registry.addr)
    evil = RangeServer(tmp_path, challenge='Basic realm="evil"')  # plain HTTP, records Authorization
    try:
        with RegistryClient(f"127.0.0.1:{evil.port}", plain_http=True) as cl, \
                pytest.raises(RegistryError, match="requires credentials"):
            cl.ping()
        assert evil.authorizations and all(a[2] is None for a in evil.authorizations), evil.authorizations
        monkeypatch.setenv("SHOAL_REGISTRY_HOST", "127.0.0.1")  # the host: any port
        assert find_credentials(f"127.0.0.1:{evil.port}") is not None
        monkeypatch.setenv("SHOAL_REGISTRY_HOST", f"127.0.0.1:{evil.port + 1}, reg.example")  # other ports, hosts
        assert find_credentials(f"127.0.0.1:{evil.port}") is None
    finally:
        evil.close()
    monkeypatch.delenv("SHOAL_REGISTRY_HOST")  # unscoped: refused, typed, for every registry
    with pytest.raises(RegistryError, match="SHOAL_REGISTRY_HOST"):
        RegistryClient(registry.addr, ca=registry.ca)


def test_credentials_from_docker_config_auths(registry, monkeypatch, tmp_path):
    monkeypatch.delenv("SHOAL_REGISTRY_USER", raising=False)
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path))
    auth = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    (tmp_path / "config.json").write_text(json.dumps({"auths": {registry.addr: {"auth": auth}}}))
    creds = find_credentials(registry.addr)
    assert creds is not None and creds.source == "docker config" and PASSWORD not in repr(creds)
    with RegistryClient(registry.addr, ca=registry.ca) as cl:
        cl.ping()


def test_tls_needs_the_private_ca(registry, monkeypatch):
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("SHOAL_REGISTRY_CA", raising=False)
    with RegistryClient(registry.addr, username=USER, password=PASSWORD) as cl, \
            pytest.raises(RegistryError, match="not trusted"):
        cl.ping()
    monkeypatch.setenv("SSL_CERT_FILE", str(registry.ca))  # the usual variable works too
    with RegistryClient(registry.addr, username=USER, password=PASSWORD) as cl:
        cl.ping()
    monkeypatch.delenv("SSL_CERT_FILE")
    with RegistryClient(registry.addr, username=USER, password=PASSWORD, insecure=True) as cl:
        cl.ping()


def test_threads_racing_on_a_fresh_client_all_authenticate(registry, lazy_pushed):
    """Many threads start on a client that has not authenticated yet (the lazy daemon's first reads of
    every layer, and its prefetch, do): each gets a 401 for sending no header, and each must then
    retry with the credentials, not take another thread's answer for its own failed one."""
    import threading

    blob = lazy_pushed["push"].layers[0].blob
    errors: list[BaseException] = []
    for _ in range(3):  # a race: a few fresh clients
        barrier = threading.Barrier(16)
        with registry.client() as cl:
            def one(barrier: threading.Barrier = barrier, cl: RegistryClient = cl) -> None:
                try:
                    barrier.wait()
                    cl.request("GET", f"/v2/shoal/lazy/blobs/{blob}", repo="shoal/lazy", ok=(200, 206),
                               headers={"Range": "bytes=0-15"}).close()
                except BaseException as e:  # noqa: BLE001  collected, asserted below
                    errors.append(e)

            threads = [threading.Thread(target=one) for _ in range(16)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    assert not errors, errors[:3]
