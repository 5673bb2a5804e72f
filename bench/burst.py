#!/usr/bin/env python3
"""Burst benchmark: N tasks over m workspaces, Shoal (layers composed at creation) vs Docker eager.

Reproduces DSec's composable-layer experiment at this machine's scale. Each task is its workspace
plus a small per-task layer (a task file), and runs the same deterministic command: the
workspace project's own quick test subset.

  Shoal:        build the task layer (EROFS), create python:3.11 + workspace + task layer, run, kill.
  Docker eager: `docker build` one image per task (FROM the workspace image + COPY the task file),
                then `docker run --rm` it. The Docker engine (Debian docker.io) is started by this
                script if none is running and stopped afterwards.

For a sweep of N (N/8, N/4, N/2, N) both sides report wall time, p50/p99 task latency, bytes
written to the backing disk (/proc/diskstats, with `sync` inside the window), storage growth, and
peak host memory. Also: snapshot latency for 1/10/100 MB of changes and fork(10)/fork(100).

Writes bench/results/burst.json and bench/results/burst.png and prints a table with ratios.
`--sequence agent` (default) runs an agent-like tool-call sequence per task (read the task, list and
grep the repo, git status, import the package); `--sequence tests` runs the project's quick tests.
`--workspaces busybox` uses synthetic busybox workspaces (no Debian build; the CI smoke test).
"""
from __future__ import annotations

import argparse
import json
import os
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
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from shoal import Host, Sandbox  # noqa: E402
from shoal.layers.busybox import make_busybox_tree  # noqa: E402
from startup import Dockerd, pct  # noqa: E402

console = Console(width=150)
RESULTS = Path(__file__).parent / "results"


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


def du(path: Path) -> int:
    if not path.exists():
        return 0
    r = subprocess.run(["du", "-sb", "-x", str(path)], capture_output=True, text=True)
    try:
        return int(r.stdout.split()[0])
    except (IndexError, ValueError):
        return 0


class Window:
    """Measures one phase: wall time, disk bytes written (sync'ed), peak memory above the start."""

    def __init__(self, dev: str):
        self.dev = dev

    def __enter__(self):
        subprocess.run(["sync"])
        self.w0 = sectors_written(self.dev)
        self.m0 = used_memory()
        self.peak = self.m0
        self.stop = threading.Event()
        self.sampler = threading.Thread(target=self._sample, daemon=True)
        self.sampler.start()
        self.t0 = time.perf_counter()
        return self

    def _sample(self):
        while not self.stop.wait(0.05):
            self.peak = max(self.peak, used_memory())

    def __exit__(self, *exc):
        subprocess.run(["sync"])
        self.wall = time.perf_counter() - self.t0
        self.stop.set()
        self.sampler.join()
        self.written = sectors_written(self.dev) - self.w0
        self.peak_mem = self.peak - self.m0


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
    from shoal.envs.workspaces import CATALOG, agent_sequence, build_workspace, test_command

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
def run_shoal(host: Host, base: str, workspaces: list[dict], n: int, conc: int, dev: str) -> dict:
    lat: list[float] = []
    fails: list[str] = []
    scratch = Path(tempfile.mkdtemp(dir=host.settings.tmp_dir, prefix="burst-"))
    task_layers: list[str] = []
    lock = threading.Lock()
    store_before = du(host.settings.root)

    def one(i: int):
        ws = workspaces[i % len(workspaces)]
        t0 = time.perf_counter()
        d = scratch / str(i)
        (d / "work" / "task").mkdir(parents=True)
        (d / "work" / "task" / "task.json").write_text(task_content(i))
        layer = host.store.build_from_dir(d, source=f"burst task {i}")
        with Sandbox.create(base, layers=[ws["image"], layer.digest], root=host.settings.root,
                            memory_mb=1024, disk_mb=256) as sb:
            r = sb.commands.run(ws["cmd"], timeout=300)
        dt = time.perf_counter() - t0
        with lock:
            lat.append(dt)
            task_layers.append(layer.digest)
            if r.exit_code != 0:
                fails.append(f"task {i}: exit {r.exit_code}: {(r.stdout + r.stderr)[-300:]}")

    with Window(dev) as w, progress() as p, ThreadPoolExecutor(conc) as ex:
        t = p.add_task(f"shoal N={n}", total=n)
        for f in [ex.submit(one, i) for i in range(n)]:
            f.result()
            p.advance(t)
    growth = du(host.settings.root) - store_before
    for d in task_layers:  # not timed: drop the per-task layers again
        try:
            host.store.remove_layer(d)
        except Exception:
            pass
    shutil.rmtree(scratch, ignore_errors=True)
    return _metrics(n, w, lat, fails, growth)


