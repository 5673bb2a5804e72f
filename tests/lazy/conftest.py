"""Fixtures for the lazy-loading tests: a real Range-capable HTTP origin, a fault proxy in front of it,
a layer built in the session's root and published there. Fresh Shoal roots that have never seen the
layer come from `make_root` (tests/conftest.py: torn down with their lazy daemon and mounts)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from servers import FaultProxy, RangeServer

from shoal.lazy.publish import publish_to_dir

BIG_MB = 24


@pytest.fixture(scope="session")
def origin_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("origin")


@pytest.fixture(scope="session")
def range_server(origin_dir):
    s = RangeServer(origin_dir)
    yield s
    s.close()


@pytest.fixture
def proxy(range_server):
    p = FaultProxy(range_server.port)
    yield p
    p.stop()


@pytest.fixture(scope="session")
def published(host, base_image, origin_dir, tmp_path_factory):
    """A layer (busybox + a 24 MiB file of random bytes + small files) built in the session root and
    published on the origin; returns its digest and chunk index."""
    tree = tmp_path_factory.mktemp("lazy-layer")
    (tree / "data").mkdir()
    big = os.urandom(BIG_MB << 20)
    (tree / "data/big.bin").write_bytes(big)
    for i in range(50):
        (tree / f"data/small-{i}.txt").write_text(f"small file {i}\n" * 10)
    (tree / "data/hello.txt").write_text("hello from a lazy layer\n")
    info = host.store.build_from_dir(tree, source="lazy-test")
    busybox = host.store.resolve("busybox")
    return {"layer": info.digest, "busybox": busybox, "big": big,
            "index": publish_to_dir(host.store, info.digest, origin_dir),
            "busybox_index": publish_to_dir(host.store, busybox, origin_dir)}
