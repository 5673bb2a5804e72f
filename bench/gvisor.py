#!/usr/bin/env python3
"""gVisor vs container: what the stronger isolation costs, measured in-process through the Host.

Per backend, interleaved round by round (so both see the same machine load), on the same busybox
image, network off:
  cold_create_exec  host.create(CreateRequest(image, backend)) + host.exec(["true"]); kill not timed
  exec_true         host.exec(["true"]) in a running sandbox
  kill              host.kill() of a running sandbox
Each of `--runs` runs takes `--n` samples per row; a row reports the min/median/max of the per-run
p50s and the p50/p99 over all samples. The 1-minute load average is recorded before and after
(the machine is shared: read the numbers with it).

Writes bench/results/gvisor.json and gvisor.png. Needs root and runsc.
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
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from shoal.core.contract import CreateRequest, ExecRequest  # noqa: E402
from shoal.host import Host  # noqa: E402
from shoal.layers.busybox import make_busybox_tree  # noqa: E402

RESULTS = Path(__file__).parent / "results"
IMAGE = "bench:busybox"
BACKENDS = ("container", "gvisor")
ROWS = ("cold_create_exec", "exec_true", "kill")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def loadavg() -> float:
    return round(os.getloadavg()[0], 2)


def one_round(host: Host, backend: str, samples: dict[str, list[float]], execs: int) -> None:
    t0 = time.perf_counter()
    info = host.create(CreateRequest(image=IMAGE, backend=backend, memory_mb=256, disk_mb=64))
    r = host.exec(info.id, ExecRequest(argv=["true"]))
    samples["cold_create_exec"].append(time.perf_counter() - t0)
    assert r.exit_code == 0, r
    for _ in range(execs):
        t0 = time.perf_counter()
        host.exec(info.id, ExecRequest(argv=["true"]))
        samples["exec_true"].append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    host.kill(info.id)
    samples["kill"].append(time.perf_counter() - t0)


def measure(root: Path, n: int, runs: int) -> dict:
    host = Host.get(root)
    tree = make_busybox_tree(root / "busybox-tree")
    host.store.build_from_dir(tree, source="busybox", name="busybox")
    host.store.create_image(IMAGE, ["busybox"])
    for be in BACKENDS:  # warm: layer mounts, helper binaries, page cache
        for _ in range(3):
            one_round(host, be, {r: [] for r in ROWS}, 1)
    per_run: dict[str, dict[str, list[dict]]] = {be: {r: [] for r in ROWS} for be in BACKENDS}
    all_samples: dict[str, dict[str, list[float]]] = {be: {r: [] for r in ROWS} for be in BACKENDS}
    loads = []
    for run in range(runs):
        samples = {be: {r: [] for r in ROWS} for be in BACKENDS}
        before = loadavg()
        for i in range(n):
            order = BACKENDS if (i + run) % 2 == 0 else tuple(reversed(BACKENDS))
            for be in order:
                one_round(host, be, samples[be], execs=1)
        loads.append({"run": run, "loadavg_1m_before": before, "loadavg_1m_after": loadavg()})
        for be in BACKENDS:
            for r in ROWS:
                xs = samples[be][r]
                per_run[be][r].append({"p50_ms": round(statistics.median(xs) * 1000, 2), "n": len(xs)})
                all_samples[be][r] += xs
    out: dict = {}
    for be in BACKENDS:
        out[be] = {}
        for r in ROWS:
            p50s = [x["p50_ms"] for x in per_run[be][r]]
            ms = [x * 1000 for x in all_samples[be][r]]
            out[be][r] = {"p50_ms_min": min(p50s), "p50_ms_median": round(statistics.median(p50s), 2),
                          "p50_ms_max": max(p50s), "p50_ms_all": round(statistics.median(ms), 2),
                          "p99_ms_all": round(pct(ms, 0.99), 2), "n": len(ms), "runs": per_run[be][r]}
    return {"backends": out, "load": loads}


def version(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=False).stdout.splitlines()[0].strip()
    except (OSError, IndexError):
        return "?"


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.38
    for k, be in enumerate(BACKENDS):
        rows = res["backends"][be]
        med = [rows[r]["p50_ms_median"] for r in ROWS]
        lo = [rows[r]["p50_ms_median"] - rows[r]["p50_ms_min"] for r in ROWS]
        hi = [rows[r]["p50_ms_max"] - rows[r]["p50_ms_median"] for r in ROWS]
        xs = [i + (k - 0.5) * width for i in range(len(ROWS))]
        bars = ax.bar(xs, med, width, yerr=[lo, hi], capsize=3, label=be)
        ax.bar_label(bars, labels=[f"{m:.0f}" for m in med], padding=2, fontsize=8)
    ax.set_xticks(range(len(ROWS)), [r.replace("_", " ") for r in ROWS])
    ax.set_ylabel("p50 latency (ms)")
    ax.set_title(f"gvisor vs container: median of {res['runs']} run p50s (whiskers: min-max), n={res['n']} per run, "
                 f"load {res['load'][0]['loadavg_1m_before']}", fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=30, help="samples per row and run")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS / "gvisor.json")
    ap.add_argument("--plot-only", action="store_true", help="redraw the PNG from the JSON, measure nothing")
    args = ap.parse_args()
    if args.plot_only:
        plot(json.loads(args.out.read_text()), args.out.with_suffix(".png"))
        return
    if os.geteuid() != 0 or not shutil.which("runsc"):
        sys.exit("bench/gvisor.py needs root and runsc (apt-get install -y runsc)")
    root = Path(tempfile.mkdtemp(prefix="shoal-bgv-", dir="/tmp"))
    try:
        res = measure(root, args.n, args.runs)
    finally:
        host = Host.get(root)
        for info in host.list():
            try:
                host.kill(info.id)
            except Exception:
                pass
        host.store.gc()
        for m in (root / "mnt").iterdir() if (root / "mnt").exists() else []:
            subprocess.run(["umount", "-l", str(m)], capture_output=True, check=False)
        shutil.rmtree(root, ignore_errors=True)
    res.update(date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), n=args.n, runs=args.runs,
               command=" ".join(["python3", "bench/gvisor.py", *sys.argv[1:]]),
               machine={"cpus": os.cpu_count(), "kernel": platform.release(),
                        "runsc": version(["runsc", "--version"]),
                        "gvisor_platform": os.environ.get("SHOAL_GVISOR_PLATFORM", "ptrace")})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    plot(res, args.out.with_suffix(".png"))
    for be in BACKENDS:
        rows = res["backends"][be]
        print(be, {r: (rows[r]["p50_ms_min"], rows[r]["p50_ms_median"], rows[r]["p50_ms_max"]) for r in ROWS})
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