# ------------------------------------------------------------------------------------------ docker
def docker_import_workspaces(host: Host, base: str, workspaces: list[dict]) -> list[str]:
    """One Docker image per workspace: the merged rootfs of base + workspace (setup, not timed)."""
    names = []
    for k, ws in enumerate(workspaces):
        name = f"shoal-burst-ws{k}:1"
        names.append(name)
        if subprocess.run(["docker", "image", "inspect", name], capture_output=True).returncode == 0:
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
            subprocess.run(["umount", str(merged)], capture_output=True)
            merged.rmdir()
    return names


def run_docker(ws_images: list[str], workspaces: list[dict], n: int, conc: int, dev: str, data_root: Path) -> dict:
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
        (ctx / "Dockerfile").write_text(f"FROM {ws_images[k]}\nCOPY task.json /work/task/task.json\n")
        tag = f"shoal-burst-task{i}:1"
        b = subprocess.run(["docker", "build", "-q", "-t", tag, str(ctx)], capture_output=True, text=True,
                           env={**os.environ, "DOCKER_BUILDKIT": "0"})
        if b.returncode != 0:
            with lock:
                fails.append(f"task {i}: docker build: {b.stderr[-300:]}")
            return
        env_args = [a for k_, v in ws["env"].items() for a in ("-e", f"{k_}={v}")]
        r = subprocess.run(["docker", "run", "--rm", "--network=none", "-w", ws["workdir"], *env_args, tag,
                            "/bin/sh", "-c", ws["cmd"]], capture_output=True, text=True)
        dt = time.perf_counter() - t0
        with lock:
            lat.append(dt)
            if r.returncode != 0:
                fails.append(f"task {i}: exit {r.returncode}: {(r.stdout + r.stderr)[-300:]}")

    with Window(dev) as w, progress() as p, ThreadPoolExecutor(conc) as ex:
        t = p.add_task(f"docker N={n}", total=n)
        for f in [ex.submit(one, i) for i in range(n)]:
            f.result()
            p.advance(t)
    growth = du(data_root) - store_before
    tags = [f"shoal-burst-task{i}:1" for i in range(n)]
    for chunk in range(0, len(tags), 100):  # not timed
        subprocess.run(["docker", "rmi", "-f", *tags[chunk:chunk + 100]], capture_output=True)
    shutil.rmtree(ctx_root, ignore_errors=True)
    return _metrics(n, w, lat, fails, growth)


def _metrics(n: int, w: Window, lat: list[float], fails: list[str], growth: int) -> dict:
    ms = sorted(x * 1000 for x in lat) or [0.0]
    return {"n": n, "wall_s": round(w.wall, 2), "p50_ms": round(statistics.median(ms), 1),
            "p99_ms": round(pct(ms, 0.99), 1), "bytes_written": w.written, "storage_growth": growth,
            "peak_mem_bytes": w.peak_mem, "failed": len(fails), "fail_examples": fails[:3]}


# ------------------------------------------------------------------------------------------ snapshot / fork
def bench_snapshot_fork(host: Host, base: str, ws: dict) -> dict:
    out: dict = {"snapshot_ms": {}, "fork_s": {}}
    for mb in (1, 10, 100):
        times = []
        for _ in range(3):
            with Sandbox.create(base, layers=[ws["image"]], root=host.settings.root, memory_mb=1024,
                                disk_mb=512) as sb:
                sb.commands.run(f"head -c {mb * 1024 * 1024} /dev/urandom > /work/blob.bin", timeout=120)
                t0 = time.perf_counter()
                snap = sb.snapshot()
                times.append(time.perf_counter() - t0)
                host.store.remove_image(snap.image)
        out["snapshot_ms"][f"{mb}MB"] = round(statistics.median(times) * 1000, 1)
    for n in (10, 100):
        with Sandbox.create(base, layers=[ws["image"]], root=host.settings.root, memory_mb=256) as sb:
            sb.commands.run("echo state > /work/state.txt")
            t0 = time.perf_counter()
            res = sb.fork(n, memory_mb=128, disk_mb=64)
            out["fork_s"][str(n)] = round(time.perf_counter() - t0, 3)
            out[f"fork_{n}_failed"] = len(res.failed)
            res.kill_all()
    return out


