#!/usr/bin/env python3
"""Burst benchmark: N tasks over m real workspaces, Shoal vs Docker, every side run the same way.

Each task = the python:3.11 base + one of m PyPI workspaces + a per-task file (task.json), and runs
one workload (named in every table and in the JSON):

  agent   an agent-like tool-call sequence: read the task, list and grep the repo, git status,
          import the package (default);
  tests   the project's quick pytest subset (CPU work that every side pays alike).

Four sides, interleaved (for each run and N, the sides go in a rotated order):

  shoal         build the task layer (EROFS), create base + workspace + task layer, run, kill;
                the writable upper is a tmpfs (memory-backed: it shows in the peak-memory column).
  shoal-disk    the same with upper="disk": the upper is a per-sandbox ext4 on a loop device on
                the Shoal root's disk (its writes are in the disk column).
  docker-bind   what a careful Docker user does: no per-task build; `docker run --rm` of the
                workspace image with the task file bind-mounted read-only.
  docker-eager  one image per task (`docker build`: FROM the workspace image + COPY task.json),
                then `docker run --rm` of it; DSec's comparison.

Each side writes its task file on the host inside the timed window. Measured per (side, N, run):
wall time, p50/p99 task latency, bytes written to the backing disk (/proc/diskstats, `sync` inside
the window), storage growth (du of the Shoal root / Docker's data root), peak host memory used
above the start (MemTotal - MemAvailable, sampled every 50 ms: tmpfs pages count, page cache
does not), the peak of anon + shmem memory in the side's cgroups, and the 1-minute load average
at the start and end (the machine may be shared). With --runs R (>= 3) the
JSON keeps every run and min/median/max per metric; ratios are taken per run (same run, same N).
Also snapshot latency (1/10/100 MB of changes) for both uppers and fork(10)/fork(100).

The Docker engine (Debian docker.io) is started by this script if none is running and stopped
afterwards. Writes bench/results/burst.json (.png); `--sequence tests --out
bench/results/burst-tests.json` for the tests workload. `--workspaces busybox` uses synthetic
busybox workspaces (no Debian build; a smoke test).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from shoal import Host, Sandbox  # noqa: E402
from shoal.core.errors import ShoalError  # noqa: E402
from shoal.layers.busybox import make_busybox_tree  # noqa: E402
from shoal.backends.container.cgroups import CGROUP_ROOT, cgroup_parent  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from docker_engine import PrivateDockerd  # noqa: E402

console = Console(width=160)
RESULTS = Path(__file__).parent / "results"
SIDES = ("shoal", "shoal-disk", "docker-bind", "docker-eager")
METRICS = ("wall_s", "p50_ms", "p99_ms", "bytes_written", "storage_growth", "peak_mem_bytes", "peak_cg_mem_bytes")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def spread(xs: list[float]) -> dict:
    med = statistics.median(xs)
    return {"min": min(xs), "median": round(med, 4) if isinstance(med, float) else med, "max": max(xs)}


# ------------------------------------------------------------------------------------------ measuring
def disk_device() -> str:
    """The block device (name in /proc/diskstats) holding / (Shoal's root and Docker's data root)."""
    dev = os.stat("/").st_dev
    maj, mnr = os.major(dev), os.minor(dev)
    with open("/proc/diskstats") as f:
        for line in f:
            p = line.split()
            if int(p[0]) == maj and int(p[1]) == mnr:
                return p[2]
    raise RuntimeError("cannot find the disk behind /")


def sectors_written(dev: str) -> int:
    with open("/proc/diskstats") as f:
        for line in f:
            p = line.split()
            if p[2] == dev:
                return int(p[9]) * 512
    return 0


def used_memory() -> int:
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":")
            info[k] = int(v.split()[0]) * 1024
    return info["MemTotal"] - info["MemAvailable"]


def cgroup_mem_dirs(name: str) -> Path:
    """The memory cgroup directory of a parent group (v1: memory controller; v2: unified)."""
    v1 = CGROUP_ROOT / "memory"
    return (v1 if v1.is_dir() else CGROUP_ROOT) / name


def cgroup_anon_shmem(d: Path) -> int:
    """anon + shmem of a cgroup and its children: what it holds that reclaim cannot drop."""
    try:
        stat = dict(line.split() for line in (d / "memory.stat").read_text().splitlines())
    except OSError:
        return 0
    if "total_rss" in stat:  # v1, hierarchical totals
        return int(stat["total_rss"]) + int(stat.get("total_shmem", 0))
    return int(stat.get("anon", 0)) + int(stat.get("shmem", 0))


def du(path: Path) -> int:
    if not path.exists():
        return 0
    r = subprocess.run(["du", "-sb", "-x", str(path)], capture_output=True, text=True, check=False)
    try:
        return int(r.stdout.split()[0])
    except (IndexError, ValueError):
        return 0


class Window:
    """Measures one phase: wall time, disk bytes written (sync'ed), peak host memory above the start,
    peak anon + shmem of the side's cgroup parent."""

    def __init__(self, dev: str, cgroup: Path):
        self.dev = dev
        self.cgroup = cgroup

    def __enter__(self):
        subprocess.run(["sync"], check=False)
        self.w0 = sectors_written(self.dev)
        self.m0 = used_memory()
        self.load0 = os.getloadavg()[0]  # how busy the shared machine was (others' jobs included)
        self.peak = self.m0
        self.cg_peak = 0
        self.stop = threading.Event()
        self.sampler = threading.Thread(target=self._sample, daemon=True)
        self.sampler.start()
        self.t0 = time.perf_counter()
        return self

    def _sample(self):
        while not self.stop.wait(0.05):
            self.peak = max(self.peak, used_memory())
            self.cg_peak = max(self.cg_peak, cgroup_anon_shmem(self.cgroup))

    def __exit__(self, *exc):
        subprocess.run(["sync"], check=False)
        self.wall = time.perf_counter() - self.t0
        self.stop.set()
        self.sampler.join()
        self.written = sectors_written(self.dev) - self.w0
        self.peak_mem = self.peak - self.m0
        self.load1 = os.getloadavg()[0]


def progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=True)


