"""Mounting a lazy layer: the layer store's side of the lazy daemon.

`mount_lazy(root, digest, target)` makes sure the root's daemon serves `<root>/lazyfs/` (starting it
if needed) and mounts `<root>/lazyfs/<hex>.erofs` read-only at `target`, file-backed like a local
layer. A mount made by a daemon that has since died is stale (its reads fail with EIO): `is_stale`
tells, and the store mounts the layer again for new sandboxes.
"""
from __future__ import annotations

import errno
import fcntl
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from ..core.errors import SandboxError
from ..layers import erofs
from . import fuse, zygote

START_TIMEOUT_S = 15.0


def lazyfs_dir(root: Path) -> Path:
    return Path(root) / "lazyfs"


def state_dir(root: Path) -> Path:
    d = Path(root) / "lazy"
    d.mkdir(parents=True, exist_ok=True)
    return d


def pid_path(root: Path) -> Path:
    return state_dir(root) / "daemon.pid"


def _fuse_mounted(path: Path) -> bool:
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            if left.split(" ")[4] == str(path) and right.startswith("fuse"):
                return True
    return False


def daemon_pid(root: Path) -> int | None:
    """The pid of the root's daemon if it runs and its mount answers."""
    try:
        pid = int(pid_path(root).read_text().split()[0])
        os.kill(pid, 0)
    except (OSError, ValueError, IndexError):
        return None
    if not _fuse_mounted(lazyfs_dir(root)):
        return None
    try:
        os.stat(lazyfs_dir(root))
    except OSError:
        return None
    return pid


def _starting_path(root: Path) -> Path:
    return state_dir(root) / "daemon.starting"


def _starting(root: Path) -> bool:
    """A daemon was spawned less than START_TIMEOUT_S ago and has not answered yet."""
    try:
        return time.time() - _starting_path(root).stat().st_mtime < START_TIMEOUT_S
    except OSError:
        return False


def _spawn(root: Path) -> subprocess.Popen | None:
    """Start the root's daemon: forked by the host's zygote when one runs (no interpreter start, no
    imports: milliseconds), else as a new process, and then the zygote is started for the next root.
    Returns the process to reap, None when the zygote forked it."""
    if _fuse_mounted(lazyfs_dir(root)):  # a dead daemon's mount
        fuse.unmount(lazyfs_dir(root))
    pid_path(root).unlink(missing_ok=True)
    _starting_path(root).write_text(f"{time.time()}\n")
    if zygote.request(root) is not None:
        return None
    src = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)}
    with open(state_dir(root) / "daemon.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "shoal.lazy.daemon", "--root", str(root)],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                                start_new_session=True, close_fds=True)
    zygote.spawn()
    return proc


def start_daemon(root: Path) -> None:
    """Start the root's lazy daemon if it does not run, without waiting for it: a lazy pull calls
    this first, so the daemon's start overlaps the pull and the sandbox's setup; `ensure_daemon`
    then waits for that start instead of spawning another."""
    root = Path(root)
    lock = os.open(state_dir(root) / "daemon.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if daemon_pid(root) is not None or _starting(root):
            return
        proc = _spawn(root)
        if proc is not None:
            threading.Thread(target=proc.wait, daemon=True).start()  # reaps the first process (it forks, exits)
    finally:
        os.close(lock)


def ensure_daemon(root: Path) -> int:
    """The pid of the root's lazy daemon, started (detached) if it does not run."""
    root = Path(root)
    lock = os.open(state_dir(root) / "daemon.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        pid = daemon_pid(root)
        if pid is not None:
            return pid
        if not _starting(root) and (proc := _spawn(root)) is not None:
            proc.wait(START_TIMEOUT_S)  # the first process forks the daemon and exits at once
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            pid = daemon_pid(root)
            if pid is not None:
                return pid
            time.sleep(0.005)
        _starting_path(root).unlink(missing_ok=True)
        tail = (state_dir(root) / "daemon.log").read_text(errors="replace")[-2000:]
        raise SandboxError(f"the lazy-layer daemon of {root} did not start: {tail}")
    finally:
        os.close(lock)


def warm(root: Path, digests: list[str]) -> None:
    """Read the first block of each lazy layer's file at once (threads): the daemon fetches their
    first chunks (EROFS superblocks, which each mount reads) concurrently, so mounting the layers one
    after another does not wait for one origin round trip per layer."""
    from concurrent.futures import ThreadPoolExecutor

    def one(digest: str) -> None:
        try:
            fd = os.open(lazyfs_dir(root) / f"{digest.split(':', 1)[1]}.erofs", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return
        try:
            os.pread(fd, 4096, 0)
        except OSError:
            pass  # the mount reports it
        finally:
            os.close(fd)

    if len(digests) > 1:
        ensure_daemon(root)
        with ThreadPoolExecutor(min(8, len(digests))) as ex:
            list(ex.map(one, digests))


def _marker(root: Path, digest: str) -> Path:
    return state_dir(root) / f"{digest.split(':', 1)[1]}.mounted"


def mount_lazy(root: Path, digest: str, target: Path) -> str:
    """Mount lazy layer `digest` at `target` (the caller holds the store's mount lock)."""
    pid = ensure_daemon(root)
    target.mkdir(parents=True, exist_ok=True)
    try:
        method = erofs.mount_image(lazyfs_dir(root) / f"{digest.split(':', 1)[1]}.erofs", target)
    except OSError:
        _why(root, digest)  # the typed error (OriginUnavailable, CorruptChunk) when the origin is the cause
        raise
    _marker(root, digest).write_text(f"{pid}\n")
    return method


def _why(root: Path, digest: str) -> None:
    """Read the layer's first chunk in this process: raises what the daemon saw as EIO."""
    from ..config import load_settings
    from ..layers.store import LayerStore
    from .layer import LazyLayer, chunk_cache_for, open_origin, spec_key

    store = LayerStore(load_settings(root))
    try:
        rec = store.lazy_layer(digest)
        if rec is None:
            return
        with open_origin(rec[1]) as origin:
            LazyLayer(rec[0], origin, spec_key(rec[1]), chunk_cache_for(root)).read(0, 4096)
    finally:
        store.close()


def is_stale(root: Path, digest: str) -> bool:
    """Whether the mount of `digest` was made by a daemon that no longer serves it."""
    try:
        pid = int(_marker(root, digest).read_text())
    except (OSError, ValueError):
        return True
    return daemon_pid(root) != pid


def forget(root: Path, digest: str) -> None:
    _marker(root, digest).unlink(missing_ok=True)


def _wait_for_start(root: Path) -> None:
    """A daemon spawned by `start_daemon` and not up yet would mount `<root>/lazyfs` after a stop that
    found nothing to stop, and outlive its root: wait until it has written its pid (or its start
    window has passed) before stopping."""
    if not (Path(root) / "lazy").is_dir():  # (state_dir would create it in a root being removed)
        return
    deadline = time.monotonic() + START_TIMEOUT_S
    while _starting(root) and not pid_path(root).exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def stop_daemon(root: Path, wait_s: float = 5.0) -> None:
    """Unmount `<root>/lazyfs` (the daemon exits once no layer mount holds it) and, if it still runs
    after `wait_s`, end it."""
    root = Path(root)
    _wait_for_start(root)
    if _fuse_mounted(lazyfs_dir(root)):
        fuse.unmount(lazyfs_dir(root))
    try:
        pid = int(pid_path(root).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except OSError as e:
            if e.errno == errno.ESRCH:
                break
        time.sleep(0.05)
    else:
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass
    pid_path(root).unlink(missing_ok=True)
