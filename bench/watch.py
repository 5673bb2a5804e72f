#!/usr/bin/env python3
"""How soon a file change reaches a `watch_dir` reader: in-process (inotify, container backend) and
through shoald's NDJSON watch stream.

Per iteration: `files.write("/w/fN")` from the host (the files API), then `read()` on the watch until
the `create` of fN arrives; the time from just before the write to that event is the latency (it
includes the write itself, timed alone as `write_only` and `write_only_shoald`). The paths are
interleaved. --runs runs (default 3) of --n iterations; reported: p50 and p99 per path per run and
their min/median/max over the runs. Writes bench/results/watch.json (+ .png). Needs root.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from api import start_daemon  # noqa: E402
from roots import wipe_root  # noqa: E402

from shoal import Sandbox  # noqa: E402
from shoal.host import Host  # noqa: E402
from shoal.layers.busybox import make_busybox_tree  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _one(sb: Sandbox, h, i: int) -> float:
    t0 = time.perf_counter()
    sb.files.write(f"/w/f{i}", "x")
    while True:
        for e in h.read(2.0):
            if e.type == "create" and e.name == f"f{i}":
                return time.perf_counter() - t0
        if time.perf_counter() - t0 > 10:
            raise SystemExit(f"no event for f{i} within 10 s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--out", type=Path, default=RESULTS / "watch.json")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="shoal-watch-", dir="/tmp"))
    host = Host.get(root)
    with tempfile.TemporaryDirectory() as d:
        host.store.build_from_dir(make_busybox_tree(Path(d) / "bb"), name="busybox")
    host.store.create_image("bench:busybox", ["busybox"])
    proc, url = start_daemon(root)
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "cores": os.cpu_count(), "n": args.n, "runs": []}
    made: list[Sandbox] = []
    try:
        local = Sandbox.create("bench:busybox", root=root, url="local")
        remote = Sandbox.create("bench:busybox", url=url)
        made += [local, remote]
        for sb in made:
            sb.files.mkdir("/w")
        for run in range(args.runs):
            lat: dict[str, list[float]] = {"in_process": [], "shoald": [], "write_only": [], "write_only_shoald": []}
            res["runs"].append({"load_1m": round(os.getloadavg()[0], 2)})
            with local.files.watch("/w") as hl, remote.files.watch("/w") as hr:
                for i in range(args.n):
                    k = run * args.n + i
                    lat["in_process"].append(_one(local, hl, k))
                    lat["shoald"].append(_one(remote, hr, k))
                    for name, sb in (("write_only", local), ("write_only_shoald", remote)):
                        t0 = time.perf_counter()
                        sb.files.write(f"/w/g{k}", "x")
                        lat[name].append(time.perf_counter() - t0)
            for name, xs in lat.items():
                res["runs"][-1][name] = {"p50_ms": round(statistics.median(xs) * 1e3, 3),
                                         "p99_ms": round(_pct(xs, 0.99) * 1e3, 3)}
            print(run, res["runs"][-1])
    finally:
        for sb in made:
            sb.kill()
        proc.terminate()
        proc.wait(20)
        wipe_root(root)  # the layer mounts too (a plain rmtree leaves them)
    res["summary"] = {name: {stat: {"min": min(r[name][stat] for r in res["runs"]),
                                    "median": statistics.median(r[name][stat] for r in res["runs"]),
                                    "max": max(r[name][stat] for r in res["runs"])}
                             for stat in ("p50_ms", "p99_ms")}
                      for name in ("in_process", "shoald", "write_only", "write_only_shoald")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    _plot(res, args.out.with_suffix(".png"))
    print(json.dumps(res["summary"], indent=2))


def _plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["in_process", "shoald", "write_only", "write_only_shoald"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for j, name in enumerate(names):
        ys = [r[name]["p50_ms"] for r in res["runs"]]
        ax.scatter([j] * len(ys), ys, label=name)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("p50 per run, ms")
    ax.set_title("files.write -> watch event (3 runs)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
