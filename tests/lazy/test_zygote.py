"""Each root's lazy daemon is forked by the host's zygote (shoal.lazy.zygote), with the requester's
environment, and stays an ordinary per-root daemon (own pid, stopped with its root)."""
from __future__ import annotations

import os
import time
from pathlib import Path

from shoal.lazy import mount as lazy_mount
from shoal.lazy import zygote


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _zygote_up(timeout_s: float = 20.0) -> None:
    zygote.spawn()
    deadline = time.monotonic() + timeout_s
    while not zygote.socket_path().exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert zygote.socket_path().exists(), "the zygote did not start"


def test_the_daemon_is_forked_by_the_zygote_with_the_requesters_environment(make_root, monkeypatch):
    _zygote_up()
    monkeypatch.setenv("SHOAL_LAZY_FAST", "0")  # read by the daemon at start: it must get this env
    h = make_root()
    root = h.settings.root
    pid = lazy_mount.ensure_daemon(root)
    parent = _ppid(pid)
    assert b"shoal.lazy.zygote" in Path(f"/proc/{parent}/cmdline").read_bytes()  # forked, not a new process
    log = (root / "lazy" / "daemon.log").read_text()
    assert "warm reads: Python" in log, log  # the requester's SHOAL_LAZY_FAST=0, not the zygote's env
    # an ordinary per-root daemon: a second root gets its own, and stopping one leaves the other
    h2 = make_root()
    monkeypatch.delenv("SHOAL_LAZY_FAST")
    pid2 = lazy_mount.ensure_daemon(h2.settings.root)
    assert pid2 != pid and _ppid(pid2) == parent
    lazy_mount.stop_daemon(root)
    assert lazy_mount.daemon_pid(root) is None
    assert lazy_mount.daemon_pid(h2.settings.root) == pid2
    os.kill(parent, 0)  # the zygote outlives both


def test_without_a_zygote_the_daemon_is_a_process_of_its_own(make_root, monkeypatch):
    monkeypatch.setenv("SHOAL_LAZY_ZYGOTE", "0")
    h = make_root()
    pid = lazy_mount.ensure_daemon(h.settings.root)
    assert b"shoal.lazy.daemon" in Path(f"/proc/{pid}/cmdline").read_bytes()


def test_a_stop_right_after_a_start_leaves_no_daemon(make_root):
    """A lazy pull that fails at once has started the daemon (start_daemon does not wait); the root's
    teardown then stops it before it is up. The stop must wait for that start, or the daemon mounts
    <root>/lazyfs afterwards and outlives its root."""
    h = make_root()
    root = h.settings.root
    lazy_mount.start_daemon(root)
    lazy_mount.stop_daemon(root)
    time.sleep(2)  # long after a start: a daemon that was missed has mounted by now
    assert not lazy_mount._fuse_mounted(lazy_mount.lazyfs_dir(root))
    assert lazy_mount.daemon_pid(root) is None


def test_gc_stops_a_daemon_that_a_failed_lazy_pull_started(make_root):
    """A lazy pull starts the daemon first and may then fail before any lazy layer or chunk exists;
    gc (with nothing lazy to keep) still stops that daemon."""
    h = make_root()
    root = h.settings.root
    lazy_mount.start_daemon(root)
    h.store.gc()
    time.sleep(2)
    assert not lazy_mount._fuse_mounted(lazy_mount.lazyfs_dir(root))
    assert lazy_mount.daemon_pid(root) is None
