#!/usr/bin/env python3
"""Density benchmark: fill the host with idle sandboxes until a stop rule, Shoal vs Docker.

Profiles (each an idle sandbox as an agent leaves it while the model thinks):

  shell          the busybox image with an interactive `sh` session open;
  python         python:3.11 + a small workspace package (densityws), with a session (bash) whose
                 background job is a live Python process that has imported densityws and pytest;
  python-paused  the same sandboxes as `python`, once filled: left idle for --idle-s, then paused
                 (Shoal: sb.pause(), the cgroup freezer; Docker: `docker pause`), and measured
                 paused: host memory, and resume -> first exec latency (Shoal: an exec on a paused
                 sandbox resumes it transparently; Docker: `docker unpause` + `docker exec`).

Docker runs the same images (Shoal's layer trees, merged and `docker import`ed) with `docker run -d -i`
and the same processes: the shell as PID 1 with stdin held open, for python plus the same Python
process. Same limits on both sides (512 MiB, 1 cpu, 512 pids, no network). A private dockerd
(bench/docker_engine.py) is started for the run and torn down after.

The fill creates sandboxes one after another until a stop rule:
  free memory (MemAvailable / MemTotal) under --free-min (10%); create p99 over the last 50
  creates above --p99-max (1 s); a kernel limit hit (a create failing with EAGAIN / EMFILE /
  ENFILE / ENOSPC / ENOMEM, or a tracked limit above 95% of its value); or --max / --docker-max.

At steps as the host fills it records, per sandbox (deltas from a baseline taken after warm-up, divided
by N): host memory from /proc/meminfo (used = MemTotal - MemAvailable, and AnonPages, Shmem, Slab,
SUnreclaim, KernelStack, PageTables, Cached), the sides' cgroup accounting (v1: hierarchical rss / cache
/ shmem / mapped_file and kmem usage; v2: anon / file / shmem / kernel), host tasks (threads, from
/proc/loadavg) and processes, tasks in the sides' pids cgroups, mounts in the host namespace and inside
one sandbox, page cache of the image's main binary (python3.11 / busybox) seen through the mounted layer
and the backing EROFS file (fincore: a file-backed EROFS may cache the same bytes twice), create and
ready latency percentiles for the window since the previous step, and exec latency on a sample of live
sandboxes. Kernel limits (pid_max, threads-max, mount-max, inotify instances, file-max, the client's
RLIMIT_NOFILE, vm.max_map_count) are read with their usage at every step; --tune-host raises them for
the run and restores them after.

Notes: the in-process client holds about 5 fds per sandbox with a session open, so the bench raises
RLIMIT_NOFILE. The host may be shared: memory deltas include whatever else ran; use --runs 3 and
read the spread. Hooks for the density features: --ksm (a `ksm` field on CreateRequest) and --reclaim
(sb.reclaim(target) on each paused sandbox; needs swap such as Shoal's zram) are used when the API
exists, else skipped and said so in the JSON.

Writes bench/results/density.json (+ .png). Each invocation replaces the profiles it ran and keeps
the others already in the file (so profiles can be run as separate <= 10 min jobs); --render-only
redraws the PNG from the JSON. --quick: the shell profile to 8 sandboxes (a smoke test; writes
/tmp/density-quick.json unless --out says otherwise).
"""
from __future__ import annotations

import argparse
import errno
import gc
import json
import os
import platform
import queue
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

console = Console(width=160)
RESULTS = Path(__file__).parent / "results"
DEFAULT_OUT = RESULTS / "density.json"
QUICK_OUT = Path(tempfile.gettempdir()) / "density-quick.json"  # a smoke run never overwrites the results
MiB = 2**20
ZRAM_DEV: list[Any] = []  # the run's zram device (--zram-mb), read at every step
PROFILES = ("shell", "python", "python-paused")
DOCKER_CGROUP = "shoal-density-docker"
LIMITS_MB, LIMITS_CPU, LIMITS_PIDS = 512, 1.0, 512
LAUNCH_SAMPLE = 50  # every 50th create keeps its launch steps (launch_report()), beside every slow one
RM_TIMEOUT_S = 180  # one `docker rm -f` of 50 containers; past it the engine is taken as hung
# what each profile's main binary is, for the page-cache sharing check
MAIN_FILES = {"shell": ["bin/busybox"],
              "python": ["usr/bin/python3.11", "usr/lib/x86_64-linux-gnu/libpython3.11.so.1.0"]}
MEMINFO_KEYS = ("used", "AnonPages", "Shmem", "Slab", "SUnreclaim", "KernelStack", "PageTables", "Cached",
                "Mapped")
# sysctls a dense host raises (--tune-host), and the values it raises them to
TUNE = {"kernel/pid_max": 4194304, "kernel/threads-max": 4194304, "fs/inotify/max_user_instances": 65536,
        "fs/inotify/max_user_watches": 4194304, "vm/max_map_count": 1048576, "fs/mount-max": 1000000,
        "fs/file-max": 9223372036854775807}
# the errnos that mean the kernel (or a per-process table) ran out of something
LIMIT_ERRNOS = {errno.EAGAIN: "EAGAIN (pids / threads)", errno.EMFILE: "EMFILE (RLIMIT_NOFILE)",
                errno.ENFILE: "ENFILE (file-max)", errno.ENOSPC: "ENOSPC (mount-max / inotify / namespaces)",
                errno.ENOMEM: "ENOMEM", errno.EUSERS: "EUSERS (namespaces)"}

WS_INIT = '''"""densityws: the small workspace package the python profile imports."""
from .core import mean, normalize, tokenize

__all__ = ["mean", "normalize", "tokenize"]
'''
WS_CORE = '''import re
import statistics
from dataclasses import dataclass


@dataclass
class Doc:
    text: str


def tokenize(s: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", s.lower())


def normalize(xs: list[float]) -> list[float]:
    m = max(xs) or 1.0
    return [x / m for x in xs]


def mean(xs: list[float]) -> float:
    return statistics.fmean(xs)
'''
WS_TEST = '''from densityws import mean, tokenize


def test_tokenize():
    assert tokenize("Hello, World") == ["hello", "world"]


def test_mean():
    assert mean([1.0, 3.0]) == 2.0
'''
# the live Python process: import the workspace package and pytest, say so on a fifo, then idle
WS_IDLE = '''import threading

import densityws  # noqa: F401
import pytest  # noqa: F401

with open("/tmp/ready", "w") as f:
    f.write("ready\\n")
threading.Event().wait()
'''
PY_START = "mkfifo /tmp/ready 2>/dev/null; python3 /work/repo/idle.py >/dev/null 2>&1 &"
PY_WAIT = "until [ -p /tmp/ready ]; do sleep 0.01; done; read x < /tmp/ready; echo $x"


