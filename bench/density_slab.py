#!/usr/bin/env python3
"""Where an idle shell sandbox's host memory goes: kernel slab caches, per sandbox.

The density fill (bench/density.py) saw about 1.3 MiB of host memory per idle shell sandbox against
0.39 MiB in Shoal's own accounting (the sandbox's cgroup, kernel memory included, plus its supervisor).
The gap is kernel memory that no sandbox cgroup is charged for. This script creates --n busybox
sandboxes, each with an interactive `sh` session open (as the density fill's shell profile), and
diffs /proc/slabinfo and /proc/meminfo before and after: bytes per sandbox for each slab cache
(active objects x object size), largest first. --runs repeats it (spread = min/median/max).

--memory-cgroup pooled creates them with memory_cgroup="pooled" (pools of --pool-size sharing one memory
cgroup, docs/density.md "Pooled memory cgroups"); each build records which it used and the memory
cgroups it added, so own and pooled rows sit side by side in one file (--append).

Writes bench/results/density_slab.json (--out).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from shoal import Host, Sandbox  # noqa: E402
from shoal.core.contract import CreateRequest  # noqa: E402
from shoal.layers.busybox import make_busybox_tree  # noqa: E402

RESULTS = Path(__file__).parent / "results"
MiB = 1 << 20


def slabinfo() -> dict[str, tuple[int, int, int]]:
    """cache -> (active objects, object size, pages held): /proc/slabinfo (root only)."""
    out = {}
    for line in Path("/proc/slabinfo").read_text().splitlines()[2:]:
        f = line.split()
        # name active_objs num_objs objsize objperslab pagesperslab : tunables ... : slabdata active num ...
        num_slabs = int(f[f.index("slabdata") + 2])
        out[f[0]] = (int(f[1]), int(f[3]), num_slabs * int(f[5]))
    return out


def meminfo() -> dict[str, int]:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        k, v = line.split(":", 1)
        out[k] = int(v.split()[0]) * 1024
    return out


def slab_delta(before: dict, after: dict, n: int) -> list[dict]:
    rows = []
    for name in set(before) | set(after):
        a0, sz0, p0 = before.get(name, (0, 0, 0))
        a1, sz1, p1 = after.get(name, (0, 0, 0))
        sz = sz1 or sz0
        rows.append({"cache": name, "objs_per_sb": round((a1 - a0) / n, 2),
                     "bytes_per_sb": round((a1 - a0) * sz / n), "pages_bytes_per_sb": round((p1 - p0) * 4096 / n)})
    return sorted(rows, key=lambda r: -r["bytes_per_sb"])


def memcg_count() -> int:
    """Memory cgroups on the host (v1: the memory hierarchy's; v2: every cgroup with memory on)."""
    for line in Path("/proc/cgroups").read_text().splitlines():
        f = line.split()
        if f and f[0] == "memory":
            return int(f[2])
    return -1


def one_run(host: Host, image: str, n: int, log, memory_cgroup: str = "own") -> dict:
    time.sleep(1)
    s0, m0, c0 = slabinfo(), meminfo(), memcg_count()
    live = []
    t0 = time.perf_counter()
    for _ in range(n):
        info = host.create(CreateRequest(image=image, backend="container", memory_cgroup=memory_cgroup))
        sb = Sandbox(host, info)
        ses = sb.sessions.create(shell="/bin/sh")
        ses.run("echo ready")
        live.append((sb, ses))
    fill_s = time.perf_counter() - t0
    time.sleep(2)
    s1, m1, c1 = slabinfo(), meminfo(), memcg_count()
    rows = slab_delta(s0, s1, n)
    mem = {k: round((m1[k] - m0[k]) / n) for k in ("Slab", "SReclaimable", "SUnreclaim", "KernelStack",
                                                   "PageTables", "AnonPages", "Shmem", "Percpu")}
    mem["used"] = round(((m1["MemTotal"] - m1["MemAvailable"]) - (m0["MemTotal"] - m0["MemAvailable"])) / n)
    t0 = time.perf_counter()
    for sb, ses in live:
        try:
            ses.close()
        except Exception:
            pass
        sb.kill()
    kill_s = time.perf_counter() - t0
    top = rows[:25]
    log(f"  n={n} ({memory_cgroup}, {c1 - c0} memory cgroups added)")
    log(f"  slab {mem['Slab'] / MiB:.2f} MiB/sb (unreclaimable {mem['SUnreclaim'] / MiB:.2f}), "
        f"percpu {mem['Percpu'] / 1024:.0f} KiB/sb, stacks {mem['KernelStack'] / 1024:.0f} KiB/sb, "
        f"used {mem['used'] / MiB:.2f} MiB/sb; fill {fill_s:.0f} s, kill {kill_s:.0f} s")
    for r in top[:15]:
        log(f"    {r['cache']:<28} {r['objs_per_sb']:8.1f} objs  {r['bytes_per_sb'] / 1024:8.1f} KiB "
            f"(slab pages {r['pages_bytes_per_sb'] / 1024:.1f} KiB)")
    return {"n": n, "memory_cgroup": memory_cgroup, "memcgs_added": c1 - c0,
            "meminfo_per_sb": mem, "slab_per_sb": top, "fill_s": round(fill_s, 1),
            "kill_s": round(kill_s, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--label", default="", help="what this build is (e.g. the commit), stored with the runs")
    ap.add_argument("--out", default=str(RESULTS / "density_slab.json"))
    ap.add_argument("--root", default="/var/tmp/shoal-density-slab", help="Shoal root for the bench")
    ap.add_argument("--append", action="store_true", help="add these runs to --out under --label")
    ap.add_argument("--memory-cgroup", choices=("own", "pooled"), default="own",
                    help="one memory cgroup per sandbox (own), or shared by pools of --pool-size (pooled)")
    ap.add_argument("--pool-size", type=int, default=0, help="sandboxes per pool (0: the root's setting, 64)")
    args = ap.parse_args()
    host = Host.get(Path(args.root))  # a root of its own, kept (its layer stays mounted, as a host's would)
    try:
        image = host.store.get_image("slab-busybox:1").ref
    except Exception:
        with tempfile.TemporaryDirectory(dir=host.settings.tmp_dir) as d:
            layer = host.store.build_from_dir(make_busybox_tree(Path(d) / "rootfs"), name="slab-busybox")
        image = host.store.create_image("slab-busybox:1", [layer.digest]).ref
    be = host.backend("container")
    if args.pool_size:
        be.cgroups.pools.size = args.pool_size
    pool_size = be.cgroups.pools.size
    warm = Sandbox(host, host.create(CreateRequest(image=image, backend="container",
                                                   memory_cgroup=args.memory_cgroup)))
    warm.sessions.create(shell="/bin/sh").run("true")
    warm.kill()
    runs = [one_run(host, image, args.n, print, args.memory_cgroup) for _ in range(args.runs)]
    keys = [r["cache"] for r in runs[0]["slab_per_sb"][:15]]
    summary = {}
    for k in keys:
        vals = sorted(next((x["bytes_per_sb"] for x in r["slab_per_sb"] if x["cache"] == k), 0) for r in runs)
        summary[k] = {"min": vals[0], "median": statistics.median(vals), "max": vals[-1]}
    for k in runs[0]["meminfo_per_sb"]:
        vals = sorted(r["meminfo_per_sb"][k] for r in runs)
        summary[f"meminfo:{k}"] = {"min": vals[0], "median": statistics.median(vals), "max": vals[-1]}
    entry = {"label": args.label, "t": time.time(), "memory_cgroup": args.memory_cgroup,
             "pool_size": pool_size if args.memory_cgroup == "pooled" else None,
             "uptime_s": float(Path("/proc/uptime").read_text().split()[0]),
             "load_avg": Path("/proc/loadavg").read_text().split()[:3],
             "runs": runs, "summary_bytes_per_sb": summary}
    out = Path(args.out)
    doc = json.loads(out.read_text()) if args.append and out.exists() else {"builds": []}
    doc["builds"].append(entry)
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
