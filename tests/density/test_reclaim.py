"""Reclaim of a sandbox's anonymous memory to zram: it leaves RAM, and comes back intact on resume."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
from conftest import hog_checksum_now, start_hog

from shoal.backends.container import zram
from shoal.core.contract import ReclaimRequest, SandboxState
from shoal.core.errors import InvalidArgument, NotSupported, SandboxNotFound

MIB = 1 << 20
HOG_MIB = 64


def test_zram_device_set_up_idempotent_and_torn_down(tmp_path: Path):
    state = tmp_path / "zram.json"
    dev = zram.setup(zram.ZramConfig(size_mb=64, algorithm="lz4", priority=77), state)
    try:
        assert zram.swaps().get(dev.path) == 77, "the device swaps at the configured priority"
        assert Path(f"/sys/block/{dev.name}/comp_algorithm").read_text().count("[lz4]") == 1
        assert int(Path(f"/sys/block/{dev.name}/disksize").read_text()) == 64 * MIB
        again = zram.setup(zram.ZramConfig(size_mb=64, algorithm="lz4", priority=77), state)
        assert again == dev, "a second setup finds the same device"
        assert zram.current(state) == dev
    finally:
        assert zram.teardown(state)
    assert dev.path not in zram.swaps()
    assert not Path(f"/sys/block/{dev.name}").exists(), "the device is removed, not only swapped off"
    assert zram.current(state) is None and not zram.teardown(state)


@pytest.mark.parametrize("cfg", [zram.ZramConfig(size_mb=0), zram.ZramConfig(size_mb=64, algorithm="nope"),
                                 zram.ZramConfig(size_mb=64, algorithm="../x"),
                                 zram.ZramConfig(size_mb=64, priority=-1)])
def test_zram_bad_settings_are_typed_errors(tmp_path: Path, cfg):
    with pytest.raises(InvalidArgument):
        zram.setup(cfg, tmp_path / "zram.json")
    assert zram.current(tmp_path / "zram.json") is None


def _mem(sb) -> int:
    return sb.info().memory_bytes


def test_paused_sandbox_reclaimed_and_intact_after_resume(zram_swap, make_sandbox, hog_image):
    sb = make_sandbox(hog_image, memory_mb=256, disk_mb=64)
    handle, want = start_hog(sb, HOG_MIB)
    before = _mem(sb)
    assert before >= HOG_MIB * MIB
    sb.pause()
    r = sb.reclaim(target=0.75)
    assert r.paused and sb.info().state == SandboxState.PAUSED, "a paused sandbox stays paused"
    assert r.anon_before >= HOG_MIB * MIB
    # at least most of the target left RAM (a no-op reclaim fails here) and went to swap
    assert r.memory_before - r.memory_after >= 0.6 * 0.75 * r.anon_before, r
    assert r.swapped >= 0.6 * 0.75 * HOG_MIB * MIB, r
    assert _mem(sb) <= r.memory_after + 4 * MIB
    assert 0 < r.duration_s < 30
    # any request resumes it; the memory pages back in on demand, byte for byte
    assert hog_checksum_now(sb) == want
    assert sb.info().state == SandboxState.RUNNING
    handle.close()


def test_running_sandbox_reclaimed_and_keeps_running(zram_swap, make_sandbox, hog_image):
    sb = make_sandbox(hog_image, memory_mb=256, disk_mb=64)
    handle, want = start_hog(sb, HOG_MIB)
    r = sb.reclaim(target=0.5)
    assert not r.paused and sb.info().state == SandboxState.RUNNING, "frozen only while reclaiming"
    assert r.memory_before - r.memory_after >= 0.6 * 0.5 * r.anon_before, r
    assert r.anon_after < r.anon_before
    assert sb.commands.run("echo alive").stdout == "alive\n"
    assert hog_checksum_now(sb) == want
    handle.close()


def test_tmpfs_upper_pages_follow_the_same_path(zram_swap, make_sandbox, base_image):
    """An idle sandbox's written files (tmpfs upper: shmem) are anonymous memory too."""
    sb = make_sandbox(base_image, memory_mb=256, disk_mb=128)
    assert sb.commands.run("head -c 48m /dev/urandom > /big && md5sum /big", timeout=60).ok
    want = sb.commands.run("md5sum /big").stdout
    sb.pause()
    r = sb.reclaim(target=1.0)
    assert r.memory_before - r.memory_after >= 0.5 * 48 * MIB, r
    assert sb.commands.run("md5sum /big").stdout == want


@pytest.mark.parametrize("target", [0, -0.5, 1.01, 2, math.nan, math.inf, True, "0.5", None])
def test_bad_target_is_a_typed_error(make_sandbox, base_image, target):
    sb = make_sandbox(base_image, memory_mb=64, disk_mb=16)
    with pytest.raises(InvalidArgument, match="target"):
        sb.reclaim(target=target)
    with pytest.raises(ValueError):
        ReclaimRequest.model_validate({"target": target})


def test_reclaim_of_an_unknown_sandbox(host):
    with pytest.raises(SandboxNotFound):
        host.reclaim("sb-nohost-000000000000", ReclaimRequest(target=0.5))


def test_backends_without_reclaim_say_so(host):
    """The contract's default: a typed NotSupported (HTTP 501), never a silent no-op."""
    from shoal.core.contract import SandboxBackend
    from shoal.core.errors import http_status

    with pytest.raises(NotSupported) as e:
        SandboxBackend.reclaim(host.backend("container"), "sb-x", ReclaimRequest())
    assert http_status(e.value) == 501


def test_reclaim_through_shoald(zram_swap, daemon, hog_image):
    """The route, the HTTP backend and the SDK over it; the reclaimed bytes reach /metrics."""
    import httpx

    from shoal.sdk import Sandbox

    sb = Sandbox.create(hog_image, url=daemon["url"], memory_mb=256, disk_mb=64)
    be = sb.backend
    try:
        handle, want = start_hog(sb, HOG_MIB)
        sb.pause()
        r = sb.reclaim(0.75)
        assert r.memory_before - r.memory_after >= 0.6 * 0.75 * r.anon_before, r
        with pytest.raises(InvalidArgument, match="target"):
            be.reclaim(sb.id, ReclaimRequest.model_construct(target=1.5))
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(daemon["sock"])), base_url="http://x") as c:
            metrics = c.get("/metrics").text
        line = next(x for x in metrics.splitlines() if x.startswith("shoal_reclaimed_bytes_total"))
        assert float(line.split()[-1]) >= r.memory_before - r.memory_after
        assert hog_checksum_now(sb) == want
        handle.close()
    finally:
        sb.kill()


def test_gvisor_sandbox_reclaim_is_not_supported(make_sandbox, base_image):
    """A backend without per-sandbox memory control answers NotSupported through the host's routing."""
    import shutil

    if not shutil.which("runsc"):
        pytest.skip("runsc (gVisor) is not installed")
    sb = make_sandbox(base_image, backend="gvisor", memory_mb=64, disk_mb=16)
    with pytest.raises(NotSupported, match="gvisor"):
        sb.reclaim(0.5)
    assert sb.commands.run("echo ok").stdout == "ok\n"