# ------------------------------------------------------------------------------------------ pure helpers
def pct(xs: Iterable[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..1) of a non-empty sample."""
    s = sorted(xs)
    if not s:
        raise ValueError("percentile of an empty sample")
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def spread(xs: list[float]) -> dict:
    """min / median / max over runs (the spread every figure is reported with)."""
    if not xs:
        raise ValueError("spread of no runs")
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "n": len(xs)}


def lat_stats(xs: list[float]) -> dict | None:
    """p50 / p99 / max in milliseconds of latencies in seconds."""
    if not xs:
        return None
    return {"p50": pct(xs, 0.5) * 1e3, "p99": pct(xs, 0.99) * 1e3, "max": max(xs) * 1e3, "count": len(xs)}


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo in bytes, plus used = MemTotal - MemAvailable."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if not parts:
            continue
        out[key.strip()] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    if "MemTotal" in out and "MemAvailable" in out:
        out["used"] = out["MemTotal"] - out["MemAvailable"]
    return out


def per_sandbox(before: dict[str, int], after: dict[str, int], n: int, keys: Iterable[str]) -> dict[str, float]:
    """(after - before) / n for each key present in both: bytes per sandbox."""
    if n <= 0:
        raise ValueError("per-sandbox figures need n >= 1")
    return {k: (after[k] - before[k]) / n for k in keys if k in before and k in after}


def parse_memory_stat(text: str) -> dict[str, int]:
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            out[parts[0]] = int(parts[1])
    return out


def cgroup_totals(stat: dict[str, int], kmem: int | None = None) -> dict[str, int]:
    """A memory cgroup's hierarchical totals as {anon, file, shmem, mapped_file, kernel} (v1 or v2 names);
    kmem: v1's memory.kmem.usage_in_bytes where the kernel still has it (v2's memory.stat has `kernel`)."""
    if "total_rss" in stat:  # v1, hierarchical
        out = {"anon": stat["total_rss"], "file": stat.get("total_cache", 0), "shmem": stat.get("total_shmem", 0),
               "mapped_file": stat.get("total_mapped_file", 0)}
        if kmem is not None:
            out["kernel"] = kmem
        return out
    out = {"anon": stat.get("anon", 0), "file": stat.get("file", 0), "shmem": stat.get("shmem", 0),
           "mapped_file": stat.get("file_mapped", 0)}
    if "kernel" in stat:
        out["kernel"] = stat["kernel"]
    elif "slab" in stat:
        out["kernel"] = stat["slab"] + stat.get("kernel_stack", 0) + stat.get("pagetables", 0)
    return out


def fill_steps(max_n: int, first: int = 10) -> list[int]:
    """The N at which the fill measures: 1-2-5 decades from `first` up to max_n, plus the quarters of
    max_n (so a long fill has points near its end), plus max_n itself."""
    if max_n < 1:
        raise ValueError("max_n must be >= 1")
    pts = {max_n}
    dec = 1
    while dec <= max_n:
        for m in (1, 2, 5):
            if first <= m * dec <= max_n:
                pts.add(m * dec)
        dec *= 10
    if max_n >= 100:
        pts.update(max_n * k // 4 for k in (1, 2, 3))
    if max_n < first:
        pts.update(range(1, max_n + 1))
    return sorted(pts)


def limit_usage(sysctl: dict[str, int], usage: dict[str, int]) -> dict[str, dict]:
    """Each tracked kernel limit: {used, limit, frac}. usage keys: threads, mounts, files, inotify,
    client_fds (+ client_nofile), maps (the largest map count of the processes watched)."""
    pairs = {
        "threads (pid_max / threads-max)": ("threads", min(sysctl.get("kernel/pid_max", 1 << 22),
                                                           sysctl.get("kernel/threads-max", 1 << 22))),
        "mounts per namespace (fs.mount-max)": ("mounts", sysctl.get("fs/mount-max", 100000)),
        "open files (fs.file-max)": ("files", sysctl.get("fs/file-max", 1 << 62)),
        "inotify instances (max_user_instances)": ("inotify", sysctl.get("fs/inotify/max_user_instances", 128)),
        "client fds (RLIMIT_NOFILE)": ("client_fds", usage.get("client_nofile", 1 << 20)),
        "maps per process (vm.max_map_count)": ("maps", sysctl.get("vm/max_map_count", 65530)),
    }
    out = {}
    for name, (key, lim) in pairs.items():
        if key in usage:
            out[name] = {"used": usage[key], "limit": lim, "frac": usage[key] / lim if lim else 0.0}
    return out


def stop_reason(*, n: int, max_n: int, free_frac: float, free_min: float, recent_create_s: list[float],
                p99_max_s: float, limits: dict[str, dict], limit_frac: float = 0.95,
                avail_bytes: int | None = None, avail_min_bytes: int = 0) -> str | None:
    """Why the fill stops at N=n, or None to go on (the issue's stop rule, in order; then the shared
    host's guard: MemAvailable kept above --min-available-gib for the other users of the machine)."""
    if free_frac < free_min:
        return f"free memory {free_frac * 100:.1f}% < {free_min * 100:.0f}%"
    if avail_min_bytes and avail_bytes is not None and avail_bytes < avail_min_bytes:
        return (f"shared-host guard: MemAvailable {avail_bytes / (1 << 30):.1f} GiB < "
                f"{avail_min_bytes / (1 << 30):g} GiB (--min-available-gib)")
    if len(recent_create_s) >= 50 and pct(recent_create_s, 0.99) > p99_max_s:
        return f"create p99 {pct(recent_create_s, 0.99) * 1e3:.0f} ms > {p99_max_s * 1e3:.0f} ms"
    for name, u in limits.items():
        if u["frac"] >= limit_frac:
            return f"kernel limit near: {name} {u['used']}/{u['limit']}"
    if n >= max_n:
        return f"--max {max_n} reached"
    return None


def classify_error(exc: BaseException) -> str:
    """A create failure as a stop reason: a kernel limit (by errno, also when only the message has it), or
    the error itself."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        en = getattr(e, "errno", None)
        if isinstance(en, int) and en in LIMIT_ERRNOS:
            return f"kernel limit hit: {LIMIT_ERRNOS[en]}: {str(exc)[:200]}"
        e = e.__cause__ or e.__context__
    text = str(exc)
    for en, label in LIMIT_ERRNOS.items():
        if os.strerror(en) in text or errno.errorcode[en] in text:
            return f"kernel limit hit: {label}: {text[:200]}"
    if "Too many open files" in text:
        return f"kernel limit hit: {LIMIT_ERRNOS[errno.EMFILE]}: {text[:200]}"
    return f"create failed: {type(exc).__name__}: {text[:200]}"


def parse_fincore(text: str) -> int:
    """Resident bytes from `fincore --bytes --noheadings --output RES <file>` (0 when empty)."""
    total = 0
    for line in text.split():
        if line.isdigit():
            total += int(line)
    return total


def parse_filefrag(text: str) -> list[tuple[int, int]]:
    """(physical offset, length) in bytes of each extent from `filefrag -v -b1 FILE` (byte units). On a
    file-backed EROFS mount the physical offset is the offset in the backing .erofs file."""
    out = []
    for line in text.splitlines():
        parts = line.replace(":", " ").replace("..", " ").split()
        # "0:  0.. 6832127:  7794688.. 14626815: 6832128:  flags" -> idx lstart lend pstart pend len ...
        if len(parts) >= 6 and all(p.isdigit() for p in parts[:6]):
            out.append((int(parts[3]), int(parts[5])))
    return out


def tune_plan(current: dict[str, int], wanted: dict[str, int] | None = None) -> dict[str, tuple[int, int]]:
    """sysctl -> (old, new) for each limit below what a dense host wants: only raises, never lowers."""
    wanted = TUNE if wanted is None else wanted
    return {k: (current[k], v) for k, v in wanted.items() if k in current and current[k] < v}


def project_limits(step: dict, target_n: int, sysctl: dict[str, int], nofile: int) -> dict[str, dict]:
    """What `target_n` sandboxes would need of each kernel limit, from the per-sandbox use at a step:
    {limit: {per_sandbox, needed, limit, fits}}. Host-wide figures (tasks, mounts in the host namespace,
    open files, inotify instances) and the client's fds (one process holds every sandbox's handles)."""
    per = {
        "kernel.pid_max / kernel.threads-max (tasks)": (
            (step.get("attributed_per_sb") or {}).get("tasks", step.get("tasks_per_sb")),
            min(sysctl.get("kernel/pid_max", 1 << 22), sysctl.get("kernel/threads-max", 1 << 22))),
        "fs.mount-max (mounts in the host namespace)": (step.get("mounts_host_per_sb"), sysctl.get("fs/mount-max")),
        "fs.file-max (open files, host)": (step.get("files_per_sb"), sysctl.get("fs/file-max")),
        "fs.inotify.max_user_instances": (step.get("inotify_per_sb"), sysctl.get("fs/inotify/max_user_instances")),
        "RLIMIT_NOFILE of the client process": ((step.get("client") or {}).get("fds_per_sb"), nofile),
    }
    out = {}
    for name, (ps, lim) in per.items():
        if ps is None or lim is None:
            continue
        need = max(0.0, ps) * target_n
        out[name] = {"per_sandbox": ps, "needed": need, "limit": lim, "fits": need <= lim}
    return out


def summarize(runs: list[dict]) -> dict:
    """Spread over runs: N held, and at each step all runs reached, per-sandbox memory (used, anon, cgroup
    anon + kernel), tasks, mounts, create / exec latency; plus the paused figures where present."""
    out: dict[str, Any] = {"runs": len(runs), "n_held": spread([r["n_held"] for r in runs])}
    if not runs or not all(r.get("steps") for r in runs):
        return out
    common = set.intersection(*({s["n"] for s in r["steps"]} for r in runs))
    rows = []
    for n in sorted(common):
        at = [next(s for s in r["steps"] if s["n"] == n) for r in runs]
        row: dict[str, Any] = {"n": n}
        for name, get in STEP_METRICS.items():
            vals = [v for v in (get(s) for s in at) if v is not None]
            if len(vals) == len(at):
                row[name] = spread(vals)
        rows.append(row)
    out["by_step"] = rows
    if rows:
        out["last_common"] = rows[-1]
    ends = [r.get("end") for r in runs]
    if ends and all(ends):  # --idle-pipeline: each run's host once all its sandboxes were paused (merged, reclaimed)
        end: dict[str, Any] = {"n": spread([e["n"] for e in ends])}  # type: ignore[index]
        for name, get in STEP_METRICS.items():
            vals = [v for v in (get(e) for e in ends if e) if v is not None]
            if len(vals) == len(ends):
                end[name] = spread(vals)
        out["end"] = end
    return out


def _g(*path: str) -> Callable[[dict], float | None]:
    def get(d: dict) -> float | None:
        cur: Any = d
        for p in path:
            if not isinstance(cur, dict) or cur.get(p) is None:
                return None
            cur = cur[p]
        return float(cur)
    return get


STEP_METRICS: dict[str, Callable[[dict], float | None]] = {
    "mem_used_mib": lambda s: s["meminfo_per_sb"]["used"] / MiB if "used" in s["meminfo_per_sb"] else None,
    "anon_mib": lambda s: s["meminfo_per_sb"].get("AnonPages", 0) / MiB,
    "slab_mib": lambda s: s["meminfo_per_sb"].get("Slab", 0) / MiB,
    "cg_anon_mib": lambda s: s["cgroup_per_sb"]["anon"] / MiB if s.get("cgroup_per_sb") else None,
    "cg_kernel_mib": lambda s: (s["cgroup_per_sb"]["kernel"] / MiB
                                if s.get("cgroup_per_sb") and "kernel" in s["cgroup_per_sb"] else None),
    "attributed_mib": lambda s: s["attributed_per_sb"]["memory"] / MiB if s.get("attributed_per_sb") else None,
    "attributed_tasks": _g("attributed_per_sb", "tasks"),
    "helper_pss_mib": lambda s: s["helpers_per_sb"]["pss"] / MiB if s.get("helpers_per_sb") else None,
    "tasks": _g("tasks_per_sb"),
    "cgroup_tasks": _g("cgroup_tasks_per_sb"),
    "processes": _g("processes_per_sb"),
    "mounts_host": _g("mounts_host_per_sb"),
    "mounts_in_sandbox": _g("mounts_in_sandbox"),
    "create_p50_ms": _g("create_ms", "p50"),
    "create_p99_ms": _g("create_ms", "p99"),
    "ready_p50_ms": _g("ready_ms", "p50"),
    "exec_p50_ms": _g("exec_ms", "p50"),
    "client_fds": _g("client", "fds_per_sb"),
}


# ------------------------------------------------------------------------------------------ host readings
NS_SYSCTLS = ("user/max_mnt_namespaces", "user/max_pid_namespaces", "user/max_net_namespaces",
              "user/max_ipc_namespaces", "user/max_uts_namespaces", "user/max_cgroup_namespaces")


def read_sysctls(keys: Iterable[str] = tuple(TUNE) + ("fs/nr_open",) + NS_SYSCTLS) -> dict[str, int]:
    out = {}
    for k in keys:
        try:
            out[k] = int(Path("/proc/sys", k).read_text().split()[0])
        except (OSError, ValueError):
            pass
    return out


def write_sysctl(key: str, value: int) -> None:
    Path("/proc/sys", key).write_text(str(value))


def meminfo() -> dict[str, int]:
    return parse_meminfo(Path("/proc/meminfo").read_text())


def nr_threads() -> int:
    return int(Path("/proc/loadavg").read_text().split()[3].split("/")[1])


def nr_processes() -> int:
    return sum(1 for d in os.listdir("/proc") if d.isdigit())


def host_mounts() -> int:
    return len(Path("/proc/self/mountinfo").read_text().splitlines())


def inotify_instances() -> int:
    """inotify instances open on the host (all users: this bench runs as root, and so do Shoal and dockerd)."""
    n = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    if os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:inotify":
                        n += 1
                except OSError:
                    pass
        except OSError:
            pass
    return n


def map_count(pid: int | str = "self") -> int:
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def fd_count(pid: int | str = "self") -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def ksmd_cpu_s() -> float | None:
    """CPU seconds ksmd (the kernel's same-page merging thread) has used since boot."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() != "ksmd":
                continue
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
        except (OSError, ValueError, IndexError):
            continue
    return None


def kill_cgroup_tasks(name: str) -> int:
    """SIGKILL every task under a cgroup parent (each v1 hierarchy that has it, or v2): the bench's last
    resort when an engine stops answering its teardown. Returns the tasks signalled."""
    from shoal.backends.container.cgroups import CGROUP_ROOT

    pids: set[int] = set()
    for top in [CGROUP_ROOT / name, *CGROUP_ROOT.glob(f"*/{name}")]:
        for procs in top.rglob("cgroup.procs") if top.is_dir() else ():
            try:
                pids.update(int(x) for x in procs.read_text().split())
            except (OSError, ValueError):
                pass
    n = 0
    for pid in pids:
        try:
            os.kill(pid, 9)
            n += 1
        except OSError:
            pass
    for state in (CGROUP_ROOT / "freezer" / name).rglob("freezer.state"):  # a frozen task dies once thawed
        try:
            state.write_text("THAWED")
        except OSError:
            pass
    for state in (CGROUP_ROOT / name).rglob("cgroup.freeze"):  # v2
        try:
            state.write_text("0")
        except OSError:
            pass
    return n


def memcg_count() -> int | None:
    """Memory cgroups on the host, from /proc/cgroups (v1: the memory hierarchy's)."""
    for line in Path("/proc/cgroups").read_text().splitlines():
        f = line.split()
        if f and f[0] == "memory":
            return int(f[2])
    return None


def memcg_dir(name: str) -> Path:
    from shoal.backends.container.cgroups import CGROUP_ROOT

    v1 = CGROUP_ROOT / "memory"
    return (v1 if v1.is_dir() else CGROUP_ROOT) / name


def helper_usage(match: str) -> dict[str, int]:
    """Host-side helpers of a side's sandboxes (processes outside the sandboxes' cgroups whose command
    line holds `match`: Shoal's supervisors; dockerd, containerd and the shims of the private engine):
    {processes, threads, pss} (pss: proportional set size, shared pages split between their users)."""
    out = {"processes": 0, "threads": 0, "pss": 0}
    if not match:
        return out
    needle = match.encode()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if needle not in f.read().replace(b"\0", b" "):
                    continue
            status = Path(f"/proc/{pid}/status").read_text()
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except OSError:
            continue
        out["processes"] += 1
        out["threads"] += next((int(x.split()[1]) for x in status.splitlines() if x.startswith("Threads:")), 1)
        out["pss"] += next((int(x.split()[1]) * 1024 for x in rollup.splitlines() if x.startswith("Pss:")), 0)
    return out


def pids_current(name: str) -> int | None:
    """Tasks in a cgroup parent and its children (pids controller: v1 hierarchy or v2)."""
    from shoal.backends.container.cgroups import CGROUP_ROOT

    for d in (CGROUP_ROOT / "pids" / name, CGROUP_ROOT / name):
        try:
            return int((d / "pids.current").read_text())
        except (OSError, ValueError):
            continue
    return None


def memcg_totals(d: Path) -> dict[str, int] | None:
    try:
        stat = parse_memory_stat((d / "memory.stat").read_text())
    except OSError:
        return None
    kmem = None
    try:
        kmem = int((d / "memory.kmem.usage_in_bytes").read_text())
    except (OSError, ValueError):
        pass
    return cgroup_totals(stat, kmem)


def fincore_bytes(path: Path) -> int | None:
    if not path.exists() or not shutil.which("fincore"):
        return None
    r = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)], capture_output=True,
                       text=True, check=False)
    return parse_fincore(r.stdout) if r.returncode == 0 else None


def mincore_bytes(path: Path, ranges: list[tuple[int, int]]) -> int:
    """Bytes of `ranges` (offset, length) of `path` that sit in its page cache: mmap + mincore, nothing read."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap {path}")
        total = 0
        try:
            for off, length in ranges:
                start, end = off - off % page, min(size, off + length)
                if end <= start:
                    continue
                vec = (ctypes.c_ubyte * ((end - start + page - 1) // page))()
                if libc.mincore(addr + start, end - start, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore {path}")
                total += sum(v & 1 for v in vec) * page
        finally:
            libc.munmap(addr, size)
        return total
    finally:
        os.close(fd)


def backing_cache_of(file_in_mount: Path, backing: Path) -> dict | None:
    """For a file on a file-backed EROFS mount: its bytes cached in the mount's own page cache, and the
    same bytes cached in the backing .erofs file (its extents, from FIEMAP). Both non-zero = cached twice."""
    if not shutil.which("filefrag") or not file_in_mount.exists() or not backing.exists():
        return None
    r = subprocess.run(["filefrag", "-v", "-b1", str(file_in_mount)], capture_output=True, text=True, check=False)
    extents = parse_filefrag(r.stdout)
    if r.returncode != 0 or not extents:
        return None
    return {"file_bytes": file_in_mount.stat().st_size, "in_mount_cache": fincore_bytes(file_in_mount),
            "in_backing_file_cache": mincore_bytes(backing, extents), "extents": len(extents)}


def double_cache_probe(backing: Path, rel: str) -> dict:
    """Does a file-backed EROFS mount cache what it reads twice? For each mount option (default, and
    `directio` where the kernel has it): drop the backing file's clean cache, mount the layer afresh (its
    own page cache starts empty), read `rel` once, and count its bytes in both caches."""
    from shoal.layers import erofs

    out: dict[str, Any] = {"file": rel, "layer": backing.name}
    for label, flags in (("default", ()), ("directio", ("directio",))):
        fd = os.open(backing, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        mnt = Path(tempfile.mkdtemp(prefix="shoal-density-probe-"))
        try:
            try:
                erofs.mount_file_backed(backing, mnt, flags=flags)
            except OSError as e:
                out[label] = {"skipped": str(e)}
                continue
            try:
                before = backing_cache_of(mnt / rel, backing)
                (mnt / rel).read_bytes()
                out[label] = {"before": before, "after_one_read": backing_cache_of(mnt / rel, backing)}
            finally:
                erofs.unmount(mnt, lazy=False)
        finally:
            mnt.rmdir()
    return out


def raise_nofile(want: int = 1 << 20) -> dict:
    """The in-process client holds ~5 fds per sandbox with a session open: lift RLIMIT_NOFILE."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    nr_open = read_sysctls(["fs/nr_open"]).get("fs/nr_open", hard)
    new_hard = max(hard, min(want, nr_open)) if os.geteuid() == 0 else hard
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (new_hard, new_hard))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    now = resource.getrlimit(resource.RLIMIT_NOFILE)
    return {"before": [soft, hard], "after": list(now)}


def progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("{task.fields[note]}"), console=console, transient=False)


# ------------------------------------------------------------------------------------------ session holders
def _hold_sessions(root: str, conn: Any) -> None:
    """A client process that opens and keeps sandboxes' sessions (--session-procs). A session is 4 of
    its client's descriptors (the control socket, stdin, stdout, stderr), and one process may hold at
    most its RLIMIT_NOFILE; root here cannot raise the hard limit (no CAP_SYS_RESOURCE), so a fill past
    nofile/4 sessions spreads them over processes, as a fleet of clients would."""
    from shoal import Host, Sandbox

    host = Host.get(Path(root))  # in-process, like the bench's own client
    resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
    held: list[Any] = []
    while True:
        msg = conn.recv()
        if msg is None:
            break
        if msg == "drop":  # the run's sandboxes were killed: let their sessions go
            for ses in held:
                try:
                    ses.close()
                except Exception:
                    pass
            held = []
            conn.send(("ok", "", "", 0))
            continue
        sid, shell, cmd, timeout = msg
        try:
            ses = Sandbox(host, host.info(sid)).sessions.create(shell=shell)
            r = ses.run(cmd, timeout=timeout)
            held.append(ses)
            conn.send(("ok", r.stdout, r.stderr, r.exit_code))
        except Exception as e:
            conn.send(("err", "", f"{type(e).__name__}: {str(e)[:300]}", -1))


class SessionHolder:
    """One _hold_sessions process (spawned: no threads of the bench forked into it) and its pipe."""

    def __init__(self, root: Path):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_hold_sessions, args=(str(root), child), daemon=True)
        self.proc.start()
        child.close()
        self.lock = threading.Lock()

    @property
    def pid(self) -> int:
        return int(self.proc.pid or 0)

    def call(self, msg: Any) -> tuple[str, str, str, int]:
        with self.lock:
            self.conn.send(msg)
            return self.conn.recv()

    def close(self) -> None:
        try:
            with self.lock:
                self.conn.send(None)
        except OSError:
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


# ------------------------------------------------------------------------------------------ sides
class Side:
    """One side of the comparison: creates idle sandboxes of a profile and measures them."""

    name = "side"
    cgroup: Path | None = None  # the memory cgroup parent of the side's sandboxes
    cgroup_name = ""  # its name (the pids controller's parent has the same)
    helper_match = ""  # a string in the command line of the side's host-side helpers (helper_usage)
    watch_pids: list[int] = []

    def create(self, i: int) -> tuple[Any, float]:
        """Start sandbox i; returns (handle, seconds the create took). Readiness is `ready()`."""
        raise NotImplementedError

    def ready(self, h: Any) -> None:
        """Block until the sandbox's idle processes are up (the session, the imported Python)."""

    def exec_true(self, h: Any) -> float:
        raise NotImplementedError

    def pause(self, h: Any) -> None:
        raise NotImplementedError

    def resume_exec(self, h: Any) -> dict[str, float]:
        """Resume a paused sandbox and run `true`: {'total': s, ...parts}."""
        raise NotImplementedError

    def mounts_inside(self, h: Any) -> int | None:
        return None

    def launch_phases(self, h: Any) -> dict[str, float] | None:
        """Milliseconds per step of this sandbox's launch, where the side can say (launch_report())."""
        return None

    def paused_count(self, hs: list[Any]) -> int | None:
        """How many of these sandboxes are paused now (asked of the side, not counted by the bench)."""
        return None

    def cache_files(self) -> dict[str, Path]:
        """label -> path whose page cache the page-cache check reads."""
        return {}

    def double_cache(self) -> dict[str, dict | None]:
        """Main files seen both through a mount and in a backing file's page cache (file-backed EROFS)."""
        return {}

    def kill_all(self, hs: list[Any]) -> None:
        raise NotImplementedError

    def client_pids(self) -> list[int]:
        """The client processes whose descriptors the fill counts (the bench, and session holders)."""
        return [os.getpid()]

    def down(self) -> None:
        pass


class ShoalSide(Side):
    name = "shoal"

    def __init__(self, root: Path, profile: str, py_root: Path, ksm: bool, session_procs: int = 0,
                 max_sandboxes: int = 0, ksm_pages_to_scan: int = 0, memory_cgroup: str = "own",
                 pool_size: int = 0, cpu_weight: bool = False):
        from shoal import Host
        from shoal.backends.container.cgroups import cgroup_parent
        from shoal.core.contract import CreateRequest

        self.host = Host.get(root)
        self.profile = profile
        self.cgroup_name = cgroup_parent(self.host.settings.root)
        self.cgroup = memcg_dir(self.cgroup_name)
        self.helper_match = f"--state {self.host.settings.sandboxes_dir}/"  # the supervisors
        self.notes: dict[str, str] = {}
        self.extra: dict[str, Any] = {}
        if ksm:
            if "ksm" in CreateRequest.model_fields:
                self.extra["ksm"] = True
                # identical layouts merge page for page (docs/ksm-and-scheduling.md: 14.2 -> 0.76 MiB each)
                self.extra["aslr"] = False
                self.extra["env"] = {"PYTHONHASHSEED": "0"}
            else:
                self.notes["ksm"] = "skipped: CreateRequest has no `ksm` field on this build"
        self.image, self.layers = self._prepare(py_root)
        self._lock = threading.Lock()
        be = self.host.backend("container")
        # the backend's own cap (4,096 by default) is a setting, not a limit of the host: a fill asked to go
        # further raises it for the run (bench/fill_create.py --max-sandboxes does the same)
        be.max_sandboxes = max(be.max_sandboxes, max_sandboxes)  # type: ignore[attr-defined]
        if memory_cgroup != "own":  # --memory-cgroup pooled: sandboxes share a memory cgroup per pool
            self.extra["memory_cgroup"] = memory_cgroup
            if pool_size:
                be.cgroups.pools.size = pool_size  # type: ignore[attr-defined]
        self.cpu_weight = cpu_weight
        if cpu_weight:  # --cpu-weight: the root's [density] cpu_quota = false, for this run
            be.cgroups.cpu_quota = False  # type: ignore[attr-defined]
        if ksm and ksm_pages_to_scan:  # written by the backend when its first ksm sandbox starts
            import dataclasses

            kh = be.ksm_host  # type: ignore[attr-defined]
            kh.config = dataclasses.replace(kh.config, pages_to_scan=ksm_pages_to_scan)
        self.holders = [SessionHolder(self.host.settings.root) for _ in range(session_procs)]
        self._next_holder = 0

    def client_pids(self) -> list[int]:
        return [os.getpid()] + [h.pid for h in self.holders]

    def down(self) -> None:
        for h in self.holders:
            h.close()

    def _prepare(self, py_root: Path) -> tuple[str, list[str]]:
        store = self.host.store
        if self.profile == "shell":
            from shoal.layers.busybox import make_busybox_tree

            try:
                store.get_image("density-busybox:1")
            except Exception:
                with tempfile.TemporaryDirectory(dir=self.host.settings.tmp_dir) as d:
                    layer = store.build_from_dir(make_busybox_tree(Path(d) / "rootfs"), name="density-busybox")
                store.create_image("density-busybox:1", [layer.digest])
            return "density-busybox:1", []
        from shoal import Host
        from shoal.envs.debian import PYTHON_IMAGE

        try:
            store.get_image(PYTHON_IMAGE)
        except Exception:
            src = Host.get(py_root).store
            console.print(f"pulling {PYTHON_IMAGE} from {py_root} (hard links)")
            store.pull_image(src, PYTHON_IMAGE)
        try:
            store.get_image("density-ws:1")
        except Exception:
            with tempfile.TemporaryDirectory(dir=self.host.settings.tmp_dir) as d:
                repo = Path(d) / "work" / "repo"
                (repo / "densityws").mkdir(parents=True)
                (repo / "tests").mkdir()
                (repo / "densityws" / "__init__.py").write_text(WS_INIT)
                (repo / "densityws" / "core.py").write_text(WS_CORE)
                (repo / "tests" / "test_core.py").write_text(WS_TEST)
                (repo / "idle.py").write_text(WS_IDLE)
                layer = store.build_from_dir(d, name="density-ws")
            store.create_image("density-ws:1", [layer.digest], config={"workdir": "/work/repo", "role": "workspace"})
        return PYTHON_IMAGE, ["density-ws:1"]

    def stack(self) -> list[str]:
        store = self.host.store
        out = list(store.get_image(self.image).layers)
        for ref in self.layers:
            out += list(store.get_image(ref).layers)
        return out

    def create(self, i: int) -> tuple[Any, float]:
        from shoal import Sandbox
        from shoal.core.contract import CreateRequest

        req = CreateRequest(image=self.image, layers=self.layers or None, memory_mb=LIMITS_MB, cpu=LIMITS_CPU,
                            pids=LIMITS_PIDS, **self.extra)
        t0 = time.perf_counter()
        info = self.host.create(req)
        dt = time.perf_counter() - t0
        sb = Sandbox(self.host, info)
        return {"sb": sb, "session": None}, dt

    def ready(self, h: Any) -> None:
        sb = h["sb"]
        shell, cmd, timeout = (("/bin/sh", "echo ready", 60.0) if self.profile == "shell"
                               else ("/bin/bash", f"{PY_START} {PY_WAIT}", 120.0))
        if self.holders:  # the session lives in a holder process (--session-procs)
            with self._lock:
                holder = self.holders[self._next_holder % len(self.holders)]
                self._next_holder += 1
            status, out, err, code = holder.call((sb.id, shell, cmd, timeout))
            h["session"] = None
            if status != "ok" or "ready" not in out:
                raise RuntimeError(f"{sb.id} not ready (holder {holder.pid}): exit {code} {out[-200:]} {err[-300:]}")
            return
        h["session"] = sb.sessions.create(shell=shell)
        r = h["session"].run(cmd, timeout=timeout)
        if "ready" not in r.stdout:
            raise RuntimeError(f"{sb.id} not ready: exit {r.exit_code} {r.stdout[-200:]} {r.stderr[-300:]}")

    def exec_true(self, h: Any) -> float:
        t0 = time.perf_counter()
        h["sb"].commands.run(["true"], check=True)
        return time.perf_counter() - t0

    def pause(self, h: Any) -> None:
        h["sb"].pause()

    def resume_exec(self, h: Any) -> dict[str, float]:
        t0 = time.perf_counter()  # an exec on a paused sandbox resumes it (transparent resume)
        h["sb"].commands.run(["true"], check=True)
        return {"total": time.perf_counter() - t0}

    def paused_count(self, hs: list[Any]) -> int | None:
        from shoal.core.contract import SandboxState

        return sum(1 for h in hs if h["sb"].info().state == SandboxState.PAUSED)

    def reclaim(self, h: Any, target: float) -> dict:
        """Push `target` of a paused sandbox's anonymous memory to compressed swap (sb.reclaim, where the
        build has it; it needs swap, e.g. Shoal's zram, configured on the host)."""
        fn = getattr(h["sb"], "reclaim", None)
        if fn is None:
            raise NotImplementedError("this build of Shoal has no sb.reclaim()")
        r = fn(target)
        return r.model_dump() if hasattr(r, "model_dump") else dict(r)

    def launch_phases(self, h: Any) -> dict[str, float] | None:
        fn = getattr(self.host.backend("container"), "launch_phases", None)  # builds from December 2026 on
        return fn(h["sb"].id) or None if fn else None

    def mounts_inside(self, h: Any) -> int | None:
        pid = h["sb"].info().init_pid
        try:
            return len(Path(f"/proc/{pid}/mountinfo").read_text().splitlines()) if pid else None
        except OSError:
            return None

    def cache_files(self) -> dict[str, Path]:
        store = self.host.store
        stack = self.stack()
        mounts = store.ensure_mounted(stack)
        out: dict[str, Path] = {}
        self._pairs: dict[str, tuple[Path, Path]] = {}
        for rel in MAIN_FILES["shell" if self.profile == "shell" else "python"]:
            for digest, mnt in reversed(list(zip(stack, mounts, strict=True))):
                if (mnt / rel).exists() and not (mnt / rel).is_symlink():
                    out[f"{Path(rel).name} (in the EROFS mount)"] = mnt / rel
                    out[f"{Path(rel).name}'s layer (backing .erofs file)"] = store.image_path(digest)
                    self._pairs[Path(rel).name] = (mnt / rel, store.image_path(digest))
                    break
        return out

    def double_cache(self) -> dict[str, dict | None]:
        return {name: backing_cache_of(f, b) for name, (f, b) in getattr(self, "_pairs", {}).items()}

    def double_cache_probe(self) -> dict | None:
        """double_cache_probe() on the profile's main file and the layer that holds it."""
        self.cache_files()
        name = MAIN_FILES["shell" if self.profile == "shell" else "python"][0]
        pair = getattr(self, "_pairs", {}).get(Path(name).name)
        return double_cache_probe(pair[1], name) if pair else None

    def kill_all(self, hs: list[Any]) -> None:
        def close(h: Any) -> None:
            try:
                if h.get("session") is not None:
                    h["session"].close()
            except Exception:
                pass

        with ThreadPoolExecutor(8) as ex:
            list(ex.map(close, hs))
        # all signalled, then waited for at once (Host.kill_many), not one kill after another
        self.host.kill_many([h["sb"].id for h in hs])
        for holder in self.holders:
            holder.call("drop")


