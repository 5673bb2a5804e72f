"""Shared by the benchmark smoke tests: a private Shoal root under /tmp, emptied and removed after."""
from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def bench_root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """/tmp/shoal-<test>-<suffix>: short (unix socket paths), killed and removed however the test ends."""
    root = Path("/tmp") / f"shoal-{request.node.name.removeprefix('test_')}-{tmp_path.name[-8:]}"
    yield root
    from shoal import Host

    host = Host.get(root)
    for info in host.backend("container").list():
        host.backend("container").kill(info.id)
    host.store.gc(keep_named=False)
    subprocess.run(["rm", "-rf", str(root)])
