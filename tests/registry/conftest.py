"""Fixtures of the registry tests: a real registry (tests/registryctl.py: Debian's `docker-registry` on
loopback, TLS from a private CA, htpasswd basic auth, storage in a tmp dir; its access log tells the
tests which requests reached it), an ordinary container image in it, and fresh Shoal roots."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from registryctl import PASSWORD, USER, RegistryServer, trust  # noqa: F401  (tests import USER, PASSWORD from here)
from roots import teardown_root, wipe_root

from shoal import Host
from shoal.registry import push

MiB = 1 << 20
BIG = 12 * MiB  # the random file of the lazily pulled test image


@pytest.fixture(scope="session")
def registry():
    """The session's registry: TLS (private CA) + htpasswd, on loopback (tests/registryctl.py)."""
    try:
        reg = RegistryServer()
    except RuntimeError as e:
        pytest.fail(str(e))
    trust(reg.addr)  # the operator's choice, made here: its Shoal images may load lazily
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


@pytest.fixture(scope="session")
def lazy_pushed(host, base_image, registry, tmp_path_factory) -> dict:
    """busybox + a layer with 12 MiB of random bytes and small files, pushed as shoal/lazy:1."""
    d = tmp_path_factory.mktemp("lazy-app")
    (d / "data").mkdir()
    big = os.urandom(BIG)
    (d / "data/big.bin").write_bytes(big)
    for i in range(30):
        (d / f"data/small-{i}.txt").write_text(f"small {i}\n" * 20)
    (d / "data/hello.txt").write_text("hello, lazily\n")
    layer = host.store.build_from_dir(d, source="test:lazy").digest
    host.store.create_image("lazyapp:1", ["busybox", layer], config={"env": {"WHO": "lazy"}, "workdir": "/data"})
    host.store.create_image("bbonly:1", ["busybox"])
    with registry.client() as cl:
        res = push(host.store, "lazyapp:1", f"{registry.addr}/shoal/lazy:1", client=cl)
        push(host.store, "bbonly:1", f"{registry.addr}/shoal/lazy:bb", client=cl)
    return {"layer": layer, "busybox": host.store.resolve("busybox"), "big": big, "push": res,
            "image_bytes": sum(x.size for x in res.layers)}


@pytest.fixture
def creds(monkeypatch):
    """The lazy daemon finds credentials where any registry client does: here, the environment."""
    monkeypatch.setenv("SHOAL_REGISTRY_USER", USER)
    monkeypatch.setenv("SHOAL_REGISTRY_PASSWORD", PASSWORD)
    monkeypatch.setenv("SHOAL_REGISTRY_HOST", "127.0.0.1")  # every loopback test registry (any port)
