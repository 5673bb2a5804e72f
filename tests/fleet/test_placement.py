"""Placement scoring and the fleet CA, without a fleet: pure functions and files."""
from __future__ import annotations

import random
import ssl

import pytest

from shoal.fleet.placement import HostView, Wanted, rank


def host(hid: str, domain: str = "a", n: int = 0, cached: dict | None = None, images: dict | None = None,
         max_n: int = 100, mem: int = 10_000, used: int = 0) -> HostView:
    return HostView(hid, f"https://{hid}", domain, max_n, mem, n, used, images if images is not None else
                    {"img:1": ["sha256:base", "sha256:big"]}, cached if cached is not None else {})


def best(hosts, want, seed=0):
    return rank(hosts, want, random.Random(seed))[0].id


def test_locality_beats_free_capacity():
    cold = host("cold", cached={"sha256:base": 10})
    warm = host("warm", n=60, cached={"sha256:base": 10, "sha256:big": 990})
    assert best([cold, warm], Wanted(refs=("img:1",))) == "warm"


def test_locality_counts_bytes_not_layers():
    small = host("small", cached={"sha256:base": 10}, domain="a")
    large = host("large", cached={"sha256:big": 990}, domain="a")
    assert best([small, large], Wanted(refs=("img:1",))) == "large"


def test_spread_over_domains_then_free_capacity():
    a1, a2, b = host("a1", "a"), host("a2", "a", n=10), host("b", "b", n=30)
    assert best([a1, a2, b], Wanted(domain_counts={"a": 2})) == "b"
    assert best([a1, a2, b], Wanted(domain_counts={"b": 2})) == "a1"


def test_full_hosts_and_hosts_without_the_image_are_out():
    full = host("full", n=100, cached={"sha256:base": 1, "sha256:big": 1})
    nomem = host("nomem", used=9_990)
    other = host("other", images={})
    assert [h.id for h in rank([full, nomem, other], Wanted(refs=("img:1",), memory_mb=64))] == ["other"]
    assert rank([full], Wanted()) == []
    assert best([full, nomem, other, host("ok")], Wanted(refs=("img:1",), memory_mb=64)) == "ok"


def test_pinned_creates_go_to_their_host_or_nowhere():
    assert [h.id for h in rank([host("x"), host("y")], Wanted(pin="y"))] == ["y"]
    assert rank([host("x"), host("y", n=100)], Wanted(pin="y")) == []


def test_ties_are_broken_differently():
    hosts = [host(f"h{i}") for i in range(4)]
    assert len({best(hosts, Wanted(), seed) for seed in range(40)}) > 1


def test_fleet_ca_roles(tmp_path):
    from shoal.core.errors import InvalidArgument
    from shoal.fleet.pki import gateway_client_context, init_fleet, issue_server_cert

    files = init_fleet(tmp_path / "pki")
    assert oct(files.ca_key.stat().st_mode & 0o777) == "0o600" and files.admin_key.read_text().startswith("sk-")
    with pytest.raises(InvalidArgument):
        init_fleet(tmp_path / "pki")  # never replaced by accident
    cert, key = issue_server_cert(files.dir, "h1", ["10.0.0.1", "h1.example"], tmp_path / "h1")
    from cryptography import x509

    c = x509.load_pem_x509_certificate(cert.read_bytes())
    eku = c.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert [u.dotted_string for u in eku] == ["1.3.6.1.5.5.7.3.1"]  # serverAuth only: no use as a client
    g = x509.load_pem_x509_certificate(files.gateway_cert.read_bytes())
    assert [u.dotted_string for u in g.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value] == \
        ["1.3.6.1.5.5.7.3.2"]
    assert isinstance(gateway_client_context(files.dir), ssl.SSLContext)
    with pytest.raises(InvalidArgument):
        issue_server_cert(files.dir, "h2", [], tmp_path)
