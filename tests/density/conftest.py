"""Density fixtures: a zram swap device of the tests' own, and an image with a memory-holding process."""
from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from shoal.backends.container import zram

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def zram_swap(tmp_path_factory):
    """Shoal's zram device, made by the code under test on a private state file; torn down after the
    module (swap on the host changes what other modules see: an aggregate limit spills to swap
    instead of OOM-killing)."""
    state = tmp_path_factory.mktemp("zram") / "zram.json"
    try:
        dev = zram.setup(zram.ZramConfig(size_mb=1024, algorithm="lz4"), state)
    except Exception as e:  # e.g. a kernel without zram: the reclaim tests cannot run at all
        pytest.skip(f"no zram device: {e}")
    yield dev
    zram.teardown(state)


@pytest.fixture(scope="session")
def memhog_tree(tmp_path_factory) -> Path:
    """A layer tree with /usr/bin/memhog (tests/density/memhog.c, static): holds N MiB of anonymous memory."""
    if not shutil.which("gcc"):
        pytest.skip("gcc is needed to build the memory-holding test program")
    d = tmp_path_factory.mktemp("hog")
    binary = d / "usr" / "bin" / "memhog"
    binary.parent.mkdir(parents=True)
    subprocess.run(["gcc", "-static", "-O2", "-o", str(binary), str(HERE / "memhog.c")], check=True)
    binary.chmod(0o755)
    return d


def add_hog_image(host, memhog_tree: Path, base_image: str) -> str:
    layer = host.store.build_from_dir(memhog_tree, source="memhog")
    return host.store.create_image("density-hog:test", [*host.store.get_image(base_image).layers, layer.digest]).ref


@pytest.fixture(scope="session")
def hog_image(host, memhog_tree, base_image) -> str:
    """busybox + memhog on the session's root."""
    return add_hog_image(host, memhog_tree, base_image)


def start_hog(sb, mib: int):
    """Start memhog in the sandbox: (its handle, to keep alive; the checksum of its memory once filled)."""
    handle = sb.commands.start(["/usr/bin/memhog", str(mib), "/tmp/hog.sum"])
    return handle, read_when(sb, "/tmp/hog.sum")


def read_when(sb, path: str, timeout: float = 30.0, poke: str | None = None) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if poke:
            sb.commands.run(poke, timeout=10)
        r = sb.commands.run(f"cat {path} 2>/dev/null", timeout=10)
        if r.exit_code == 0 and r.stdout.strip():
            return r.stdout.strip()
        time.sleep(0.05)
    raise AssertionError(f"{path} did not appear in {sb.id}")


def hog_checksum_now(sb) -> str:
    """Make memhog re-read all its memory and return the checksum it computed."""
    sb.commands.run("rm -f /tmp/hog.sum.check", timeout=10)
    return read_when(sb, "/tmp/hog.sum.check", poke="kill -USR1 $(pidof memhog)")