# ------------------------------------------------------------------------------------------ report
def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for side, color in (("shoal", "#2a9d8f"), ("docker", "#e76f51")):
        rows = [r for r in res["sweep"] if r.get(side)]
        if not rows:
            continue
        ns = [r["n"] for r in rows]
        axes[0].plot(ns, [r[side]["wall_s"] for r in rows], "o-", color=color, label=side)
        axes[1].plot(ns, [r[side]["bytes_written"] / 2**20 for r in rows], "o-", color=color, label=side)
        axes[2].plot(ns, [r[side]["storage_growth"] / 2**20 for r in rows], "o-", color=color, label=side)
    for ax, title in zip(axes, ("wall time to finish N tasks (s)", "bytes written to disk (MiB)",
                                "storage growth after the burst (MiB)")):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("N tasks")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(f"Burst over {res['m']} workspaces, concurrency {res['concurrency']} ({res['date']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    import signal

    # a SIGTERM must still run the `finally` blocks that stop dockerd and remove task images
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=512, help="largest N of the sweep (N/8, N/4, N/2, N)")
    ap.add_argument("--m", type=int, default=8, help="number of workspaces")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--workspaces", choices=("python", "busybox"), default="python")
    ap.add_argument("--sequence", choices=("agent", "tests"), default="agent",
                    help="per task: an agent-like tool-call sequence (default) or the project's quick tests")
    ap.add_argument("--no-docker", action="store_true")
    ap.add_argument("--no-snapshot", action="store_true")
    ap.add_argument("--sweep", type=str, default=None, help="comma-separated N values (overrides --n)")
    ap.add_argument("--root", default=None, help="Shoal root (default /var/lib/shoal-bench, kept as a cache)")
    ap.add_argument("--out", default=str(RESULTS / "burst.json"))
    args = ap.parse_args()

    root = Path(args.root or "/var/lib/shoal-bench")
    host = Host.get(root)
    dev = disk_device()
    sweep = [int(x) for x in args.sweep.split(",")] if args.sweep else \
        sorted({max(1, args.n // 8), max(1, args.n // 4), max(1, args.n // 2), args.n})
    base, workspaces = prepare_workspaces(host, args.m, args.workspaces, args.sequence)
    res: dict = {"date": time.strftime("%Y-%m-%d"), "m": args.m, "concurrency": args.concurrency,
                 "sequence": args.sequence if args.workspaces == "python" else "busybox test.sh",
                 "workspaces": [w["image"] for w in workspaces], "kind": args.workspaces, "device": dev,
                 "sweep": []}

    dockerd = None
    ws_images: list[str] = []
    data_root = Path("/var/lib/docker")
    if not args.no_docker:
        dockerd = Dockerd()
        if dockerd.up():
            info = json.loads(subprocess.run(["docker", "info", "--format", "{{json .}}"], capture_output=True,
                                             text=True).stdout or "{}")
            data_root = Path(info.get("DockerRootDir", data_root))
            console.print("importing workspace images into Docker (setup, not timed)")
            ws_images = docker_import_workspaces(host, base, workspaces)
        else:
            dockerd = None
    try:
        for n in sweep:
            row: dict = {"n": n, "shoal": run_shoal(host, base, workspaces, n, args.concurrency, dev)}
            if dockerd:
                row["docker"] = run_docker(ws_images, workspaces, n, args.concurrency, dev, data_root)
            res["sweep"].append(row)
            console.print(f"N={n}: shoal {row['shoal']['wall_s']} s" +
                          (f", docker {row['docker']['wall_s']} s" if dockerd else ""))
    finally:
        if dockerd:
            subprocess.run(["docker", "rmi", "-f", *ws_images], capture_output=True)
            dockerd.down()
    if not args.no_snapshot:
        res["snapshot_fork"] = bench_snapshot_fork(host, base, workspaces[0])

    t = Table(title=f"Burst: N tasks over {args.m} {args.workspaces} workspaces ({res['sequence']}), "
                    f"concurrency {args.concurrency}, {res['date']}")
    for col in ("N", "side", "wall s", "p50 ms", "p99 ms", "disk written", "storage +", "peak mem +", "failed"):
        t.add_column(col, justify="right")
    for row in res["sweep"]:
        for side in ("shoal", "docker"):
            r = row.get(side)
            if not r:
                continue
            t.add_row(str(row["n"]), side, f"{r['wall_s']:.1f}", f"{r['p50_ms']:.0f}", f"{r['p99_ms']:.0f}",
                      f"{r['bytes_written'] / 2**20:.1f} MiB", f"{r['storage_growth'] / 2**20:.1f} MiB",
                      f"{r['peak_mem_bytes'] / 2**20:.0f} MiB", str(r["failed"]))
        if row.get("docker"):
            s, d = row["shoal"], row["docker"]
            row["ratios"] = {"wall_speedup": round(d["wall_s"] / max(s["wall_s"], 1e-9), 2),
                             "bytes_written_reduction": round(1 - s["bytes_written"] / max(d["bytes_written"], 1), 3)}
            t.add_row("", "ratio", f"{row['ratios']['wall_speedup']:.1f}x faster", "", "",
                      f"-{row['ratios']['bytes_written_reduction'] * 100:.0f}%", "", "", "")
    console.print(t)
    if "snapshot_fork" in res:
        sf = res["snapshot_fork"]
        console.print(f"snapshot latency (median of 3): {sf['snapshot_ms']}  (goal: 10MB <= 100 ms)")
        console.print(f"fork wall time: fork(10) {sf['fork_s']['10']} s, fork(100) {sf['fork_s']['100']} s "
                      f"(goal: fork(100) <= 2 s)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    plot(res, out.with_suffix(".png"))
    console.print(f"wrote {out} and {out.with_suffix('.png')}")
    if any(r[s]["failed"] for r in res["sweep"] for s in ("shoal", "docker") if r.get(s)):
        sys.exit(1)


if __name__ == "__main__":
    main()