# ------------------------------------------------------------------------------------------ workspaces
def prepare_workspaces(host: Host, m: int, kind: str, sequence: str = "agent") -> tuple[str, list[dict]]:
    """Returns (base image, [{image, cmd, env, workdir}]) for m workspaces."""
    if kind == "busybox":
        with tempfile.TemporaryDirectory() as d:
            host.store.build_from_dir(make_busybox_tree(Path(d) / "bb"), source="busybox", name="busybox")
        host.store.create_image("burst-busybox:1", ["busybox"])
        out = []
        for k in range(m):
            with tempfile.TemporaryDirectory() as d:
                repo = Path(d) / "work" / "repo"
                repo.mkdir(parents=True)
                for j in range(20):
                    (repo / f"mod{j}.txt").write_text(f"workspace {k} module {j}\n" * 50)
                (repo / "test.sh").write_text(
                    "set -e\nfor f in mod*.txt; do grep -q workspace $f; done\n"
                    "cat /work/task/task.json | grep -q task\nmd5sum mod*.txt > /tmp/sums\necho ok\n")
                layer = host.store.build_from_dir(d, name=f"burst-ws{k}")
            host.store.create_image(f"burst-ws{k}:1", [layer.digest], config={"workdir": "/work/repo",
                                                                             "role": "workspace"})
            out.append({"image": f"burst-ws{k}:1", "cmd": "sh test.sh", "env": {}, "workdir": "/work/repo"})
        return "burst-busybox:1", out
    from shoal.envs.debian import PYTHON_IMAGE, ensure_python_base
    from shoal.envs.workspaces import (
        CATALOG,
        agent_sequence,
        build_workspace,
        test_command,
    )

    if m > len(CATALOG):
        raise SystemExit(f"--m {m}: only {len(CATALOG)} real workspaces in the catalog")
    console.print("building the Debian base, the Python toolchain and the workspaces (cached after the first run)")
    ensure_python_base(host)
    out = []
    with progress() as p:
        t = p.add_task("workspaces", total=m)
        for spec in CATALOG[:m]:
            img = build_workspace(host, spec)
            cmd = test_command(spec, quick=True) if sequence == "tests" else agent_sequence(spec)
            out.append({"image": img.ref, "cmd": cmd,
                        "env": host.store.get_image(PYTHON_IMAGE).config.get("env", {}), "workdir": "/work/repo"})
            p.advance(t)
    return PYTHON_IMAGE, out


