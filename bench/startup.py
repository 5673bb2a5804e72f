#!/usr/bin/env python3
"""Startup benchmark: Shoal vs `docker run --rm` (and podman+runc when present) on this machine.

Measures, with medians and p99 (these machines are shared and noisy):
  * cold create -> first exec (`true`) latency
  * warm-pool acquire -> exec latency
  * sustained creations per second for a batch (sequential and with 2 threads)
  * exec overhead (fork+exec of `true` in a live sandbox) and persistent-session command overhead
  * the same `true` through `docker run --rm` (Debian docker.io; the script starts dockerd if needed
    and stops what it started), bare `runc run` of an OCI bundle, and `podman --runtime runc run --rm`
    if podman is installed.

Writes bench/results/startup.json and bench/results/startup.png, prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.progress import track
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from shoal import Host, Sandbox, WarmPool  # noqa: E402
from shoal.layers.busybox import make_busybox_tree  # noqa: E402

console = Console()
RESULTS = Path(__file__).parent / "results"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def summary(xs_s: list[float]) -> dict:
    ms = [x * 1000 for x in xs_s]
    return {"n": len(ms), "p50_ms": round(statistics.median(ms), 3), "p99_ms": round(pct(ms, 0.99), 3),
            "mean_ms": round(statistics.fmean(ms), 3)}


# ------------------------------------------------------------------------------------------ shoal
def bench_shoal(root: Path, n: int, batch: int) -> dict:
    host = Host.get(root)
    with tempfile.TemporaryDirectory() as d:
        tree = make_busybox_tree(Path(d))
        host.store.build_from_dir(tree, source="busybox", name="busybox")
    host.store.create_image("bench:busybox", ["busybox"])
    image = "bench:busybox"
    out: dict = {}

    for _ in range(5):  # warm caches (helper binary, layer mount, page cache)
        with Sandbox.create(image, root=root) as sb:
            sb.commands.run(["true"])

    cold = []
    for _ in track(range(n), description="shoal cold create->exec", console=console):
        t0 = time.perf_counter()
        sb = Sandbox.create(image, root=root)
        sb.commands.run(["true"])
        cold.append(time.perf_counter() - t0)
        sb.kill()
    out["cold_create_exec"] = summary(cold)

    execs, sess = [], []
    with Sandbox.create(image, root=root) as sb:
        for _ in range(n):
            t0 = time.perf_counter()
            sb.commands.run(["true"])
            execs.append(time.perf_counter() - t0)
        with sb.sessions.create() as s:
            s.run("cd /tmp")
            for _ in range(n * 2):
                t0 = time.perf_counter()
                s.run(":")
                sess.append(time.perf_counter() - t0)
    out["exec_true"] = summary(execs)
    out["session_cmd"] = summary(sess)

    warm = []
    with WarmPool(image, size=8, root=root) as pool:
        pool.wait_ready(60)
        for _ in track(range(n), description="shoal warm acquire->exec", console=console):
            pool.wait_ready(60)  # measure acquisition, not the refill racing us on 2 cores
            t0 = time.perf_counter()
            sb = pool.acquire()
            sb.commands.run(["true"])
            warm.append(time.perf_counter() - t0)
            sb.kill()
    out["warm_acquire_exec"] = summary(warm)

    for threads in (1, 2):
        made: list[Sandbox] = []
        lock = threading.Lock()

        def worker(k: int):
            for _ in range(k):
                sb = Sandbox.create(image, root=root)
                with lock:
                    made.append(sb)

        per = batch // threads
        t0 = time.perf_counter()
        ts = [threading.Thread(target=worker, args=(per,)) for _ in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        elapsed = time.perf_counter() - t0
        out[f"creations_per_s_{threads}t"] = round(len(made) / elapsed, 1)
        for sb in made:
            sb.kill()
    return out


# ------------------------------------------------------------------------------------------ docker
class Dockerd:
    """Starts Debian's dockerd if no engine answers; stops only what it started."""

    def __init__(self):
        self.proc = None
        self.tmp = None

    def up(self) -> bool:
        if not shutil.which("docker"):
            return False
        if subprocess.run(["docker", "info"], capture_output=True).returncode == 0:
            return True
        if not shutil.which("dockerd"):
            return False
        self.tmp = tempfile.mkdtemp(prefix="shoal-dockerd-")
        log = open(os.path.join(self.tmp, "dockerd.log"), "w")
        self.proc = subprocess.Popen(["dockerd", "--iptables=false", "--bridge=none", "--data-root",
                                      os.path.join(self.tmp, "data"), "--exec-root", os.path.join(self.tmp, "exec"),
                                      "--pidfile", os.path.join(self.tmp, "docker.pid")],
                                     stdout=log, stderr=log)
        for _ in range(300):
            if subprocess.run(["docker", "info"], capture_output=True).returncode == 0:
                return True
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        console.print(f"[yellow]dockerd did not start; see {self.tmp}/dockerd.log[/yellow]")
        return False

    def down(self) -> None:
        if self.proc:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            subprocess.run(["umount", "-R", os.path.join(self.tmp, "data")], capture_output=True)
            shutil.rmtree(self.tmp, ignore_errors=True)


