#!/usr/bin/env python3
"""Scheduling benchmark: is one active sandbox's exec slowed by its neighbours?

One active busybox sandbox runs `true` (exec round trip through init, in this process) K times in
each phase; p50 and p99 per phase:

  empty        no other sandbox on this Shoal root;
  idle-1000    1,000 idle neighbours (init only, nothing running: a waiting agent's sandbox);
  hogs-normal  20 neighbours each spinning a CPU (cpu=1 each, on this 2-core host), normal class;
  hogs-idle    the same 20 hogs created with priority="idle" (cgroup cpu.idle=1).

Writes bench/results/sched.json; `--runs R` repeats the phases (>= 3 for the spread) and keeps every
run. Runs in its own root (default /var/tmp/shoal-sched) with a busybox image it builds. The
machine may be shared: the load average is kept per run.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from shoal import Host, Sandbox  # noqa: E402
from shoal.layers.busybox import make_busybox_tree  # noqa: E402

RESULTS = Path(__file__).parent / "results"
IMAGE = "busybox:sched"
HOG = "while :; do :; done"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def exec_latency(sb: Sandbox, k: int) -> dict:
    sb.commands.run(["true"])  # warm
    xs = []
    for _ in range(k):
        t = time.perf_counter()
        r = sb.commands.run(["true"])
        xs.append((time.perf_counter() - t) * 1000)
        assert r.exit_code == 0
    return {"k": k, "p50_ms": statistics.median(xs), "p99_ms": pct(xs, 0.99), "mean_ms": statistics.fmean(xs)}


def create_many(root: Path, n: int, **kw) -> list[Sandbox]:
    with ThreadPoolExecutor(4) as ex:
        return list(ex.map(lambda _: Sandbox.create(IMAGE, root=root, url="local", **kw), range(n)))


def kill_all(boxes: list[Sandbox]) -> None:
    with ThreadPoolExecutor(4) as ex:
        list(ex.map(lambda sb: sb.kill(), boxes))


def one_run(root: Path, k: int, idle_n: int, hogs: int) -> dict:
    out: dict = {"loadavg_start": os.getloadavg()[0], "phases": {}}
    with Sandbox.create(IMAGE, root=root, url="local") as active:
        out["phases"]["empty"] = exec_latency(active, k)
        t0 = time.monotonic()
        crowd = create_many(root, idle_n)
        out["idle_create_s"] = time.monotonic() - t0
        try:
            time.sleep(2)
            out["phases"][f"idle-{idle_n}"] = exec_latency(active, k)
        finally:
            kill_all(crowd)
        for prio in ("normal", "idle"):
            boxes = create_many(root, hogs, priority=prio)
            procs = [sb.commands.start(["sh", "-c", HOG]) for sb in boxes]
            try:
                time.sleep(1)
                out["phases"][f"hogs-{prio}"] = exec_latency(active, max(20, k // 4))
            finally:
                for p in procs:
                    p.kill()
                kill_all(boxes)
    out["loadavg_end"] = os.getloadavg()[0]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--k", type=int, default=200, help="execs per phase")
    ap.add_argument("--idle", type=int, default=1000, help="idle neighbours")
    ap.add_argument("--hogs", type=int, default=20)
    ap.add_argument("--root", type=Path, default=Path("/var/tmp/shoal-sched"))
    ap.add_argument("--out", type=Path, default=RESULTS / "sched.json")
    a = ap.parse_args()
    host = Host.get(a.root)
    try:
        host.store.image(IMAGE)
    except Exception:
        with tempfile.TemporaryDirectory() as tmp:
            host.store.build_from_dir(make_busybox_tree(Path(tmp)), source="busybox", name="busybox-sched")
        host.store.create_image(IMAGE, ["busybox-sched"])
    runs = []
    for i in range(a.runs):
        r = one_run(a.root, a.k, a.idle, a.hogs)
        runs.append(r)
        print(f"run {i + 1}: " + "  ".join(f"{k} {v['p50_ms']:.2f} ms" for k, v in r["phases"].items()), flush=True)
    phases = list(runs[0]["phases"])
    summary = {}
    for ph in phases:
        p50 = [r["phases"][ph]["p50_ms"] for r in runs]
        p99 = [r["phases"][ph]["p99_ms"] for r in runs]
        summary[ph] = {"p50_ms": {"min": min(p50), "median": statistics.median(p50), "max": max(p50)},
                       "p99_ms": {"min": min(p99), "median": statistics.median(p99), "max": max(p99)}}
    base = summary["empty"]["p50_ms"]["median"]
    for ph in phases:
        summary[ph]["p50_vs_empty"] = summary[ph]["p50_ms"]["median"] / base
    doc = {"runs": runs, "summary": summary, "idle_neighbours": a.idle, "hogs": a.hogs, "k": a.k,
           "kernel": platform.release(), "cpus": os.cpu_count(),
           "note": "shared 2-core machine: other work ran meanwhile (loadavg per run)"}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=1))
    for ph, s in summary.items():
        print(f"{ph:12s} p50 {s['p50_ms']['median']:8.2f} ms ({s['p50_ms']['min']:.2f}-{s['p50_ms']['max']:.2f})  "
              f"p99 {s['p99_ms']['median']:8.2f} ms  x{s['p50_vs_empty']:.2f} of empty")
    return 0


if __name__ == "__main__":
    sys.exit(main())