def task_content(i: int) -> str:
    return json.dumps({"task": i, "instance_id": f"burst-{i:05d}", "seed": i * 7919 % 10007}) + "\n"


# ------------------------------------------------------------------------------------------ shoal
def run_shoal(host: Host, base: str, workspaces: list[dict], n: int, conc: int, dev: str, upper: str) -> dict:
    lat: list[float] = []
    fails: list[str] = []
    scratch = Path(tempfile.mkdtemp(dir=host.settings.tmp_dir, prefix="burst-"))
    task_layers: list[str] = []
    lock = threading.Lock()
    store_before = du(host.settings.root)
    args = dict(memory_mb=1024, disk_mb=256, upper=upper)

    def one(i: int):
        ws = workspaces[i % len(workspaces)]
        t0 = time.perf_counter()
        d = scratch / str(i)
        (d / "work" / "task").mkdir(parents=True)
        (d / "work" / "task" / "task.json").write_text(task_content(i))
        layer = host.store.build_from_dir(d, source=f"burst task {i}")
        with Sandbox.create(base, layers=[ws["image"], layer.digest], root=host.settings.root, url="local",
                            **args) as sb:
            r = sb.commands.run(ws["cmd"], timeout=300)
        dt = time.perf_counter() - t0
        with lock:
            lat.append(dt)
            task_layers.append(layer.digest)
            if r.exit_code != 0:
                fails.append(f"task {i}: exit {r.exit_code}: {(r.stdout + r.stderr)[-300:]}")

    cg = cgroup_mem_dirs(cgroup_parent(host.settings.root))
    with Window(dev, cg) as w, progress() as p, ThreadPoolExecutor(conc) as ex:
        t = p.add_task(f"shoal ({upper} upper) N={n}", total=n)
        for f in [ex.submit(one, i) for i in range(n)]:
            f.result()
            p.advance(t)
    growth = du(host.settings.root) - store_before
    for d in task_layers:  # not timed: drop the per-task layers again
        try:
            host.store.remove_layer(d)
        except ShoalError as e:  # e.g. still referenced: leave it, say so
            console.print(f"[yellow]task layer {d[:12]} kept: {e}[/yellow]")
    shutil.rmtree(scratch, ignore_errors=True)
    return _metrics(n, w, lat, fails, growth)


# ------------------------------------------------------------------------------------------ docker
DOCKER_CGROUP = "shoal-burst-docker"  # containers' cgroup parent: sampled for the cgroup memory column


