"""shoald's idle policy ([density] idle_pause_s, reclaim_after_s): idle sandboxes are paused, then
reclaimed; a request wakes them with their memory intact; a busy one is left alone."""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import httpx
import pytest
from conftest import add_hog_image, hog_checksum_now, start_hog
from daemonctl import start_daemon
from roots import teardown_root

from shoal import Host, Sandbox
from shoal.backends.container import zram
from shoal.core.contract import SandboxState
from shoal.layers.busybox import make_busybox_tree

IDLE_PAUSE_S, RECLAIM_AFTER_S = 1.0, 2.0
MIB = 1 << 20


@pytest.fixture(scope="module")
def idle_daemon(memhog_tree, tmp_path_factory):
    """A shoald with the idle policy and zram enabled, on a root of its own (the policy pauses every
    sandbox of its root: other tests' sandboxes must not be on it)."""
    had_zram = zram.current() is not None
    root = Path(tempfile.mkdtemp(prefix="shoal-idle-", dir="/tmp"))
    host = Host.get(root)
    host.store.build_from_dir(make_busybox_tree(tmp_path_factory.mktemp("bb")), source="busybox", name="busybox")
    host.store.create_image("busybox:test", ["busybox"])
    image = add_hog_image(host, memhog_tree, "busybox:test")
    cfg = root / "config.toml"
    cfg.write_text(f"[density]\nzram_mb = 256\nidle_pause_s = {IDLE_PAUSE_S}\nreclaim_after_s = {RECLAIM_AFTER_S}\n"
                   "reclaim_target = 0.75\nsome_other_helpers_key = 1\n")
    proc = start_daemon(root, env={"SHOAL_CONFIG": str(cfg)})
    if zram.current() is None:  # the daemon logged why (e.g. a kernel without zram)
        proc.terminate()
        proc.wait(20)
        teardown_root(root)
        pytest.skip("shoald could not set up zram on this host")
    try:
        yield {"url": f"unix://{root / 'shoald.sock'}", "sock": root / "shoald.sock", "image": image}
    finally:
        proc.terminate()
        proc.wait(20)
        teardown_root(root)
        if not had_zram:
            zram.teardown()


def _metric(sock: Path, name: str) -> float:
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://x") as c:
        for line in c.get("/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for: {what}")


def test_daemon_sets_up_zram_from_the_config(idle_daemon):
    dev = zram.current()
    assert dev is not None and dev.size_mb == 256 and dev.path in zram.swaps()


def test_idle_sandbox_paused_then_reclaimed_then_woken_intact(idle_daemon):
    sb = Sandbox.create(idle_daemon["image"], url=idle_daemon["url"], memory_mb=256, disk_mb=64)
    try:
        handle, want = start_hog(sb, 64)
        before = sb.info().memory_bytes
        _wait(lambda: sb.info().state == SandboxState.PAUSED, IDLE_PAUSE_S + 5, "the idle pause")
        _wait(lambda: _metric(idle_daemon["sock"], "shoal_idle_reclaims_total") >= 1, RECLAIM_AFTER_S + 5,
              "the idle reclaim")
        assert sb.info().memory_bytes < before - 32 * MIB
        assert _metric(idle_daemon["sock"], "shoal_sandboxes_idle_reclaimed") >= 1
        assert _metric(idle_daemon["sock"], "shoal_zram_stored_bytes") >= 32 * MIB
        assert _metric(idle_daemon["sock"], "shoal_reclaimed_bytes_total") >= 32 * MIB
        assert hog_checksum_now(sb) == want  # the request woke it; its memory paged back in
        assert sb.info().state == SandboxState.RUNNING
        handle.close()
    finally:
        sb.kill()


def test_busy_sandbox_is_not_paused(idle_daemon):
    """A command running longer than the idle thresholds is activity the whole time."""
    sb = Sandbox.create(idle_daemon["image"], url=idle_daemon["url"], memory_mb=64, disk_mb=16)
    try:
        t0 = time.monotonic()
        r = sb.commands.run(f"sleep {RECLAIM_AFTER_S + 2}; echo done", timeout=30)
        assert r.stdout == "done\n" and time.monotonic() - t0 < RECLAIM_AFTER_S + 6
        assert sb.info().state == SandboxState.RUNNING, "not paused right after its command"
        # requests more often than idle_pause_s keep it awake
        for _ in range(int(RECLAIM_AFTER_S / 0.4) + 2):
            assert sb.commands.run("true").ok
            time.sleep(0.4)
            assert sb.info().state == SandboxState.RUNNING
    finally:
        sb.kill()


def test_requests_that_fail_auth_are_not_activity(idle_daemon):
    """Anyone who can reach the socket must not keep a sandbox awake: requests with a bad key, or by a
    tenant that may not see the sandbox, do not count, and it is paused under them."""
    from daemonctl import make_tenants

    other = make_tenants(idle_daemon["url"], names=("idle-outsider",))["idle-outsider"]
    sb = Sandbox.create(idle_daemon["image"], url=idle_daemon["url"], memory_mb=64, disk_mb=16)
    path = f"/v1/sandboxes/{sb.id}/exec"
    body = {"argv": ["true"]}
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(idle_daemon["sock"])), base_url="http://x") as c:
            assert sb.commands.run("true").ok  # real activity: the idle period starts now
            assert sb.info().state == SandboxState.RUNNING
            deadline = time.monotonic() + IDLE_PAUSE_S + 5
            while sb.info().state != SandboxState.PAUSED:
                assert time.monotonic() < deadline, "requests that failed auth kept the sandbox awake"
                assert c.post(path, json=body, headers={"Authorization": "Bearer not-a-key"}).status_code == 401
                assert c.post(path, json=body, headers={"Authorization": f"Bearer {other}"}).status_code == 404
                time.sleep(0.1)
    finally:
        sb.kill()
