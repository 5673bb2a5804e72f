"""The per-sandbox supervisor of the gvisor backend: lifetimes and cleanup when no caller is alive.

A gVisor sandbox outlives the process that created it (a CLI call, a test), so its TTL, idle TTL
and cleanup cannot rely on that process. Each sandbox gets one small detached supervisor (this
file, run as a script: standard library only, ~13 MB RSS, no import of shoal) that:
  - waits on a pidfd of the sandbox's host process (runsc-sandbox);
  - ends the sandbox when its absolute TTL or its idle TTL expires (activity = the mtime of
    `activity`, or any live entry in `busy/`, both written by the backend);
  - re-reads meta.json on SIGHUP (set_ttl) and ends the sandbox on SIGTERM (kill);
  - on any end (also a crash or an OOM of the whole sandbox) releases everything: `runsc delete`,
    the overlay and tmpfs mounts, the state dir, and leaves a tombstone saying why.
If the supervisor itself dies, the backend's sweep() does the same cleanup ("orphaned").

Usage: supervisor.py <sandbox state dir> <tombstones dir>   (runsc flags are read from meta.json)
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time

_MNT_DETACH = 2


def _umount(path: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if os.path.ismount(path) and libc.umount2(path.encode(), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"umount {path}: {os.strerror(err)}")


def _counter(path: str, key: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                k, _, v = line.partition(" ")
                if k == key:
                    return int(v)
    except (OSError, ValueError):
        pass
    return 0


def end_reason(meta: dict) -> str:
    """Why the sandbox's host process died on its own: the memory cgroup's OOM kill, the pids
    cgroup's limit (the Sentry cannot make a thread and panics), or something else."""
    cg = meta.get("cgroup_path", "").lstrip("/")
    if _counter(f"/sys/fs/cgroup/memory/{cg}/memory.oom_control", "oom_kill") or \
            _counter(f"/sys/fs/cgroup/{cg}/memory.events", "oom_kill"):
        return "oom"
    if _counter(f"/sys/fs/cgroup/pids/{cg}/pids.events", "max") or _counter(f"/sys/fs/cgroup/{cg}/pids.events", "max"):
        return "pids"
    return "exited"


def _scandir(path: str) -> list[os.DirEntry]:
    try:
        return [e for e in os.scandir(path) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def cleanup(state_dir: str, tombstones: str, reason: str | None, known: dict | None = None) -> None:
    """Release everything a sandbox holds on the host; safe to call twice and from any process.
    The tombstone is written before the state dir goes, so a request never sees neither. `known`:
    the sandbox's meta as read earlier, used if meta.json is gone (a root wiped under us)."""
    sid = os.path.basename(state_dir.rstrip("/"))
    try:
        with open(os.path.join(state_dir, "meta.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        meta = known or {}
    runsc = meta.get("runsc")
    if runsc:
        # --force kills the sandbox if it still runs; delete also removes its cgroup
        subprocess.run([*runsc, "delete", "--force", sid], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=False, timeout=30)
    cg = meta.get("cgroup_path", "").strip("/")
    if cg:  # runsc delete removes them; if it failed (its state gone with a wiped root), do it here
        for d in [f"/sys/fs/cgroup/{cg}", *(os.path.join(c.path, cg) for c in _scandir("/sys/fs/cgroup"))]:
            with contextlib.suppress(OSError):
                os.rmdir(d)
    if reason:
        os.makedirs(tombstones, exist_ok=True)
        tomb = os.path.join(tombstones, sid)
        if not os.path.exists(tomb):
            with open(tomb + ".tmp", "w") as f:
                f.write(reason)
            os.replace(tomb + ".tmp", tomb)
    for sub in ("rootfs", "upper"):  # the overlay first: it sits on the tmpfs upper
        try:
            _umount(os.path.join(state_dir, sub))
        except OSError:
            pass
    shutil.rmtree(state_dir, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _last_activity(state_dir: str) -> float:
    """The last request's time; now while a request is in flight (a live busy/<pid>-<token> entry)."""
    busy = os.path.join(state_dir, "busy")
    try:
        for name in os.listdir(busy):
            pid = name.split("-", 1)[0]
            if pid.isdigit() and _pid_alive(int(pid)):
                return time.time()
            try:
                os.unlink(os.path.join(busy, name))  # its process died mid-request
            except OSError:
                pass
    except OSError:
        pass
    try:
        return os.stat(os.path.join(state_dir, "activity")).st_mtime
    except OSError:
        return time.time()


def supervise(state_dir: str, tombstones: str) -> None:
    # handlers only note the signal; the wakeup pipe ends the poll (a handler that raised could
    # interrupt the cleanup half-way)
    got: set[int] = set()
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    for sig in (signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: got.add(signum))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    open(os.path.join(state_dir, "supervised"), "w").close()  # from now on a signal is handled, not fatal
    with open(os.path.join(state_dir, "meta.json")) as f:
        meta = json.load(f)
    try:
        pidfd = os.pidfd_open(meta["sandbox_pid"])
    except (KeyError, ProcessLookupError):
        cleanup(state_dir, tombstones, "exited")
        return
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    poller.register(wake_r, select.POLLIN)
    reason = None
    while reason is None:
        try:
            with open(os.path.join(state_dir, "meta.json")) as f:
                meta = json.load(f)
        except (OSError, ValueError):
            pass
        now = time.time()
        deadline, why = None, None
        if meta.get("ttl"):
            deadline, why = meta["ttl_from"] + meta["ttl"], "ttl"
        if meta.get("idle_ttl"):
            idle_end = _last_activity(state_dir) + meta["idle_ttl"]
            if deadline is None or idle_end < deadline:
                deadline, why = idle_end, "idle_ttl"
        if deadline is not None and deadline <= now:
            reason = why
            break
        if deadline is None:
            wait_s = 3600.0
        elif why == "idle_ttl" or meta.get("idle_ttl"):
            wait_s = min(5.0, deadline - now)  # idle deadlines move with activity: look again soon
        else:
            wait_s = deadline - now
        for fd, _ in poller.poll(max(1, int(wait_s * 1000))):
            if fd == wake_r:
                with contextlib.suppress(OSError):
                    os.read(wake_r, 512)
            elif fd == pidfd:
                reason = end_reason(meta)
        if signal.SIGTERM in got:
            reason = "killed"
        got.discard(signal.SIGHUP)  # set_ttl: the loop re-reads meta.json
    cleanup(state_dir, tombstones, reason, known=meta)


if __name__ == "__main__":
    supervise(sys.argv[1], sys.argv[2])