def docker_import_workspaces(host: Host, base: str, workspaces: list[dict]) -> list[str]:
    """One Docker image per workspace: the merged rootfs of base + workspace (setup, not timed)."""
    names = []
    for k, ws in enumerate(workspaces):
        name = f"shoal-burst-ws{k}:1"
        names.append(name)
        if subprocess.run(["docker", "image", "inspect", name], capture_output=True, check=False).returncode == 0:
            continue
        layers = list(host.store.get_image(base).layers) + list(host.store.get_image(ws["image"]).layers)
        mounts = host.store.ensure_mounted(layers)
        merged = Path(tempfile.mkdtemp(prefix="shoal-merged-"))
        try:
            lower = ":".join(str(m) for m in reversed(mounts))
            subprocess.run(["mount", "-t", "overlay", "overlay", "-o", f"lowerdir={lower}", str(merged)], check=True)
            tar = subprocess.Popen(["tar", "-C", str(merged), "-c", "."], stdout=subprocess.PIPE)
            subprocess.run(["docker", "import", "-", name], stdin=tar.stdout, check=True, capture_output=True)
            tar.wait()
        finally:
            subprocess.run(["umount", str(merged)], capture_output=True, check=False)
            merged.rmdir()
    return names


def run_docker(mode: str, ws_images: list[str], workspaces: list[dict], n: int, conc: int, dev: str,
               data_root: Path, cgroup: Path) -> dict:
    """mode "eager": docker build (FROM workspace + COPY task.json) then docker run of that image;
    mode "bind": docker run of the workspace image with task.json bind-mounted read-only."""
    lat: list[float] = []
    fails: list[str] = []
    lock = threading.Lock()
    ctx_root = Path(tempfile.mkdtemp(prefix="shoal-dctx-"))
    store_before = du(data_root)

    def one(i: int):
        k = i % len(workspaces)
        ws = workspaces[k]
        t0 = time.perf_counter()
        ctx = ctx_root / str(i)
        ctx.mkdir()
        (ctx / "task.json").write_text(task_content(i))
        env_args = [a for k_, v in ws["env"].items() for a in ("-e", f"{k_}={v}")]
        if mode == "eager":
            (ctx / "Dockerfile").write_text(f"FROM {ws_images[k]}\nCOPY task.json /work/task/task.json\n")
            image = f"shoal-burst-task{i}:1"
            b = subprocess.run(["docker", "build", "-q", "-t", image, str(ctx)], capture_output=True, text=True,
                               env={**os.environ, "DOCKER_BUILDKIT": "0"}, check=False)
            if b.returncode != 0:
                with lock:
                    fails.append(f"task {i}: docker build: {b.stderr[-300:]}")
                return
            mount: list[str] = []
        else:
            image = ws_images[k]
            mount = ["-v", f"{ctx / 'task.json'}:/work/task/task.json:ro"]
        r = subprocess.run(["docker", "run", "--rm", "--network=none", "-w", ws["workdir"], *env_args, *mount,
                            image, "/bin/sh", "-c", ws["cmd"]], capture_output=True, text=True, check=False)
        dt = time.perf_counter() - t0
        with lock:
            lat.append(dt)
            if r.returncode != 0:
                fails.append(f"task {i}: exit {r.returncode}: {(r.stdout + r.stderr)[-300:]}")

    with Window(dev, cgroup) as w, progress() as p, ThreadPoolExecutor(conc) as ex:
        t = p.add_task(f"docker {mode} N={n}", total=n)
        for f in [ex.submit(one, i) for i in range(n)]:
            f.result()
            p.advance(t)
    growth = du(data_root) - store_before
    if mode == "eager":
        tags = [f"shoal-burst-task{i}:1" for i in range(n)]
        for chunk in range(0, len(tags), 100):  # not timed
            subprocess.run(["docker", "rmi", "-f", *tags[chunk:chunk + 100]], capture_output=True, check=False)
    shutil.rmtree(ctx_root, ignore_errors=True)
    return _metrics(n, w, lat, fails, growth)


def _metrics(n: int, w: Window, lat: list[float], fails: list[str], growth: int) -> dict:
    ms = sorted(x * 1000 for x in lat) or [0.0]
    return {"n": n, "wall_s": round(w.wall, 2), "p50_ms": round(statistics.median(ms), 1),
            "p99_ms": round(pct(ms, 0.99), 1), "bytes_written": w.written, "storage_growth": growth,
            "peak_mem_bytes": w.peak_mem, "peak_cg_mem_bytes": w.cg_peak, "failed": len(fails),
            "loadavg_1m": [round(w.load0, 2), round(w.load1, 2)],
            "fail_examples": fails[:3]}


