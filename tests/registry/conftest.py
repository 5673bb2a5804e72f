"""Fixtures of the registry tests: a real registry (tests/registryctl.py: Debian's `docker-registry` on
loopback, TLS from a private CA, htpasswd basic auth, storage in a tmp dir; its access log tells the
tests which requests reached it), an ordinary container image in it, and fresh Shoal roots."""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from registryctl import PASSWORD, USER, RegistryServer  # noqa: F401  (tests import USER, PASSWORD from here)
from roots import teardown_root, wipe_root

from shoal import Host


@pytest.fixture(scope="session")
def registry():
    """The session's registry: TLS (private CA) + htpasswd, on loopback (tests/registryctl.py)."""
    try:
        reg = RegistryServer()
    except RuntimeError as e:
        pytest.fail(str(e))
    yield reg
    reg.close()


@pytest.fixture(scope="session")
def ctr_image(registry, tmp_path_factory) -> dict:
    """An ordinary multi-arch OCI image in the registry, at shoal/ctr:multi (and :docker-v2)."""
    from .oci_build import push_container_image

    return push_container_image(registry, tmp_path_factory.mktemp("ctr-bb"))


@pytest.fixture(scope="session")
def other_root():
    """A second, fresh Shoal root: the host that pulls."""
    d = Path(tempfile.mkdtemp(prefix="shoal-p-", dir="/tmp"))
    yield d
    wipe_root(d)


@pytest.fixture(scope="session")
def other_host(other_root) -> Host:
    return Host.get(other_root)


@pytest.fixture
def fresh_host():
    """A root of its own, for a test that must start from nothing."""
    d = Path(tempfile.mkdtemp(prefix="shoal-f-", dir="/tmp"))
    yield Host.get(d)
    teardown_root(d)