def rootfs_tar() -> str:
    d = tempfile.mkdtemp()
    make_busybox_tree(Path(d) / "root")
    tar = os.path.join(d, "rootfs.tar")
    with tarfile.open(tar, "w") as tf:
        tf.add(os.path.join(d, "root"), arcname=".")
    return tar


def bench_cli(name: str, argv_prefix: list[str], image: str, n: int) -> dict:
    times = []
    for _ in range(3):
        subprocess.run(argv_prefix + [image, "true"], capture_output=True)
    for _ in track(range(n), description=f"{name} run --rm", console=console):
        t0 = time.perf_counter()
        r = subprocess.run(argv_prefix + [image, "true"], capture_output=True, text=True)
        times.append(time.perf_counter() - t0)
        if r.returncode != 0:
            return {"error": r.stderr.strip()[-300:]}
    return summary(times)


def bench_docker(n: int) -> dict | None:
    d = Dockerd()
    try:
        if not d.up():
            return None
        tar = rootfs_tar()
        subprocess.run(["docker", "import", tar, "shoal-bench-busybox:latest"], check=True, capture_output=True)
        res = bench_cli("docker", ["docker", "run", "--rm", "--network=none"], "shoal-bench-busybox:latest", n)
        res["version"] = subprocess.run(["docker", "version", "--format", "{{.Server.Version}}"],
                                        capture_output=True, text=True).stdout.strip()
        return res
    finally:
        d.down()


def bench_runc(n: int) -> dict | None:
    """`runc run` of an OCI bundle with the same busybox rootfs: the OCI runtime alone, no engine."""
    if not shutil.which("runc"):
        return None
    bundle = Path(tempfile.mkdtemp(prefix="shoal-runc-"))
    try:
        make_busybox_tree(bundle / "rootfs")
        subprocess.run(["runc", "spec"], cwd=bundle, check=True, capture_output=True)
        spec = json.loads((bundle / "config.json").read_text())
        spec["process"]["args"] = ["true"]
        spec["process"]["terminal"] = False
        (bundle / "config.json").write_text(json.dumps(spec))
        times = []
        for i in track(range(n + 3), description="runc run", console=console):
            t0 = time.perf_counter()
            r = subprocess.run(["runc", "run", "--bundle", str(bundle), f"shoal-bench-{os.getpid()}-{i}"],
                               capture_output=True, text=True)
            if i >= 3:
                times.append(time.perf_counter() - t0)
            if r.returncode != 0:
                return {"error": r.stderr.strip()[-300:]}
        res = summary(times)
        res["version"] = subprocess.run(["runc", "--version"], capture_output=True, text=True).stdout.split("\n")[0]
        return res
    finally:
        shutil.rmtree(bundle, ignore_errors=True)


def bench_podman(n: int) -> dict | None:
    if not shutil.which("podman"):
        return None
    tar = rootfs_tar()
    base = ["podman", "--runtime", "runc", "--cgroup-manager=cgroupfs"]
    if subprocess.run(base + ["import", tar, "shoal-bench-busybox"], capture_output=True).returncode != 0:
        return None
    return bench_cli("podman", base + ["run", "--rm", "--network=none", "--ulimit", "nofile=1024:1024",
                                       "--ulimit", "nproc=1024:1024"], "shoal-bench-busybox", n)