# ------------------------------------------------------------------------------------------ snapshot / fork
def bench_snapshot_fork(host: Host, base: str, ws: dict, runs: int) -> dict:
    out: dict = {"runs": runs, "snapshot_ms": {}, "fork_s": {}, "fork_failed": {}}
    # what a disk upper of disk_mb leaves usable: bytes a file reaches before ENOSPC
    with Sandbox.create(base, layers=[ws["image"]], root=host.settings.root, url="local",
                        memory_mb=256, disk_mb=256, upper="disk") as sb:
        r = sb.commands.run("dd if=/dev/zero of=/fill bs=1M count=300 2>/dev/null; wc -c < /fill", timeout=120)
        out["disk_upper"] = {"disk_mb": 256, "usable_bytes": int(r.stdout.strip() or 0),
                             "usable_fraction": round(int(r.stdout.strip() or 0) / (256 * 2**20), 4)}
    for upper in ("tmpfs", "disk"):
        out["snapshot_ms"][upper] = {}
        for mb in (1, 10, 100):
            times = []
            for _ in range(runs):
                with Sandbox.create(base, layers=[ws["image"]], root=host.settings.root, url="local",
                                    memory_mb=1024, disk_mb=512, upper=upper) as sb:
                    sb.commands.run(f"head -c {mb * 1024 * 1024} /dev/urandom > /work/blob.bin", timeout=120)
                    t0 = time.perf_counter()
                    snap = sb.snapshot()
                    times.append(round((time.perf_counter() - t0) * 1000, 1))
                    host.store.remove_image(snap.image)
            out["snapshot_ms"][upper][f"{mb}MB"] = spread(times)
    for n in (10, 100):
        times, failed = [], 0
        for _ in range(runs):
            with Sandbox.create(base, layers=[ws["image"]], root=host.settings.root, url="local",
                              memory_mb=256) as sb:
                sb.commands.run("echo state > /work/state.txt")
                t0 = time.perf_counter()
                res = sb.fork(n, memory_mb=128, disk_mb=64)
                times.append(round(time.perf_counter() - t0, 3))
                failed += len(res.failed)
                res.kill_all()
        out["fork_s"][str(n)] = spread(times)
        out["fork_failed"][str(n)] = failed
    return out


