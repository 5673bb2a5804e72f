#!/usr/bin/env python3
"""Create latency as the host fills: does creating a sandbox get slower with thousands live?

Fills one private Shoal root with N busybox container sandboxes (in-process Host, no daemon), each
left running a detached `sleep`, and records at every --step live sandboxes:

  * create p50/p99 of the creates made since the previous step (create = host.create, which
    returns once the sandbox's init serves requests);
  * the host's mount count (lines of /proc/self/mountinfo) and the number of sysfs superblocks;

then kills them all (sequentially through host.kill, as a client loop would) and records the
kill-all time. --runs repeats the whole fill (spread = min/median/max of the per-run p50s).

The limit that stopped the issue's fill at 4,096 is the container backend's own `max_sandboxes`
(4,096 by default), not a sysctl: --max-sandboxes raises it for the run.

Writes bench/results/fill_create.json (--out) and a PNG beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from shoal import Host  # noqa: E402
from shoal.core.contract import CreateRequest, ExecRequest  # noqa: E402
from shoal.layers.busybox import make_busybox_tree  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def mount_count() -> int:
    with open("/proc/self/mountinfo") as f:
        return sum(1 for _ in f)


def one_fill(host: Host, image: str, n: int, step: int, log) -> dict:
    ids: list[str] = []
    steps = []
    window: list[float] = []
    t_fill = time.perf_counter()
    t_empty = None
    while len(ids) < n:
        t0 = time.perf_counter()
        info = host.create(CreateRequest(image=image, backend="container"))
        window.append(time.perf_counter() - t0)
        ids.append(info.id)
        # the sandbox runs a sleep, detached (init reaps it): no client connection held per sandbox
        host.exec(info.id, ExecRequest(argv=["sh", "-c", "sleep 100000 </dev/null >/dev/null 2>&1 &"]))
        if len(ids) == 50 and t_empty is None:  # the empty-host reference: the first 50 creates
            t_empty = [x * 1000 for x in window]
        if len(ids) % step == 0 or len(ids) == n:
            v = [x * 1000 for x in window]
            row = {"live": len(ids), "creates": len(v), "p50_ms": round(statistics.median(v), 3),
                   "p99_ms": round(pct(v, 0.99), 3), "host_mounts": mount_count(),
                   "elapsed_s": round(time.perf_counter() - t_fill, 1)}
            steps.append(row)
            log(f"  live {row['live']:>6}  create p50 {row['p50_ms']:7.2f} ms  p99 {row['p99_ms']:8.2f} ms  "
                f"mounts {row['host_mounts']}  ({row['elapsed_s']} s)")
            window = []
    t0 = time.perf_counter()
    kill_lat = []
    for sid in ids:
        t1 = time.perf_counter()
        host.kill(sid)
        kill_lat.append((time.perf_counter() - t1) * 1000)
    kill_all = time.perf_counter() - t0
    log(f"  killed {len(ids)} in {kill_all:.1f} s; mounts after: {mount_count()}")
    empty = t_empty or [0.0]
    return {"steps": steps, "empty_p50_ms": round(statistics.median(empty), 3),
            "kill_all_s": round(kill_all, 2), "kill_p50_ms": round(statistics.median(kill_lat), 3),
            "kill_p99_ms": round(pct(kill_lat, 0.99), 3), "mounts_after_kill": mount_count()}


def summarize(runs: list[dict]) -> dict:
    rows = []
    for i, s in enumerate(runs[0]["steps"]):
        p50s = sorted(r["steps"][i]["p50_ms"] for r in runs if i < len(r["steps"]))
        p99s = sorted(r["steps"][i]["p99_ms"] for r in runs if i < len(r["steps"]))
        rows.append({"live": s["live"], "p50_ms": {"min": p50s[0], "median": statistics.median(p50s), "max": p50s[-1]},
                     "p99_ms": {"min": p99s[0], "median": statistics.median(p99s), "max": p99s[-1]},
                     "host_mounts": s["host_mounts"]})
    empties = sorted(r["empty_p50_ms"] for r in runs)
    kills = sorted(r["kill_all_s"] for r in runs)
    empty = statistics.median(empties)
    last = rows[-1]["p50_ms"]["median"]
    return {"rows": rows, "empty_p50_ms": {"min": empties[0], "median": empty, "max": empties[-1]},
            "kill_all_s": {"min": kills[0], "median": statistics.median(kills), "max": kills[-1]},
            "ratio_full_vs_empty_p50": round(last / empty, 2) if empty else None}


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, data, color in (("before", res.get("before"), "#e76f51"), ("after", res.get("after"), "#2a9d8f")):
        if not data:
            continue
        rows = data["summary"]["rows"]
        x = [r["live"] for r in rows]
        med = [r["p50_ms"]["median"] for r in rows]
        err = [[m - r["p50_ms"]["min"] for m, r in zip(med, rows)], [r["p50_ms"]["max"] - m for m, r in zip(med, rows)]]
        ax.errorbar(x, med, yerr=err, marker="o", color=color, capsize=3,
                    label=f"{label}: p50 (kill all {data['summary']['kill_all_s']['median']} s)")
        ax.plot(x, [r["p99_ms"]["median"] for r in rows], ls="--", color=color, alpha=0.6, label=f"{label}: p99")
    ax.set_xlabel("live sandboxes")
    ax.set_ylabel("create latency (ms)")
    ax.set_yscale("log")
    ax.set_title("container create latency as the host fills (busybox + sleep, 2 cores)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=4000, help="sandboxes to fill to")
    ap.add_argument("--step", type=int, default=500, help="record a row every this many live sandboxes")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--label", choices=["before", "after"], default="after",
                    help="which side of the JSON this run fills (the other side is kept)")
    ap.add_argument("--max-sandboxes", type=int, default=None,
                    help="raise the container backend's own limit (default 4,096) for this run")
    ap.add_argument("--commit", default="", help="the git commit measured (recorded in the JSON)")
    ap.add_argument("--out", default=str(RESULTS / "fill_create.json"))
    args = ap.parse_args()

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    out = Path(args.out)
    res = json.loads(out.read_text()) if out.exists() else {}
    runs = []
    for run in range(args.runs):
        root = Path(tempfile.mkdtemp(prefix="shoal-fc-", dir="/tmp"))
        host = Host.get(root)
        with tempfile.TemporaryDirectory() as d:
            host.store.build_from_dir(make_busybox_tree(Path(d) / "bb"), name="busybox")
        host.store.create_image("bench:busybox", ["busybox"])
        be = host.backend("container")
        if args.max_sandboxes:
            be.max_sandboxes = args.max_sandboxes  # type: ignore[attr-defined]
        print(f"run {run + 1}/{args.runs} ({args.label}), root {root}", flush=True)
        try:
            runs.append(one_fill(host, "bench:busybox", args.n, args.step, lambda s: print(s, flush=True)))
        finally:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
            from roots import wipe_root

            wipe_root(root)
    res[args.label] = {"date": time.strftime("%Y-%m-%d %H:%M"), "commit": args.commit, "cores": os.cpu_count(),
                       "kernel": os.uname().release, "n": args.n, "step": args.step,
                       "load_avg_before": round(os.getloadavg()[0], 2),
                       "runs": runs, "summary": summarize(runs)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    plot(res, out.with_suffix(".png"))
    s = res[args.label]["summary"]
    print(json.dumps({k: v for k, v in s.items() if k != "rows"}))


if __name__ == "__main__":
    main()