# ------------------------------------------------------------------------------------------ report
def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, vals = [], []
    for label, key in (("Shoal warm pool\nacquire+exec", ("shoal", "warm_acquire_exec")),
                       ("Shoal cold\ncreate+exec", ("shoal", "cold_create_exec")),
                       ("runc run\n(runtime only)", ("runc", None)),
                       ("podman+runc\nrun --rm", ("podman", None)), ("docker\nrun --rm", ("docker", None))):
        r = res.get(key[0])
        r = r.get(key[1]) if (r and key[1]) else r
        if r and "p50_ms" in r:
            labels.append(label)
            vals.append(r["p50_ms"])
    fig, ax = plt.subplots(figsize=(7, 3.6))
    colors = ["#2a9d8f" if l.startswith("Shoal") else "#e76f51" for l in labels]
    bars = ax.barh(labels, vals, color=colors)
    ax.set_xscale("log")
    ax.set_xlim(min(vals) / 2, max(vals) * 4)  # room for the value labels
    ax.set_xlabel("p50 latency to run `true` (ms, log scale)")
    ax.bar_label(bars, labels=[f"{v:.1f} ms" for v in vals], padding=3)
    ax.set_title(f"Sandbox start latency on this machine ({res['date']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=200, help="iterations per Shoal latency measurement")
    ap.add_argument("--batch", type=int, default=200, help="sandboxes per creations/s batch")
    ap.add_argument("--docker-n", type=int, default=30, help="iterations of docker/podman run")
    ap.add_argument("--no-docker", action="store_true")
    ap.add_argument("--root", default=None, help="Shoal root for the benchmark (default: a temp dir)")
    ap.add_argument("--out", default=str(RESULTS / "startup.json"), help="JSON path (the PNG goes beside it)")
    args = ap.parse_args()

    root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="shoal-bench-", dir="/tmp"))
    res: dict = {"date": time.strftime("%Y-%m-%d"), "host": {"cores": os.cpu_count(), "kernel": os.uname().release}}
    res["shoal"] = bench_shoal(root, args.n, args.batch)
    Host.get(root).gc()
    if not args.no_docker:
        res["docker"] = bench_docker(args.docker_n)
        res["podman"] = bench_podman(args.docker_n)
        res["runc"] = bench_runc(args.docker_n)

    s = res["shoal"]
    t = Table(title=f"Startup, this machine, {res['date']} ({os.cpu_count()} cores)")
    t.add_column("measurement")
    t.add_column("p50 ms", justify="right")
    t.add_column("p99 ms", justify="right")
    t.add_column("goal")
    t.add_row("Shoal cold create -> first exec", f"{s['cold_create_exec']['p50_ms']:.2f}",
              f"{s['cold_create_exec']['p99_ms']:.2f}", "p50 <= 25 ms")
    t.add_row("Shoal warm-pool acquire -> exec", f"{s['warm_acquire_exec']['p50_ms']:.2f}",
              f"{s['warm_acquire_exec']['p99_ms']:.2f}", "p50 <= 5 ms")
    t.add_row("Shoal exec `true` in live sandbox", f"{s['exec_true']['p50_ms']:.2f}", f"{s['exec_true']['p99_ms']:.2f}", "")
    t.add_row("Shoal session command overhead", f"{s['session_cmd']['p50_ms']:.3f}", f"{s['session_cmd']['p99_ms']:.3f}",
              "p50 <= 1 ms")
    for peer in ("docker", "podman", "runc"):
        r = res.get(peer)
        if r and "p50_ms" in r:
            ratio = r["p50_ms"] / s["cold_create_exec"]["p50_ms"]
            res[f"{peer}_over_shoal_cold_p50"] = round(ratio, 1)
            what = "runc run (OCI runtime only)" if peer == "runc" else f"{peer} run --rm"
            t.add_row(f"{what} `true`", f"{r['p50_ms']:.1f}", f"{r['p99_ms']:.1f}",
                      f"Shoal cold is {ratio:.1f}x faster (goal >= 10x)" if peer == "docker" else f"{ratio:.1f}x")
        elif r and "error" in r:
            t.add_row(f"{peer} run --rm", "error", "", r["error"][:60])
        else:
            t.add_row(f"{peer} run --rm", "n/a", "", "not available on this host")
    t.add_row("Shoal creations/s, 1 thread", f"{s['creations_per_s_1t']:.0f}/s", "", ">= 100/s")
    t.add_row("Shoal creations/s, 2 threads", f"{s['creations_per_s_2t']:.0f}/s", "", ">= 100/s")
    console.print(t)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    plot(res, out.with_suffix(".png"))
    console.print(f"wrote {out} and {out.with_suffix('.png')}")
    if not args.root:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