# ------------------------------------------------------------------------------------------ report
def aggregate(n: int, runs: dict[str, list[dict]]) -> dict:
    """Per side: every run, and min/median/max of each metric; ratios per run against shoal / shoal-disk."""
    row: dict = {"n": n, "sides": {}, "ratios": {},
                 "loadavg_1m": spread([x for rs in runs.values() for r in rs for x in r["loadavg_1m"]])}
    for side, rs in runs.items():
        row["sides"][side] = {"runs": rs, "failed": sum(r["failed"] for r in rs),
                              **{m: spread([r[m] for r in rs]) for m in METRICS}}
    for peer in ("docker-bind", "docker-eager"):
        for mine in ("shoal", "shoal-disk"):
            if peer in runs and mine in runs:
                pairs = list(zip(runs[mine], runs[peer]))
                row["ratios"][f"{peer}/{mine}"] = {
                    "wall_speedup": spread([round(d["wall_s"] / max(s["wall_s"], 1e-9), 2) for s, d in pairs]),
                    "bytes_written_reduction": spread([round(1 - s["bytes_written"] / max(d["bytes_written"], 1), 3)
                                                       for s, d in pairs])}
    return row


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"shoal": "#2a9d8f", "shoal-disk": "#264653", "docker-bind": "#f4a261", "docker-eager": "#e76f51"}
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = (("wall_s", 1, "wall time to finish N tasks (s)"), ("bytes_written", 2**20, "bytes written to disk (MiB)"),
              ("peak_mem_bytes", 2**20, "peak host memory used above start (MiB)"))
    for side, color in colors.items():
        rows = [r for r in res["rows"] if side in r["sides"]]
        if not rows:
            continue
        ns = [r["n"] for r in rows]
        for ax, (m, scale, _) in zip(axes, panels):
            med = [r["sides"][side][m]["median"] / scale for r in rows]
            lo = [med[i] - rows[i]["sides"][side][m]["min"] / scale for i in range(len(rows))]
            hi = [rows[i]["sides"][side][m]["max"] / scale - med[i] for i in range(len(rows))]
            ax.errorbar(ns, med, yerr=[lo, hi], fmt="o-", color=color, label=side, capsize=3)
    for ax, (_, _, title) in zip(axes, panels):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("N tasks")
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"Burst, workload '{res['workload']}', {res['m']} workspaces, concurrency {res['concurrency']}, "
                 f"median and min-max of {res['runs']} runs ({res['date']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_table(res: dict) -> None:
    t = Table(title=f"Burst, workload '{res['workload']}': N tasks over {res['m']} workspaces, concurrency "
                    f"{res['concurrency']}, median [min-max] of {res['runs']} runs, {res['date']}")
    for col in ("N", "side", "wall s", "p50 ms", "p99 ms", "disk written MiB", "storage + MiB",
                "peak host mem MiB", "peak cgroup mem MiB", "failed"):
        t.add_column(col, justify="right")

    def f(m: dict, scale: float = 1, fmt: str = "{:.1f}") -> str:
        return f"{fmt.format(m['median'] / scale)} [{fmt.format(m['min'] / scale)}-{fmt.format(m['max'] / scale)}]"

    for row in res["rows"]:
        for side, s in row["sides"].items():
            t.add_row(str(row["n"]), side, f(s["wall_s"]), f(s["p50_ms"], fmt="{:.0f}"), f(s["p99_ms"], fmt="{:.0f}"),
                      f(s["bytes_written"], 2**20), f(s["storage_growth"], 2**20),
                      f(s["peak_mem_bytes"], 2**20, "{:.0f}"), f(s["peak_cg_mem_bytes"], 2**20, "{:.0f}"),
                      str(s["failed"]))
        for name, r in row["ratios"].items():
            t.add_row("", name, f(r["wall_speedup"], fmt="{:.2f}") + "x", "", "",
                      f(r["bytes_written_reduction"], 0.01, "{:.0f}") + "% less", "", "", "", "")
    console.print(t)