class DockerSide(Side):
    name = "docker"

    def __init__(self, shoal: ShoalSide, profile: str):
        from docker_engine import PrivateDockerd

        self.profile = profile
        self.cpu_weight = shoal.cpu_weight  # the same CPU semantics as the Shoal side
        self.engine = PrivateDockerd(prefix="shoal-density-dockerd-", cgroup_parent=DOCKER_CGROUP, export=True)
        if not self.engine.up():
            raise RuntimeError(self.engine.error)
        assert self.engine.proc is not None and self.engine.tmp is not None
        self.watch_pids = [self.engine.proc.pid]
        self.helper_match = self.engine.tmp  # dockerd, its containerd, the shims: all name the engine's dirs
        self.data_root = Path(self.engine.tmp) / "data"
        self.cgroup_name = DOCKER_CGROUP
        self.cgroup = memcg_dir(DOCKER_CGROUP)
        self.teardown_notes: list[str] = []
        self.image = f"shoal-density-{'shell' if profile == 'shell' else 'python'}:1"
        self.env: dict[str, str] = {}
        if profile != "shell":
            self.env = dict(shoal.host.store.get_image(shoal.image).config.get("env", {}))
        self._import(shoal)

    def _import(self, shoal: ShoalSide) -> None:
        """The same tree as Shoal's stack: the layer mounts merged with overlayfs, tarred, `docker import`ed."""
        mounts = shoal.host.store.ensure_mounted(shoal.stack())
        merged = Path(tempfile.mkdtemp(prefix="shoal-density-merged-"))
        try:
            lower = ":".join(str(m) for m in reversed(mounts))
            if len(mounts) == 1:
                subprocess.run(["mount", "--bind", "-o", "ro", str(mounts[0]), str(merged)], check=True)
            else:
                subprocess.run(["mount", "-t", "overlay", "overlay", "-o", f"lowerdir={lower}", str(merged)],
                               check=True)
            tar = subprocess.Popen(["tar", "-C", str(merged), "-c", "."], stdout=subprocess.PIPE)
            subprocess.run(["docker", "import", "-", self.image], stdin=tar.stdout, check=True, capture_output=True)
            tar.wait()
        finally:
            subprocess.run(["umount", str(merged)], capture_output=True, check=False)
            merged.rmdir()

    def _docker(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        r = subprocess.run(["docker", *args], capture_output=True, text=True, check=False, timeout=timeout)
        if check and r.returncode != 0:
            raise RuntimeError(f"docker {args[0]}: {r.stderr.strip()[-400:]}")
        return r

    def create(self, i: int) -> tuple[Any, float]:
        env = [a for k, v in self.env.items() for a in ("-e", f"{k}={v}")]
        cmd = ["sh"] if self.profile == "shell" else ["bash", "-c", f"{PY_START} exec bash"]
        wd = ["-w", "/work/repo"] if self.profile != "shell" else []
        t0 = time.perf_counter()
        # --cpu-weight: a share, as Shoal's cpu_quota = false (1024 per core; no CFS quota written)
        cpu = f"--cpu-shares={round(LIMITS_CPU * 1024)}" if self.cpu_weight else f"--cpus={LIMITS_CPU}"
        r = self._docker("run", "-d", "-i", "--network=none", f"--memory={LIMITS_MB}m", cpu,
                         f"--pids-limit={LIMITS_PIDS}", *env, *wd, self.image, *cmd)
        dt = time.perf_counter() - t0
        return {"id": r.stdout.strip()}, dt

    def ready(self, h: Any) -> None:
        if self.profile == "shell":
            return  # `sh` is PID 1, up when `docker run -d` returns
        r = self._docker("exec", h["id"], "sh", "-c", PY_WAIT)
        if "ready" not in r.stdout:
            raise RuntimeError(f"container {h['id'][:12]} not ready: {r.stdout[-200:]} {r.stderr[-200:]}")

    def exec_true(self, h: Any) -> float:
        t0 = time.perf_counter()
        if h.get("idle_paused"):  # `docker exec` refuses a paused container: unpause first (counted, as
            self._docker("unpause", h["id"])  # Shoal's exec on a paused sandbox counts its resume)
        self._docker("exec", h["id"], "true")
        return time.perf_counter() - t0

    def pause(self, h: Any) -> None:
        self._docker("pause", h["id"])

    def resume_exec(self, h: Any) -> dict[str, float]:
        t0 = time.perf_counter()
        self._docker("unpause", h["id"])
        t1 = time.perf_counter()
        self._docker("exec", h["id"], "true")
        t2 = time.perf_counter()
        return {"total": t2 - t0, "unpause": t1 - t0, "exec": t2 - t1}

    def paused_count(self, hs: list[Any]) -> int | None:
        ids = {h["id"] for h in hs}
        r = self._docker("ps", "-q", "--no-trunc", "--filter", "status=paused", check=False, timeout=600)
        return sum(1 for line in r.stdout.split() if line in ids)

    def mounts_inside(self, h: Any) -> int | None:
        r = self._docker("exec", h["id"], "sh", "-c", "cat /proc/self/mountinfo | wc -l", check=False)
        return int(r.stdout.strip()) if r.returncode == 0 and r.stdout.strip().isdigit() else None

    def cache_files(self) -> dict[str, Path]:
        r = self._docker("image", "inspect", "-f", "{{.GraphDriver.Data.UpperDir}}", self.image, check=False)
        diff = Path(r.stdout.strip())
        out = {}
        for rel in MAIN_FILES["shell" if self.profile == "shell" else "python"]:
            if (diff / rel).exists() and not (diff / rel).is_symlink():
                out[f"{Path(rel).name} (overlay2 layer on ext4)"] = diff / rel
        return out

    def kill_all(self, hs: list[Any]) -> None:
        ids = [h["id"] for h in hs]
        chunks = [ids[k:k + 50] for k in range(0, len(ids), 50)]

        def rm(c: list[str]) -> bool:
            try:
                self._docker("rm", "-f", *c, check=False, timeout=RM_TIMEOUT_S)
                return True
            except subprocess.TimeoutExpired:
                return False

        with ThreadPoolExecutor(4) as ex:
            stuck = [c for c, ok in zip(chunks, ex.map(rm, chunks)) if not ok]
        if stuck:
            # dockerd stopped answering `rm` of paused containers once before (after ~600 of 776): kill
            # the containers' processes through their cgroup, then ask again; the run says it happened
            killed = kill_cgroup_tasks(DOCKER_CGROUP)
            self.teardown_notes.append(f"{sum(map(len, stuck))} containers' `docker rm -f` passed {RM_TIMEOUT_S} s:"
                                       f" SIGKILLed {killed} tasks in {DOCKER_CGROUP}, then rm -f again")
            with ThreadPoolExecutor(4) as ex:
                if not all(ex.map(rm, stuck)):
                    self.teardown_notes.append("`docker rm -f` still hung after the kill; dockerd torn down")

    def down(self) -> None:
        self.engine.down()


# ------------------------------------------------------------------------------------------ the fill
class Fill:
    def __init__(self, side: Side, max_n: int, args: argparse.Namespace, label: str):
        self.side, self.max_n, self.args, self.label = side, max_n, args, label
        self.handles: list[Any] = []
        self.create_s: list[float] = []
        self.ready_s: list[float] = []
        self.errors: list[str] = []
        self.pool = ThreadPoolExecutor(args.ready_workers)
        self.pending: list[Future] = []
        self.paused_upto = 0  # handles[:paused_upto] were paused (and reclaimed, with --reclaim) during the fill
        self.batch_reclaims: list[dict] = []
        self.guard_wait_s = 0.0
        # the client process's own pauses: CPython's collections of the oldest generation walk every
        # live object (this process holds the handles of all N sandboxes), and a create that waits on
        # one counts it (gc_report())
        self.gc_events: list[tuple[float, float]] = []  # (start, seconds) of each gen-2 collection
        self.slow_creates: list[tuple[int, float, float]] = []  # (n, start, seconds) of creates over 250 ms
        # launch steps (launch_report()) of every slow create and of every LAUNCH_SAMPLE-th one, as (n, ms, steps)
        self.launches: list[tuple[int, float, dict[str, float]]] = []
        self._gc_t0 = 0.0
        # --idle-pipeline: each sandbox is paused (and reclaimed) by a worker once it has been ready for
        # --pipeline-idle-s, as shoald's idle policy treats each sandbox on its own clock, instead of
        # stopping the fill for a batch every --pause-every sandboxes
        self.pipe: queue.Queue | None = queue.Queue() if args.idle_pipeline else None
        self.pipe_reclaims: list[dict] = []
        self.pipe_done = 0
        self.pipe_cpu_s = 0.0  # the idle workers' own CPU (pause + reclaim calls, the kernel's compression in)
        self.pace_wait_s = 0.0
        self.probe_lock = threading.Lock()
        self.pipe_threads = [threading.Thread(target=self._idle_worker, daemon=True)
                             for _ in range(args.idle_workers if self.pipe is not None else 0)]
        for t in self.pipe_threads:
            t.start()

    def _idle_worker(self) -> None:
        assert self.pipe is not None
        fn = getattr(self.side, "reclaim", None) if self.args.reclaim else None
        while True:
            item = self.pipe.get()
            if item is None:
                self.pipe.task_done()
                return
            h, t_ready = item
            try:
                time.sleep(max(0.0, t_ready + self.args.pipeline_idle_s - time.perf_counter()))
                c0 = time.thread_time()
                with self.probe_lock:  # not while a step's exec probe is on it (an exec on it as it freezes)
                    self.side.pause(h)
                    h["idle_paused"] = True  # a probe that resumes it (an exec at a step) pauses it again
                    if fn is not None:
                        self.pipe_reclaims.append(fn(h, self.args.reclaim_target))
                self.pipe_cpu_s += time.thread_time() - c0
                self.pipe_done += 1
            except Exception as e:
                self.errors.append(f"idle pipeline: {type(e).__name__}: {str(e)[:200]}")
            finally:
                self.pipe.task_done()

    def pipe_backlog(self) -> int:
        """Sandboxes ready but not yet paused (and reclaimed) by the idle pipeline."""
        return self.pipe.unfinished_tasks if self.pipe is not None else 0

    def pace(self, mi: dict[str, int]) -> dict[str, int]:
        """--idle-pipeline: below --min-available-gib + --pace-gib of MemAvailable, let the pipeline (its
        backlog still holds their full memory) or ksmd (with --ksm: the sandboxes it has not merged yet)
        catch up before the next create, up to --guard-wait-s."""
        a = self.args
        floor = int((a.min_available_gib + a.pace_gib) * (1 << 30))
        if self.pipe is None or mi["MemAvailable"] >= floor:
            return mi
        merging = a.ksm and self.side.name == "shoal"
        t0 = time.perf_counter()
        while (mi["MemAvailable"] < floor and (self.pipe_backlog() > 0 or merging)
               and time.perf_counter() - t0 < a.guard_wait_s):
            time.sleep(0.2)
            mi = meminfo()
        self.pace_wait_s += time.perf_counter() - t0
        return mi

    def settle_merge(self) -> list[dict]:
        """--settle-s: after the fill, the sandboxes' memory every 10 s while ksmd (or nothing) goes on
        merging them: [{t, cgroup anon MiB per sandbox, MemAvailable GiB}]."""
        n = len(self.handles)
        out = []
        t0 = time.perf_counter()
        while True:
            cg = memcg_totals(self.side.cgroup) if self.side.cgroup else None
            out.append({"t": round(time.perf_counter() - t0, 1), "cg_anon_mib_per_sb": round(cg["anon"] / n / MiB, 3)
                        if cg else None, "mem_available_gib": round(meminfo()["MemAvailable"] / (1 << 30), 2)})
            if time.perf_counter() - t0 >= self.args.settle_s:
                return out
            time.sleep(10)

    def drain_pipeline(self) -> None:
        if self.pipe is None:
            return
        self.settle()
        self.pipe.join()
        for _ in self.pipe_threads:
            self.pipe.put(None)
        for t in self.pipe_threads:
            t.join(30)
        self.pipe = None
        self.paused_upto = len(self.handles)

    def pause_batch(self) -> None:
        """--pause-every: pause (and with --reclaim, reclaim) the sandboxes made since the last batch, as
        shoald's idle policy would while a host fills; the fill then goes on with their memory given back."""
        self.settle()
        batch = self.handles[self.paused_upto:]
        if not batch:
            return
        with ThreadPoolExecutor(8) as ex:
            list(ex.map(self.side.pause, batch))
        if self.args.reclaim and getattr(self.side, "reclaim", None) is not None:
            t0 = time.perf_counter()
            fn = self.side.reclaim  # type: ignore[attr-defined]
            target = self.args.reclaim_target
            try:
                with ThreadPoolExecutor(os.cpu_count() or 2) as ex:
                    rs = list(ex.map(lambda h: fn(h, target), batch))
                self.batch_reclaims.append({"n": len(batch), "wall_s": time.perf_counter() - t0,
                                            "swapped_per_sb": sum(r.get("swapped", 0) for r in rs) / len(rs)})
            except Exception as e:
                self.errors.append(f"reclaim: {type(e).__name__}: {str(e)[:200]}")
        self.paused_upto = len(self.handles)

    def _ready(self, h: Any, t_created: float) -> None:
        self.side.ready(h)
        t = time.perf_counter()
        self.ready_s.append(t - t_created)
        if self.pipe is not None:
            self.pipe.put((h, t))

    def settle(self) -> None:
        for f in self.pending:
            try:
                f.result()
            except Exception as e:  # a sandbox that did not come up: counted, said in the JSON
                self.errors.append(f"ready: {type(e).__name__}: {str(e)[:300]}")
        self.pending = []

    def measure(self, base: dict, c0: int, r0: int) -> dict:
        self.settle()
        n = len(self.handles)
        mi = meminfo()
        step: dict[str, Any] = {"n": n, "t": time.time()}
        step["meminfo_per_sb"] = per_sandbox(base["meminfo"], mi, n, MEMINFO_KEYS)
        step["free_frac"] = mi["MemAvailable"] / mi["MemTotal"]
        cg = memcg_totals(self.side.cgroup) if self.side.cgroup else None
        if cg is not None and base.get("cgroup") is not None:
            step["cgroup_per_sb"] = per_sandbox(base["cgroup"], cg, n, cg.keys())
        step["memcgs"] = memcg_count()  # memory cgroups on the host (pooled: about n / pool size)
        step["tasks_per_sb"] = (nr_threads() - base["threads"]) / n
        step["processes_per_sb"] = (nr_processes() - base["processes"]) / n
        cg_tasks = pids_current(self.side.cgroup_name)
        step["cgroup_tasks_per_sb"] = cg_tasks / n if cg_tasks is not None else None
        hu = helper_usage(self.side.helper_match)
        step["helpers_per_sb"] = {k: (hu[k] - base["helpers"][k]) / n for k in hu}
        if step.get("cgroup_per_sb") and cg_tasks is not None:
            c = step["cgroup_per_sb"]
            # what the side's sandboxes hold, from their own accounting (robust to other work on the host):
            # cgroup anon + shmem + kernel, plus the host-side helpers' PSS
            step["attributed_per_sb"] = {
                "memory": c.get("anon", 0) + c.get("shmem", 0) + c.get("kernel", 0) + step["helpers_per_sb"]["pss"],
                "tasks": cg_tasks / n + step["helpers_per_sb"]["threads"]}
        step["mounts_host_per_sb"] = (host_mounts() - base["mounts"]) / n
        step["mounts_in_sandbox"] = self.side.mounts_inside(self.handles[-1])
        step["create_ms"] = lat_stats(self.create_s[c0:])
        step["ready_ms"] = lat_stats(self.ready_s[r0:])
        sample = random.Random(n).sample(self.handles, min(self.args.exec_sample, n))
        ex = []
        for h in sample:
            try:
                with self.probe_lock:
                    ex.append(self.side.exec_true(h))
                    if h.get("idle_paused"):  # --idle-pipeline had paused it: the exec resumed it
                        self.side.pause(h)
            except Exception as e:
                self.errors.append(f"exec: {type(e).__name__}: {str(e)[:200]}")
        step["exec_ms"] = lat_stats(ex)
        step["pagecache_bytes"] = {k: fincore_bytes(p) for k, p in base["cache_files"].items()}
        step["double_cache"] = self.side.double_cache()
        per_proc = [fd_count(p) for p in self.side.client_pids()]
        fds = sum(per_proc)
        step["client"] = {"fds": fds, "fds_per_sb": (fds - base["client_fds"]) / n, "processes": len(per_proc),
                          "fds_max_process": max(per_proc),
                          "threads": threading.active_count(), "maps": map_count()}
        maps = max([map_count()] + [map_count(p) for p in self.side.watch_pids])
        usage = {"threads": nr_threads(), "mounts": host_mounts(),
                 "files": int(Path("/proc/sys/fs/file-nr").read_text().split()[0]),
                 "inotify": inotify_instances(), "client_fds": max(per_proc),  # each process has its own limit
                 "client_nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[0], "maps": maps}
        step["limits"] = limit_usage(read_sysctls(), usage)
        if ZRAM_DEV:  # --zram-mb: what the run's zram device holds, and the RAM it takes for it
            step["zram"] = ZRAM_DEV[0].stats()
        ksm_sys = Path("/sys/kernel/mm/ksm")
        if self.args.ksm and ksm_sys.is_dir():  # host-wide ksmd totals (pages_sharing: page copies saved)
            step["ksm"] = {k: int((ksm_sys / k).read_text()) for k in ("pages_shared", "pages_sharing",
                                                                       "pages_unshared", "full_scans")}
            cpu = ksmd_cpu_s()
            if cpu is not None and base.get("ksmd_cpu_s") is not None:
                step["ksm"]["ksmd_cpu_s"] = round(cpu - base["ksmd_cpu_s"], 1)  # since the fill began
        step["files_per_sb"] = (usage["files"] - base["files"]) / n
        step["inotify_per_sb"] = (usage["inotify"] - base["inotify"]) / n
        return step

    def run(self) -> dict:
        a, side = self.args, self.side
        # warm-up (not measured): mounts the layers, fills the page cache, starts the engine's paths
        warm = []
        for i in range(2):
            h, _ = side.create(-1 - i)
            side.ready(h)
            warm.append(h)
        side.kill_all(warm)
        time.sleep(0.5)
        base = {"meminfo": meminfo(), "cgroup": memcg_totals(side.cgroup) if side.cgroup else None,
                "threads": nr_threads(), "processes": nr_processes(), "mounts": host_mounts(),
                "helpers": helper_usage(side.helper_match), "inotify": inotify_instances(),
                "files": int(Path("/proc/sys/fs/file-nr").read_text().split()[0]),
                "client_fds": sum(fd_count(p) for p in side.client_pids()), "cache_files": side.cache_files(),
                "ksmd_cpu_s": ksmd_cpu_s()}
        steps_at = fill_steps(self.max_n)
        steps: list[dict] = []
        stop = None
        c0 = r0 = 0
        t_start = time.perf_counter()
        gc.callbacks.append(self._gc_cb)
        if a.gc_freeze:
            gc.freeze()  # what exists before the fill is never scanned again
        with progress() as p:
            task = p.add_task(self.label, total=self.max_n, note="")
            while stop is None:
                i = len(self.handles)
                try:
                    h, dt = side.create(i)
                except Exception as e:
                    stop = classify_error(e)
                    break
                t_created = time.perf_counter()
                self.handles.append(h)
                self.create_s.append(dt)
                if dt > 0.25:
                    self.slow_creates.append((i + 1, t_created - dt, dt))
                if (dt > 0.25 or i % LAUNCH_SAMPLE == 0) and (launch_steps := side.launch_phases(h)):
                    self.launches.append((i + 1, dt * 1e3, launch_steps))
                self.pending.append(self.pool.submit(self._ready, h, t_created))
                if len(self.pending) > 4 * a.ready_workers:  # keep readiness from falling far behind
                    self.pending.pop(0).result()
                n = len(self.handles)
                p.update(task, advance=1, note=f"create {dt * 1e3:.0f} ms")
                if a.pause_every and n - self.paused_upto >= a.pause_every:
                    self.pause_batch()
                limits: dict[str, dict] = {}
                mi = self.pace(meminfo())
                guard = int(a.min_available_gib * (1 << 30))
                if guard and a.guard_wait_s and mi["MemAvailable"] < guard and self.pipe is None:
                    # ksmd (or reclaim) may still be catching up with the last sandboxes: give it a moment
                    self.pause_batch()
                    t_wait = time.perf_counter()
                    while mi["MemAvailable"] < guard + (512 << 20) and time.perf_counter() - t_wait < a.guard_wait_s:
                        time.sleep(2)
                        mi = meminfo()
                    self.guard_wait_s += time.perf_counter() - t_wait
                if n in steps_at:
                    s = self.measure(base, c0, r0)
                    if a.gc_freeze:  # --gc-freeze: the sandboxes held so far move out of the collector's walks
                        gc.freeze()
                    steps.append(s)
                    c0, r0 = len(self.create_s), len(self.ready_s)
                    limits = s["limits"]
                    used = s["meminfo_per_sb"].get("used", 0) / MiB
                    p.update(task, note=f"N={n}: {used:.2f} MiB/sandbox, create p50 "
                                        f"{(s['create_ms'] or {}).get('p50', 0):.1f} ms")
                stop = stop_reason(n=n, max_n=self.max_n, free_frac=mi["MemAvailable"] / mi["MemTotal"],
                                   free_min=a.free_min, recent_create_s=self.create_s[-50:], p99_max_s=a.p99_max,
                                   limits=limits, avail_bytes=mi["MemAvailable"],
                                   avail_min_bytes=int(a.min_available_gib * (1 << 30)))
                if len(self.errors) > 10:
                    stop = f"too many errors: {self.errors[-1]}"
                budget, flag = ((a.docker_fill_budget_s, "--docker-fill-budget-s") if side.name == "docker"
                                and a.docker_fill_budget_s else (a.fill_budget_s, "--fill-budget-s"))
                if stop is None and budget and time.perf_counter() - t_start > budget:
                    stop = f"{flag} {budget:g} reached"  # keeps one invocation <= 10 min
        fill_s = time.perf_counter() - t_start
        gc.callbacks.remove(self._gc_cb)
        t_drain = time.perf_counter()
        self.drain_pipeline()  # the last sandboxes through their idle period, pause and reclaim
        drain_s = time.perf_counter() - t_drain
        if self.handles and (not steps or steps[-1]["n"] != len(self.handles)):
            steps.append(self.measure(base, c0, r0))
        settle = self.settle_merge() if self.handles and self.args.settle_s else None
        # the host once the fill is over and the last sandboxes went through the idle pipeline (all paused,
        # reclaimed or merged): what holding N idle sandboxes costs
        end = self.measure(base, len(self.create_s), len(self.ready_s)) if self.handles and self.args.idle_pipeline \
            else None
        self.settle()
        pipeline = None
        if self.args.idle_pipeline:
            pipeline = {"paused": self.pipe_done, "paused_now": side.paused_count(self.handles),
                        "reclaimed": len(self.pipe_reclaims), "idle_s": a.pipeline_idle_s,
                        "workers": a.idle_workers, "cpu_s": round(self.pipe_cpu_s, 1),
                        "pace_wait_s": round(self.pace_wait_s, 1), "drain_s": round(drain_s, 1)}
        return {"n_held": len(self.handles), "stop": stop, "fill_s": fill_s, "steps": steps,
                "paused_during_fill": self.paused_upto, "batch_reclaims": self.batch_reclaims,
                "idle_pipeline": pipeline, "end": end, "settle": settle, "guard_wait_s": round(self.guard_wait_s, 1),
                "gc": self.gc_report(), "launch": self.launch_report(),
                "errors": self.errors[:20], "cache_files": {k: str(v) for k, v in base["cache_files"].items()},
                "base_free_frac": base["meminfo"]["MemAvailable"] / base["meminfo"]["MemTotal"]}

    def _gc_cb(self, phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            self.gc_events.append((self._gc_t0, time.perf_counter() - self._gc_t0))

    def gc_report(self) -> dict:
        """The client's gen-2 collections during the fill, and how much of each slow create (> 250 ms)
        was spent inside one."""
        def overlap(t0: float, dt: float) -> float:
            return sum(max(0.0, min(t0 + dt, g0 + gd) - max(t0, g0)) for g0, gd in self.gc_events)
        durs = [d for _, d in self.gc_events]
        slow = [{"n": n, "ms": round(dt * 1e3, 1), "in_gc_ms": round(overlap(t0, dt) * 1e3, 1)}
                for n, t0, dt in self.slow_creates]
        return {"frozen": bool(self.args.gc_freeze), "gen2_collections": len(durs),
                "gen2_max_ms": round(max(durs) * 1e3, 1) if durs else None,
                "gen2_total_s": round(sum(durs), 2), "slow_creates": len(slow),
                "slow_creates_in_gc": sum(1 for x in slow if x["in_gc_ms"] > 0.5 * x["ms"]),
                "slowest": sorted(slow, key=lambda x: -x["ms"])[:20]}

    def launch_report(self) -> dict | None:
        """Where creates spent their time, by launch step (the backend's launch_phases()): the median
        step times of sampled ordinary creates as N grows, and each slow create's steps, with the step
        that took most of it. "outside" is the create's time not in any step (the client, the layer
        store, the Host's own work)."""
        if not self.launches:
            return None

        def with_outside(ms: float, steps: dict[str, float]) -> dict[str, float]:
            return {**steps, "outside": round(max(0.0, ms - sum(steps.values())), 3)}

        ordinary = [(n, with_outside(ms, st)) for n, ms, st in self.launches if ms <= 250]
        by_decile: list[dict] = []
        if ordinary:
            top = max(n for n, _ in ordinary)
            for k in range(10):  # the samples in each tenth of the fill
                lo, hi = top * k / 10, top * (k + 1) / 10
                part = [st for n, st in ordinary if lo < n <= hi]
                if part:
                    by_decile.append({"n_upto": int(hi), "samples": len(part),
                                      "p50_ms": {name: round(statistics.median(st[name] for st in part), 3)
                                                 for name in part[0]}})
        slow = []
        for n, ms, st in self.launches:
            if ms > 250:
                full = with_outside(ms, st)
                worst = max(full, key=lambda k: full[k])
                slow.append({"n": n, "ms": round(ms, 1), "worst_step": worst, "worst_ms": full[worst], "steps": full})
        worst_counts: dict[str, int] = {}
        for x in slow:
            worst_counts[x["worst_step"]] = worst_counts.get(x["worst_step"], 0) + 1
        return {"sample_every": LAUNCH_SAMPLE, "ordinary_by_tenth": by_decile, "slow_creates": len(slow),
                "slow_by_worst_step": dict(sorted(worst_counts.items(), key=lambda kv: -kv[1])),
                "slowest": sorted(slow, key=lambda x: -x["ms"])[:40]}

    def paused_phase(self, base_run: dict) -> dict:
        """python-paused: the same sandboxes, left idle, paused, measured; then resume -> first exec."""
        a, side = self.args, self.side
        n = len(self.handles)
        mi0 = meminfo()
        time.sleep(a.idle_s)
        t0 = time.perf_counter()
        rest = self.handles[self.paused_upto:]
        with ThreadPoolExecutor(8) as ex:
            list(ex.map(side.pause, rest))
        pause_s = time.perf_counter() - t0
        out: dict[str, Any] = {"n_held": n, "idle_s": a.idle_s, "pause_all_s": pause_s, "paused_by": "the bench "
                               "(sb.pause() / docker pause) after --idle-s; Shoal has no idle auto-pause yet"}
        if a.reclaim:
            out["reclaim"] = self._reclaim_all(a.reclaim_target, rest)
            out["reclaim"]["during_fill"] = self.batch_reclaims
            if "skipped" not in out["reclaim"]:
                out["reclaim"]["sandboxes"] += sum(b["n"] for b in self.batch_reclaims)
        time.sleep(1.0)
        mi = meminfo()
        last = base_run["steps"][-1]
        out["meminfo_per_sb_running"] = last["meminfo_per_sb"]
        # paused - running, per sandbox: what pausing (and reclaim, if on) gave back
        out["meminfo_change_per_sb"] = per_sandbox(mi0, mi, n, MEMINFO_KEYS)
        cg = memcg_totals(side.cgroup) if side.cgroup else None
        out["cgroup_totals_paused"] = cg
        sample = random.Random(7).sample(self.handles, min(a.resume_sample, n))
        res: list[dict[str, float]] = []
        for h in sample:
            try:
                res.append(side.resume_exec(h))
            except Exception as e:
                self.errors.append(f"resume: {type(e).__name__}: {str(e)[:200]}")
        out["resume_exec_ms"] = {k: lat_stats([r[k] for r in res if k in r]) for k in (res[0] if res else {})}
        out["errors"] = self.errors[-10:]
        # one exec more on each resumed sandbox: the second exec's cost after resume
        return out

    def _reclaim_all(self, target: float, handles: list[Any]) -> dict:
        """--reclaim: reclaim every paused sandbox; skipped (and said why) where the side or build cannot."""
        fn = getattr(self.side, "reclaim", None)
        if fn is None:
            return {"skipped": f"{self.side.name} has no per-sandbox reclaim"}
        results: list[dict] = []
        t0 = time.perf_counter()
        try:  # one sandbox per core at a time: each reclaim is a freeze + stepped limit of its own group
            with ThreadPoolExecutor(os.cpu_count() or 2) as ex:
                results = list(ex.map(lambda h: fn(h, target), handles))
        except Exception as e:  # no swap configured, no API on this build: skip, say so
            return {"skipped": f"{type(e).__name__}: {str(e)[:300]}"}
        results = self.pipe_reclaims + results  # --idle-pipeline reclaimed most of them during the fill
        n = max(1, len(results))
        mi = meminfo()
        return {"target": target, "sandboxes": len(results), "wall_s": time.perf_counter() - t0,
                "swap_used_mib": round((mi.get("SwapTotal", 0) - mi.get("SwapFree", 0)) / (1 << 20), 1),
                **{f"{k}_per_sb": sum(r.get(k, 0) for r in results) / n
                   for k in ("memory_before", "memory_after", "anon_before", "anon_after", "swapped")},
                "duration_ms": lat_stats([r.get("duration_s", 0.0) for r in results])}

    def teardown(self) -> float:
        self.settle()
        self.pool.shutdown()
        t0 = time.perf_counter()
        self.side.kill_all(self.handles)
        return time.perf_counter() - t0


def run_kind(kind: str, args: argparse.Namespace, with_paused: bool) -> list[dict]:
    """--runs runs of a profile: each run fills Shoal, then Docker (the order rotated by run), measures,
    tears down. One private dockerd (and one import of the image) serves all runs of the profile."""
    shoal = ShoalSide(Path(args.root), kind, Path(args.py_root), args.ksm, args.session_procs,
                      (args.max if kind == "shell" else args.py_max) + 8, args.ksm_pages_to_scan,
                      args.memory_cgroup, args.pool_size, args.cpu_weight)
    docker: DockerSide | None = None
    runs: list[dict] = []
    with_shoal = "shoal" in args.sides.split(",")  # --sides docker: the Shoal side only prepares the image
    probe = shoal.double_cache_probe() if with_shoal else None
    try:
        if args.docker:
            docker = DockerSide(shoal, kind)
        for run_idx in range(args.runs):
            sides: list[tuple[str, Side, int]] = []
            if with_shoal:
                sides.append(("shoal", shoal, args.max if kind == "shell" else args.py_max))
            if docker is not None:
                sides.append(("docker", docker, args.docker_max if kind == "shell" else args.docker_py_max))
            if run_idx % 2 == 1:
                sides.reverse()
            out: dict[str, Any] = {}
            for name, side, max_n in sides:
                f = Fill(side, max_n, args, f"{kind} {name} run {run_idx + 1}/{args.runs}")
                try:
                    r = f.run()
                    if with_paused:
                        r["paused"] = f.paused_phase(r)
                finally:
                    r_kill = f.teardown()
                r["kill_all_s"] = r_kill
                if getattr(side, "teardown_notes", None):
                    r["teardown_notes"] = list(side.teardown_notes)  # type: ignore[attr-defined]
                    side.teardown_notes.clear()  # type: ignore[attr-defined]
                if name == "shoal":
                    r["notes"] = shoal.notes
                out[name] = r
                console.print(f"[bold]{kind} / {name}[/bold]: held {r['n_held']} ({r['stop']}), fill "
                              f"{r['fill_s']:.0f} s, kill {r_kill:.1f} s")
                time.sleep(2)
            if "shoal" in out:
                out["shoal"]["double_cache_probe"] = probe
            runs.append(out)
    finally:
        shoal.down()
        if docker is not None:
            docker.down()
    return runs


# ------------------------------------------------------------------------------------------ output
def collect(runs_by_profile: dict[str, list[dict]], with_paused: bool) -> dict:
    profiles: dict[str, Any] = {}
    for kind, runs in runs_by_profile.items():
        sides: dict[str, Any] = {}
        for side in ("shoal", "docker"):
            rs = [r[side] for r in runs if side in r]
            if rs:
                sides[side] = {"runs": rs, "summary": summarize(rs)}
                last = rs[-1]["steps"][-1] if rs[-1].get("steps") else None
                if last is not None:  # the limits 20,000 sandboxes would need, from the latest run's last step
                    sides[side]["summary"]["limits_for_20000"] = project_limits(
                        last, 20000, read_sysctls(), resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        profiles[kind] = {"sides": sides}
        if kind == "python" and with_paused:
            psides: dict[str, Any] = {}
            for side in ("shoal", "docker"):
                ps = [r[side]["paused"] for r in runs if side in r and "paused" in r[side]]
                if not ps:
                    continue
                summ: dict[str, Any] = {"n_held": spread([p["n_held"] for p in ps])}
                # runs that reclaimed (--reclaim, not skipped) and runs that only paused are summed apart
                rec = [p for p in ps if (p.get("reclaim") or {}).get("sandboxes")]
                for label, group in (("", [p for p in ps if p not in rec]), ("reclaimed_", rec)):
                    if not group:
                        continue
                    for part in group[0]["resume_exec_ms"]:
                        vals = [p["resume_exec_ms"][part] for p in group if p["resume_exec_ms"].get(part)]
                        if vals:
                            summ[f"resume_{label}{part}_p50_ms"] = spread([v["p50"] for v in vals])
                            summ[f"resume_{label}{part}_p99_ms"] = spread([v["p99"] for v in vals])
                    key = "mem_freed_by_pause_mib" if not label else "mem_freed_by_pause_and_reclaim_mib"
                    summ[key] = spread([-p["meminfo_change_per_sb"].get("used", 0) / MiB for p in group])
                if rec:
                    summ["reclaim_runs"] = len(rec)
                    summ["reclaim_cgroup_before_mib"] = spread([p["reclaim"]["memory_before_per_sb"] / MiB
                                                                for p in rec])
                    summ["reclaim_cgroup_after_mib"] = spread([p["reclaim"]["memory_after_per_sb"] / MiB
                                                               for p in rec])
                    summ["reclaim_ms_p50"] = spread([p["reclaim"]["duration_ms"]["p50"] for p in rec])
                psides[side] = {"runs": ps, "summary": summ}
            profiles["python-paused"] = {"sides": psides}
    return profiles


def render(res: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [k for k in ("shell", "python") if k in res.get("profiles", {})]
    if not kinds:
        return
    fig, axes = plt.subplots(len(kinds), 2, figsize=(12, 4.2 * len(kinds)), squeeze=False)
    colors = {"shoal": "tab:blue", "docker": "tab:red"}
    for row, kind in enumerate(kinds):
        for side, d in res["profiles"][kind]["sides"].items():
            steps = d["summary"].get("by_step", [])
            for col, (metric, label) in enumerate((("mem_used_mib", "host memory per sandbox (MiB)"),
                                                   ("create_p50_ms", "create p50 (ms)"))):
                pts = [(s["n"], s[metric]) for s in steps if metric in s]
                if col == 0 and any(n >= 100 for n, _ in pts):
                    pts = [(n, m) for n, m in pts if n >= 100]  # host-wide deltas over few sandboxes are noise
                if not pts:
                    continue
                ax = axes[row][col]
                xs = [n for n, _ in pts]
                who = "Shoal" if side == "shoal" else "Docker"
                ax.plot(xs, [m["median"] for _, m in pts], "o-", color=colors[side],
                        label=f"{who}{': host-wide delta / N (N ≥ 100)' if col == 0 else ''} "
                              f"(held {d['summary']['n_held']['median']:.0f})")
                ax.fill_between(xs, [m["min"] for _, m in pts], [m["max"] for _, m in pts], color=colors[side],
                                alpha=0.2)
                for k, run in enumerate(d["runs"]):  # each run on its own, past the steps all runs reached
                    get = STEP_METRICS[metric]
                    own = [(st["n"], get(st)) for st in run.get("steps", []) if get(st) is not None
                           and (col == 1 or st["n"] >= 100)]
                    if own and own[-1][0] > xs[-1]:
                        ax.plot([n for n, _ in own], [v for _, v in own], ":", color=colors[side], alpha=0.6,
                                label=f"{who}: each run" if k == 0 else None)
                    end = run.get("end")
                    if col == 0 and end and get(end) is not None:  # all paused (and merged / reclaimed)
                        ax.plot([end["n"]], [get(end)], "*", color=colors[side], markersize=11,
                                label=f"{who}: end of fill, all paused" if k == 0 else None)
                att = [(s["n"], s["attributed_mib"]["median"]) for s in steps if "attributed_mib" in s]
                if col == 0 and att:  # the side's own accounting: cgroups + host-side helpers' PSS
                    ax.plot([n for n, _ in att], [v for _, v in att], "--", color=colors[side],
                            label=f"{who}: cgroup + helpers' PSS")
                ax.set_xlabel("live idle sandboxes N")
                ax.set_ylabel(label)
                ax.set_title(f"{kind}: {label}")
                ax.set_xscale("log")
                ax.grid(True, alpha=0.3)
                ax.legend(fontsize=8)
    runs = max((d["summary"]["runs"] for k in kinds for d in res["profiles"][k]["sides"].values()), default=1)
    fig.suptitle(f"Idle sandbox density, Shoal vs Docker (median of {runs} run(s), band = min–max)")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def _cell(m: dict | None, fmt: str, unit: str = "", scale: float = 1.0) -> str:
    """median [min–max] of a spread dict (one run: the value alone)."""
    if not m:
        return ""
    f = lambda x: format(x / scale, fmt)  # noqa: E731
    if m["min"] == m["max"]:
        return f"{f(m['median'])}{unit}"
    return f"{f(m['median'])} [{f(m['min'])}–{f(m['max'])}]{unit}"


def _stops(runs: list[dict]) -> str:
    seen: list[str] = []
    for r in runs:
        why = str(r.get("stop"))
        if why not in seen:
            seen.append(why)
    return "; ".join(seen)


def python_held_goal(sides: dict) -> str:
    """The python row's goal cell: >= 3,000 held, and >= 3x Docker's count under the same stop rule."""
    held = {k: v["summary"]["n_held"]["median"] for k, v in sides.items()}
    if "docker" not in held or "shoal" not in held:
        return "≥ 3,000 paused + reclaimed, ≥ 3× Docker: not measured (no Docker fill in this file)"
    # a fill that ended at its own cap (--max, a time budget) did not reach the stop rule: its count is a floor
    capped = {k for k, v in sides.items() if all(("--max" in str(r.get("stop")) or "budget" in str(r.get("stop")))
                                                  for r in v.get("runs", []))}
    if capped == {"shoal", "docker"}:
        return "≥ 3,000 paused + reclaimed, ≥ 3× Docker: not measured (both sides' fills were capped)"
    s, d = held["shoal"], held["docker"]
    s_min = sides["shoal"]["summary"]["n_held"]["min"]
    d_max = sides["docker"]["summary"]["n_held"]["max"]
    floor = " (a floor: Shoal's fills ended at their cap, not at the stop rule)" if "shoal" in capped else ""
    n = sides["shoal"]["summary"]["n_held"].get("n", 1)
    if s_min >= 3000:
        held_v = f"met in every run ({n}; the fewest {s_min:,.0f})" if n > 1 else "met"
    elif s >= 3000:
        held_v = f"met at the median, not in every run (the fewest {s_min:,.0f}, {3000 - s_min:,.0f} short)"
    else:
        held_v = f"not met, {3000 - s:,.0f} short"
    worst = s_min / d_max  # Shoal's fewest against Docker's most
    ratio_v = "met" if worst >= 3 else ("met at the median, not run for run" if s / d >= 3 else "not met")
    return (f"≥ 3,000: {held_v}; ≥ 3× Docker: {s / d:.1f}× median to median, {worst:.1f}× Shoal's fewest to "
            f"Docker's most ({ratio_v}){floor}")


def readme_rows(j: dict) -> list[list[str]]:
    """README's density table (tests/test_docs_numbers.py, key `density`): figure | Shoal | Docker | goal."""
    rows: list[list[str]] = []
    P = j["profiles"]
    for kind in ("shell", "python"):
        if kind not in P:
            continue
        sides = P[kind]["sides"]
        sm = {k: v["summary"] for k, v in sides.items()}

        def at(side: str, key: str, step: int = -1, sm: dict = sm) -> dict | None:
            by = sm.get(side, {}).get("by_step", [])
            return by[step].get(key) if by else None

        def n_at(side: str, step: int = -1, sm: dict = sm) -> str:
            by = sm.get(side, {}).get("by_step", [])
            return f"N = {by[step]['n']:,}" if by else ""

        def both(key: str, fmt: str, unit: str, step: int = -1) -> list[str]:
            return [f"{_cell(at(side, key, step), fmt, unit)} at {n_at(side, step)}" if at(side, key, step) else ""
                    for side in ("shoal", "docker")]

        held = [f"{_cell(sm[side]['n_held'], ',.0f')} ({_stops(sides[side]['runs'])})" if side in sm else ""
                for side in ("shoal", "docker")]
        runs = max(v["runs"] for v in sm.values())
        top = sm["shoal"]["n_held"]["max"] if "shoal" in sm else 0
        if kind == "shell":
            stops = _stops(sides["shoal"]["runs"]) if "shoal" in sides else ""
            capped = "--max" in stops and "limit" not in stops
            goal = (f"≥ 20,000: not reached ({top:,.0f} was this run's cap)" if capped
                    else f"≥ 20,000: not reached (stopped at {top:,.0f} by a limit: see the stop rule)")
        else:
            goal = python_held_goal(sides)
        per_side = {k: v["runs"] for k, v in sm.items()}
        label = (f"{runs} run{'s' if runs > 1 else ''}" if len(set(per_side.values())) == 1 else  # else each side's
                 ", ".join(f"{'Shoal' if k == 'shoal' else 'Docker'} {v} run{'s' if v > 1 else ''}"
                           for k, v in per_side.items()))
        rows.append([f"{kind}: idle sandboxes held ({label}; stop rule)", *held, goal])
        rows.append([f"{kind}: host memory per idle sandbox (MemTotal − MemAvailable, delta / N)",
                     *both("mem_used_mib", ".2f", " MiB"), ""])
        rows.append([f"{kind}: memory in its own accounting (cgroup anon + shmem + kernel, + host helpers' PSS)",
                     *both("attributed_mib", ".2f", " MiB"), ""])
        rows.append([f"{kind}: tasks per sandbox (its cgroup + host helpers)", *both("attributed_tasks", ".1f", ""),
                     ""])
        rows.append([f"{kind}: create p50, first step", *both("create_p50_ms", ".1f", " ms", 0), ""])
        c0, c1 = at("shoal", "create_p50_ms", 0), at("shoal", "create_p50_ms")
        growth = c1["median"] / c0["median"] if c0 and c1 else None
        rows.append([f"{kind}: create p50 / p99, last step",
                     *[f"{_cell(at(side, 'create_p50_ms'), '.1f')} / {_cell(at(side, 'create_p99_ms'), '.0f')} ms at "
                       f"{n_at(side)}" if at(side, "create_p50_ms") else "" for side in ("shoal", "docker")],
                     f"p50 ≤ 2× an empty host at 20,000: Shoal's p50 is {growth:.1f}× its first step's already at "
                     f"{n_at('shoal')}" + (": not met" if growth > 2 else "") if growth else ""])
        if kind == "python":
            rows.append(["python: ready p50 after the create returned (session up, package + pytest imported)",
                         *both("ready_p50_ms", ".0f", " ms"), ""])
        e0, e1 = at("shoal", "exec_p50_ms", 0), at("shoal", "exec_p50_ms")
        eg = e1["median"] / e0["median"] if e0 and e1 else None
        rows.append([f"{kind}: exec `true` p50 in a sample of the idle sandboxes, last step",
                     *both("exec_p50_ms", ".1f", " ms"),
                     f"≤ 1.5× an empty host: {eg:.1f}× the first step's" + (" (met)" if eg <= 1.5 else " (not met)")
                     if eg else ""])
    pp = P.get("python-paused", {}).get("sides", {})
    if pp:
        sh, dk = pp.get("shoal", {}).get("summary", {}), pp.get("docker", {}).get("summary", {})
        rows.append(["python-paused: resume → first exec p50 / p99 (Shoal: exec on the paused sandbox; "
                     "Docker: `docker unpause` + `docker exec`)",
                     f"{_cell(sh.get('resume_total_p50_ms'), '.1f')} / {_cell(sh.get('resume_total_p99_ms'), '.0f')} ms"
                     if sh else "",
                     f"{_cell(dk.get('resume_total_p50_ms'), '.1f')} / {_cell(dk.get('resume_total_p99_ms'), '.0f')} ms"
                     if dk else "", "p50 ≤ 100 ms (after reclaim)"])
        if sh.get("mem_freed_by_pause_mib") or dk.get("mem_freed_by_pause_mib"):
            rows.append(["python-paused: host memory given back by pausing, per sandbox (no reclaim)",
                         _cell(sh.get("mem_freed_by_pause_mib"), ".2f", " MiB"),
                         _cell(dk.get("mem_freed_by_pause_mib"), ".2f", " MiB"), "≤ 1/4 of before after reclaim"])
        if sh.get("reclaim_runs"):
            rows.append([f"python-paused + reclaim (zram, target 1.0; {sh['reclaim_runs']} run"
                         f"{'s' if sh['reclaim_runs'] > 1 else ''}): cgroup MiB per sandbox before → after; host "
                         "memory given back per sandbox (MemAvailable, zram's RAM counted)",
                         f"{_cell(sh.get('reclaim_cgroup_before_mib'), '.2f')} → "
                         f"{_cell(sh.get('reclaim_cgroup_after_mib'), '.2f')} MiB; "
                         f"{_cell(sh.get('mem_freed_by_pause_and_reclaim_mib'), '.2f', ' MiB')}",
                         "no per-container reclaim", "≤ 1/4 of before (bench/reclaim.py)"])
            rows.append(["python-paused + reclaim: resume → first exec p50 / p99",
                         f"{_cell(sh.get('resume_reclaimed_total_p50_ms'), '.1f')} / "
                         f"{_cell(sh.get('resume_reclaimed_total_p99_ms'), '.0f')} ms", "", "p50 ≤ 100 ms"])
    return rows


DOC_ROWS: list[tuple[str, str, str, str]] = [  # docs/density.md's per-profile table: label, metric, format, unit
    ("host memory, MemTotal − MemAvailable delta / N", "mem_used_mib", ".2f", " MiB"),
    ("of which AnonPages (host-wide delta / N)", "anon_mib", ".2f", " MiB"),
    ("of which Slab (host-wide delta / N)", "slab_mib", ".2f", " MiB"),
    ("the side's cgroups: anon", "cg_anon_mib", ".2f", " MiB"),
    ("the side's cgroups: kernel (v1 kmem usage)", "cg_kernel_mib", ".2f", " MiB"),
    ("host-side helpers' PSS (Shoal: supervisor; Docker: shim, dockerd, containerd)", "helper_pss_mib", ".2f", " MiB"),
    ("own accounting: cgroup anon + shmem + kernel + helpers' PSS", "attributed_mib", ".2f", " MiB"),
    ("tasks: in its cgroup + host-side helper threads", "attributed_tasks", ".1f", ""),
    ("tasks in its cgroup", "cgroup_tasks", ".1f", ""),
    ("mounts added to the host's mount namespace", "mounts_host", ".2f", ""),
    ("mounts inside the sandbox", "mounts_in_sandbox", ".0f", ""),
    ("ready p50 after the create returned, last step window", "ready_p50_ms", ".0f", " ms"),
    ("exec `true` p50 (a sample of 10 live sandboxes)", "exec_p50_ms", ".1f", " ms"),
    ("fds the in-process client holds per sandbox", "client_fds", ".1f", ""),
]


def doc_tables(j: dict, kind: str) -> str:
    """docs/density.md's two tables for one profile (`--doc-tables shell`): per idle sandbox at the last
    step all runs reached, and the by-N rows, Shoal beside Docker."""
    sides = j["profiles"][kind]["sides"]
    sm = {k: v["summary"] for k, v in sides.items()}
    last = {k: v.get("last_common", {}) for k, v in sm.items()}
    col = [s for s in ("shoal", "docker")]
    out = ["| per idle sandbox, at the last step all runs reached | Shoal | Docker |", "|---|---|---|",
           "| N | " + " | ".join(f"{last[s]['n']:,}" if last.get(s) else "" for s in col) + " |"]
    for label, key, fmt, unit in DOC_ROWS:
        out.append(f"| {label} | " + " | ".join(_cell(last.get(s, {}).get(key), fmt, unit) for s in col) + " |")
    kills = []
    for s in col:
        runs = sides.get(s, {}).get("runs", [])
        kills.append(", ".join(f"{r['kill_all_s']:.1f} s for {r['n_held']:,}" for r in runs
                               if r.get("kill_all_s") is not None))
    out.append("| kill all (per run: seconds for N sandboxes) | " + " | ".join(kills) + " |")
    out += ["", "| N | Shoal: host memory / sandbox | Shoal: own accounting | Shoal: create p50 / p99 | "
            "Docker: host memory / sandbox | Docker: own accounting | Docker: create p50 / p99 |",
            "|---|---|---|---|---|---|---|"]
    by = {s: {r["n"]: r for r in sm.get(s, {}).get("by_step", [])} for s in col}
    for n in sorted(set(by["shoal"]) | set(by["docker"])):
        cells = []
        for s in col:
            r = by[s].get(n)
            if r is None:
                cells += ["", "", ""]
                continue
            cells += [_cell(r.get("mem_used_mib"), ".2f", " MiB"), _cell(r.get("attributed_mib"), ".2f", " MiB"),
                      f"{_cell(r.get('create_p50_ms'), '.1f')} / {_cell(r.get('create_p99_ms'), '.0f')} ms"]
        out.append(f"| {n:,} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def merge_runs(files: list[dict]) -> dict:
    """The runs of several result files as one: each file's runs of a profile, in order (a run holds the
    sides it filled), summarized again; the files' meta entries kept side by side."""
    runs: dict[str, list[dict]] = {}
    meta: dict[str, list] = {}
    with_paused = False
    for j in files:
        for kind in ("shell", "python"):
            sides = j.get("profiles", {}).get(kind, {}).get("sides", {})
            n = max((len(v["runs"]) for v in sides.values()), default=0)
            runs.setdefault(kind, []).extend({side: v["runs"][i] for side, v in sides.items() if i < len(v["runs"])}
                                             for i in range(n))
        with_paused = with_paused or "python-paused" in j.get("profiles", {})
        for k, v in j.get("meta", {}).items():
            meta.setdefault(k, []).extend(v if isinstance(v, list) else [v])
    runs = {k: v for k, v in runs.items() if v}
    return {"profiles": collect(runs, with_paused), "meta": meta, "bench": "density"}


def slab_objects(cache: str, text: str | None = None) -> int | None:
    """Active objects of one slab cache, from /proc/slabinfo."""
    try:
        text = Path("/proc/slabinfo").read_text() if text is None else text
    except OSError:
        return None
    for line in text.splitlines():
        f = line.split()
        if f and f[0] == cache and len(f) > 1 and f[1].isdigit():
            return int(f[1])
    return None


def shrinker_probe(k: int = 64) -> dict | None:
    """The kernel's shrinker-id high-water mark, as it shows in a new memory cgroup: its shrinker_info holds
    one 520-byte unit (a kmalloc-1k object) per 64 ids up to the highest id the host has ever used, and
    that mark never goes down until a reboot (docs/density.md). mkdir k empty memory cgroups, count the
    kmalloc-1k objects they add, remove them. A rough reading (other kmalloc-1k users run meanwhile)."""
    root = memcg_dir("")
    if not (root / "memory.stat").exists() and not (root / "cgroup.procs").exists():
        return None
    dirs = [root / f"shoal-density-shrinker-probe-{os.getpid()}-{i}" for i in range(k)]
    before = slab_objects("kmalloc-1k")
    made = []
    try:
        for d in dirs:
            d.mkdir()
            made.append(d)
        after = slab_objects("kmalloc-1k")
    except OSError:
        return None
    finally:
        for d in made:
            try:
                d.rmdir()
            except OSError:
                pass
    if before is None or after is None:
        return None
    units = (after - before) / k
    return {"kmalloc_1k_per_memcg": round(units, 1), "shrinker_ids_high_water_est": round(units * 64),
            "memcgs_probed": k}


def git_commit() -> str | None:
    repo = Path(__file__).resolve().parents[1]
    r = subprocess.run(["git", "-C", str(repo), "describe", "--always", "--dirty", "--abbrev=12"],
                       capture_output=True, text=True, check=False)
    return r.stdout.strip() or None


def ksm_settings() -> dict[str, int | None]:
    ksm = Path("/sys/kernel/mm/ksm")
    out: dict[str, int | None] = {}
    for name in ("run", "pages_to_scan", "sleep_millisecs", "full_scans", "pages_shared", "pages_sharing"):
        try:
            out[name] = int((ksm / name).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            out[name] = None
    return out


def host_facts() -> dict:
    mi = meminfo()
    return {"kernel": platform.release(), "cpus": os.cpu_count(), "mem_total_gib": mi["MemTotal"] / 2**30,
            "cgroup": "v1 (hybrid)" if Path("/sys/fs/cgroup/memory").is_dir() else "v2",
            "python": platform.python_version(), "loadavg_start": Path("/proc/loadavg").read_text().split()[:3],
            "uptime_s": round(float(Path("/proc/uptime").read_text().split()[0])), "commit": git_commit(),
            "ksm_start": ksm_settings(), "shrinker_start": shrinker_probe(),
            "mem_available_gib_start": round(mi["MemAvailable"] / 2**30, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profiles", default="shell", help=f"comma list of {', '.join(PROFILES)}")
    ap.add_argument("--max", type=int, default=2000, help="shell: most Shoal sandboxes")
    ap.add_argument("--py-max", type=int, default=600, help="python: most Shoal sandboxes")
    ap.add_argument("--docker", action="store_true", help="also fill with Docker containers")
    ap.add_argument("--sides", default="shoal,docker",
                    help="which sides fill (comma list of shoal, docker; docker needs --docker): e.g. `--sides "
                         "docker --docker --append-runs` adds Docker runs to a file's Shoal runs")
    ap.add_argument("--docker-max", type=int, default=1000, help="shell: most Docker containers")
    ap.add_argument("--docker-py-max", type=int, default=400, help="python: most Docker containers")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--free-min", type=float, default=0.10, help="stop when MemAvailable/MemTotal is below this")
    ap.add_argument("--min-available-gib", type=float, default=0.0,
                    help="also stop when MemAvailable falls below this (a shared host's guard; 0: off)")
    ap.add_argument("--pause-every", type=int, default=0,
                    help="python-paused: pause (and with --reclaim, reclaim) every this many sandboxes during the fill")
    ap.add_argument("--idle-pipeline", action="store_true",
                    help="pause (and with --reclaim, reclaim) each sandbox --pipeline-idle-s after it is ready, in "
                         "--idle-workers background threads, while the fill goes on (shoald's idle policy, per "
                         "sandbox); the fill waits for them below --min-available-gib + --pace-gib")
    ap.add_argument("--settle-s", type=float, default=0.0,
                    help="--idle-pipeline: after the fill, watch the sandboxes' memory this long (ksmd merging the "
                         "last ones) before the end-of-fill measurement")
    ap.add_argument("--pipeline-idle-s", type=float, default=1.0, help="idle time before the pipeline pauses one")
    ap.add_argument("--idle-workers", type=int, default=1, help="threads pausing / reclaiming (--idle-pipeline)")
    ap.add_argument("--pace-gib", type=float, default=1.5,
                    help="--idle-pipeline: MemAvailable margin above --min-available-gib where the fill waits")
    ap.add_argument("--zram-mb", type=int, default=0,
                    help="with --reclaim: set up a zram swap device of this size for the run (top priority, "
                         "a private state file), torn down after")
    ap.add_argument("--zram-algorithm", default="lzo-rle", help="its compressor")
    ap.add_argument("--ksm-pages-to-scan", type=int, default=0,
                    help="with --ksm: ksmd's pages per wake-up for the run (0: Shoal's [ksm] default); restored after")
    ap.add_argument("--guard-wait-s", type=float, default=0.0,
                    help="when --min-available-gib is reached, wait up to this long for ksmd/reclaim before stopping")
    ap.add_argument("--session-procs", type=int, default=0,
                    help="hold the Shoal sandboxes' sessions in this many client processes (0: in the bench's own "
                         "process); one process's RLIMIT_NOFILE holds about nofile/4 sessions")
    ap.add_argument("--p99-max", type=float, default=1.0, help="stop when the create p99 (last 50) is above (s)")
    ap.add_argument("--exec-sample", type=int, default=10, help="sandboxes probed with an exec at each step")
    ap.add_argument("--resume-sample", type=int, default=100, help="paused sandboxes resumed (python-paused)")
    ap.add_argument("--idle-s", type=float, default=5.0, help="idle period before pausing (python-paused)")
    ap.add_argument("--ready-workers", type=int, default=2, help="threads waiting for sandboxes to be ready")
    ap.add_argument("--fill-budget-s", type=float, default=0.0, help="stop a side's fill after this long (0: none)")
    ap.add_argument("--docker-fill-budget-s", type=float, default=0.0, help="the same for Docker (0: as above)")
    ap.add_argument("--tune-host", action="store_true", help="raise the kernel limits for the run (restored after)")
    ap.add_argument("--reclaim", action="store_true", help="reclaim paused sandboxes (when the API exists)")
    ap.add_argument("--reclaim-target", type=float, default=0.75, help="fraction of anon memory to reclaim")
    ap.add_argument("--ksm", action="store_true", help="create with KSM on (when the API exists)")
    ap.add_argument("--memory-cgroup", choices=("own", "pooled"), default="own",
                    help="Shoal: a memory cgroup per sandbox (own), or shared by pools (pooled, docs/density.md)")
    ap.add_argument("--gc-freeze", action="store_true",
                    help="client: gc.freeze() at each step, so CPython's full collections skip the handles held")
    ap.add_argument("--cpu-weight", action="store_true",
                    help="cpu as a weight, no CFS quota, on both sides (Shoal: [density] cpu_quota = false; "
                         "Docker: --cpu-shares instead of --cpus): a quota write walks every task group")
    ap.add_argument("--pool-size", type=int, default=0, help="sandboxes per memory pool (0: the root's setting, 64)")
    ap.add_argument("--root", default="/var/tmp/shoal-density", help="Shoal root for the bench")
    ap.add_argument("--py-root", default=os.environ.get("SHOAL_PY_ROOT", "/var/tmp/shoal-py"),
                    help="a root with python:3.11 built (pulled from, hard-linked)")
    ap.add_argument("--out", default=None, help=f"default {DEFAULT_OUT} ({QUICK_OUT} with --quick)")
    ap.add_argument("--append-runs", action="store_true",
                    help="add this invocation's runs to those of the same profiles already in --out")
    ap.add_argument("--fresh", action="store_true", help="do not keep other profiles from an existing --out")
    ap.add_argument("--quick", action="store_true", help="smoke: shell profile, 8 sandboxes, 1 run")
    ap.add_argument("--render-only", action="store_true", help="redraw the PNG from --out")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="write --out from these result files' runs")
    ap.add_argument("--doc-tables", metavar="PROFILE", help="print docs/density.md's tables for PROFILE from --out")
    a = ap.parse_args(argv)
    out = Path(a.out or (QUICK_OUT if a.quick else DEFAULT_OUT))
    png = out.with_suffix(".png")
    if a.doc_tables:
        print(doc_tables(json.loads(out.read_text()), a.doc_tables))
        return 0
    if a.merge:  # several invocations' runs into one file (each invocation <= 10 min on a shared host)
        res = merge_runs([json.loads(Path(f).read_text()) for f in a.merge])
        out.write_text(json.dumps(res, indent=1, default=str) + "\n")
        render(res, png)
        console.print(f"wrote {out} and {png} from {len(a.merge)} files")
        return 0
    if a.render_only:
        render(json.loads(out.read_text()), png)
        console.print(f"wrote {png}")
        return 0
    profiles = [p.strip() for p in a.profiles.split(",") if p.strip()]
    bad = [p for p in profiles if p not in PROFILES]
    if bad:
        ap.error(f"unknown profile(s) {bad}; choose from {PROFILES}")
    if a.quick:
        profiles, a.max, a.docker_max, a.runs, a.exec_sample = ["shell"], 8, 8, 1, 3
    if a.runs < 1 or a.max < 1 or a.py_max < 1:
        ap.error("--runs, --max, --py-max must be >= 1")
    sides_bad = set(a.sides.split(",")) - {"shoal", "docker"}
    if sides_bad or ("shoal" not in a.sides and not a.docker):
        ap.error(f"--sides: choose from shoal, docker (docker needs --docker); got {a.sides!r}")
    if os.geteuid() != 0:
        ap.error("the bench creates sandboxes in-process: run it as root")
    kinds = []
    for p in profiles:
        k = "shell" if p == "shell" else "python"
        if k not in kinds:
            kinds.append(k)
    with_paused = "python-paused" in profiles
    nofile = raise_nofile()
    sysctl_before = read_sysctls()
    tuned: dict[str, tuple[int, int]] = {}
    if a.tune_host:
        for k, (old, new) in tune_plan(sysctl_before).items():
            try:
                write_sysctl(k, new)
                tuned[k] = (old, new)
            except OSError as e:
                console.print(f"[yellow]--tune-host: {k}: {e}[/yellow]")
    Path(a.root).mkdir(parents=True, exist_ok=True)
    runs_by_kind: dict[str, list[dict]] = {k: [] for k in kinds}
    facts: dict[str, Any] = host_facts()
    zram_state = Path(tempfile.mkdtemp(prefix="shoal-density-zram-")) / "zram.json"
    ksm_sysfs = Path("/sys/kernel/mm/ksm/pages_to_scan")
    ksm_before = ksm_sysfs.read_text().strip() if a.ksm_pages_to_scan and ksm_sysfs.exists() else None
    try:
        if a.zram_mb and a.reclaim:
            from shoal.backends.container import zram

            # the top swap priority: another user's device of equal priority would take every other page
            dev = zram.setup(zram.ZramConfig(size_mb=a.zram_mb, algorithm=a.zram_algorithm, priority=32767),
                             zram_state)
            ZRAM_DEV.append(dev)
            facts["zram"] = {"device": dev.path, "size_mb": dev.size_mb, "algorithm": dev.algorithm}
        if a.ksm_pages_to_scan:
            facts["ksm_pages_to_scan"] = {"run": a.ksm_pages_to_scan, "before": ksm_before}
        for kind in kinds:
            runs_by_kind[kind] = run_kind(kind, a, with_paused and kind == "python")
    finally:
        for k, (old, _) in tuned.items():
            try:
                write_sysctl(k, old)
            except OSError:
                pass
        if ksm_before is not None:  # ksmd's pace as it was (Shoal never stops ksmd: nor does the bench)
            ksm_sysfs.write_text(ksm_before)
        if a.zram_mb and a.reclaim:
            from shoal.backends.container import zram

            ZRAM_DEV.clear()
            zram.teardown(zram_state)
        facts["loadavg_end"] = Path("/proc/loadavg").read_text().split()[:3]
        facts["ksm_end"] = ksm_settings()
        facts["shrinker_end"] = shrinker_probe()
        facts["mem_available_gib_end"] = round(meminfo()["MemAvailable"] / 2**30, 2)
    res: dict[str, Any] = {}
    if out.exists() and not a.fresh and not a.quick:
        try:
            res = json.loads(out.read_text())
        except ValueError:
            res = {}
    res.setdefault("profiles", {})
    if a.append_runs:  # earlier runs of the same profiles first (each invocation <= 10 min)
        for kind in kinds:
            old = res["profiles"].get(kind, {}).get("sides", {})
            n_old = max((len(v["runs"]) for v in old.values()), default=0)
            prev = [{side: v["runs"][i] for side, v in old.items() if i < len(v["runs"])} for i in range(n_old)]
            runs_by_kind[kind] = prev + runs_by_kind[kind]
    new = collect(runs_by_kind, with_paused)
    res["profiles"].update(new)
    for k in new:
        entry = {
            "host": facts, "args": {k2: v for k2, v in vars(a).items()}, "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                        time.gmtime()),
            "sysctl_before": sysctl_before, "tuned": tuned, "nofile": nofile,
            "limits_per_sandbox": {"memory_mb": LIMITS_MB, "cpu": LIMITS_CPU, "pids": LIMITS_PIDS,
                                   "memory_cgroup": a.memory_cgroup,
                                   "cpu_as": "weight" if a.cpu_weight else "cap (CFS quota)"}}
        meta = res.setdefault("meta", {})
        meta[k] = (meta.get(k, []) if a.append_runs and isinstance(meta.get(k), list) else []) + [entry]
    res["bench"] = "density"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, default=str) + "\n")
    render(res, png)
    console.print(f"wrote {out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