def main() -> None:
    import signal

    # a SIGTERM must still run the `finally` blocks that stop dockerd and remove task images
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", type=str, default="64,256", help="comma-separated N values")
    ap.add_argument("--runs", type=int, default=3, help="runs of every (side, N), interleaved")
    ap.add_argument("--m", type=int, default=8, help="number of workspaces")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--workspaces", choices=("python", "busybox"), default="python")
    ap.add_argument("--sequence", choices=("agent", "tests"), default="agent",
                    help="the workload: an agent-like tool-call sequence (default) or the project's quick tests")
    ap.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated subset of {','.join(SIDES)}")
    ap.add_argument("--no-docker", action="store_true", help="the Shoal sides only (= --sides shoal,shoal-disk)")
    ap.add_argument("--no-snapshot", action="store_true")
    ap.add_argument("--root", default=None, help="Shoal root (default /var/lib/shoal-bench, kept as a cache)")
    ap.add_argument("--out", default=str(RESULTS / "burst.json"))
    args = ap.parse_args()
    sides = [s for s in args.sides.split(",") if s and not (args.no_docker and s.startswith("docker"))]
    if unknown := set(sides) - set(SIDES):
        raise SystemExit(f"--sides: unknown {sorted(unknown)}; choose from {', '.join(SIDES)}")

    root = Path(args.root or "/var/lib/shoal-bench")
    host = Host.get(root)
    dev = disk_device()
    sweep = [int(x) for x in args.sweep.split(",")]
    base, workspaces = prepare_workspaces(host, args.m, args.workspaces, args.sequence)
    workload = args.sequence if args.workspaces == "python" else "busybox test.sh"
    res: dict = {"date": time.strftime("%Y-%m-%d"), "script": "bench/burst.py", "argv": sys.argv[1:],
                 "workload": workload, "m": args.m, "concurrency": args.concurrency, "runs": args.runs,
                 "sweep": sweep, "sides": sides, "workspaces": [w["image"] for w in workspaces],
                 "kind": args.workspaces, "device": dev, "cores": os.cpu_count(), "kernel": platform.release(),
                 "rows": []}

    dockerd = None
    ws_images: list[str] = []
    data_root = Path("/var/lib/docker")
    docker_sides = [s for s in sides if s.startswith("docker")]
    if docker_sides:
        dockerd = PrivateDockerd("shoal-burst-dockerd-", cgroup_parent=DOCKER_CGROUP, export=True)
        if dockerd.up():
            info = json.loads(subprocess.run(["docker", "info", "--format", "{{json .}}"], capture_output=True,
                                             text=True, check=False).stdout or "{}")
            data_root = Path(info.get("DockerRootDir", data_root))
            res["docker_version"] = info.get("ServerVersion")
            res["docker_storage_driver"] = info.get("Driver")
            console.print("importing workspace images into Docker (setup, not timed)")
            ws_images = docker_import_workspaces(host, base, workspaces)
        else:
            raise SystemExit(f"no Docker engine ({dockerd.error}): install docker.io (make docker-engine) "
                             "or pass --sides shoal,shoal-disk")
    if "shoal-disk" in sides:  # setup, not timed: the per-size ext4 template of the disk uppers
        from shoal.backends.container.backend import _upper_template

        _upper_template(host.settings.root, 256)
    docker_cg = cgroup_mem_dirs(DOCKER_CGROUP)
    runs: dict[int, dict[str, list[dict]]] = {n: {s: [] for s in sides} for n in sweep}
    try:
        for run in range(args.runs):
            for n in sweep:
                k = (run + sweep.index(n)) % len(sides)
                for side in sides[k:] + sides[:k]:  # rotated: no side always runs first or last
                    if side.startswith("shoal"):
                        r = run_shoal(host, base, workspaces, n, args.concurrency, dev,
                                      "disk" if side == "shoal-disk" else "tmpfs")
                    else:
                        r = run_docker(side.split("-")[1], ws_images, workspaces, n, args.concurrency, dev,
                                       data_root, docker_cg)
                    r["run"] = run
                    runs[n][side].append(r)
                    console.print(f"run {run + 1}/{args.runs} N={n} {side}: {r['wall_s']} s, "
                                  f"{r['bytes_written'] / 2**20:.1f} MiB written, "
                                  f"peak mem +{r['peak_mem_bytes'] / 2**20:.0f} MiB, failed {r['failed']}")
    finally:
        if dockerd:
            subprocess.run(["docker", "rmi", "-f", *ws_images], capture_output=True, check=False)
            dockerd.down()
    res["rows"] = [aggregate(n, runs[n]) for n in sweep]
    if not args.no_snapshot:
        res["snapshot_fork"] = bench_snapshot_fork(host, base, workspaces[0], args.runs)

    print_table(res)
    if "snapshot_fork" in res:
        sf = res["snapshot_fork"]
        console.print(f"snapshot latency (ms, min/median/max of {args.runs}): {sf['snapshot_ms']}")
        console.print(f"fork wall time (s): {sf['fork_s']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    plot(res, out.with_suffix(".png"))
    console.print(f"wrote {out} and {out.with_suffix('.png')}")
    if any(s["failed"] for r in res["rows"] for s in r["sides"].values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
