#!/usr/bin/env python3
"""Reclaim of idle python sandboxes into zram (issue 16, "Reclaim idle sandboxes"; docs/density.md).

Each sandbox (python:3.11) runs a live Python process that has imported pytest, json, asyncio,
sqlite3, email and http.client and holds a small working set, as an agent's session would; it
answers on a FIFO by touching that whole working set. Per run and compressor (lz4, lzo-rle):

  1. Shoal's zram device is set up with the compressor (zram.setup, a private state file);
  2. --sandboxes sandboxes are created and their Python processes started; host memory is read;
  3. all are paused; resume -> first exec (`true`) and resume -> the Python process answered are
     timed on each (the paused-only baseline), then all are paused again;
  4. each is reclaimed (sb.reclaim(target)), timed; per-sandbox cgroup memory before/after, host
     memory after, and what the zram device holds (original bytes vs RAM used: the compression ratio);
  5. resume -> first exec and resume -> Python answered are timed again on the reclaimed sandboxes.

"Host memory for the sandboxes" is MemTotal - MemAvailable minus the same figure before any sandbox
existed: it includes the zram device's own RAM, and whatever else the shared host did meanwhile;
"accounted" is the sandboxes' cgroups before vs their cgroups after plus the zram device's RAM.
The host is shared, so run >= 3 times (--runs) and read the spread. Run under
`flock /tmp/shoal-bench.lock`. Writes bench/results/reclaim.json and .png.
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
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))
OUT = REPO / "bench" / "results" / "reclaim.json"
MIB = 1 << 20

AGENT = r"""
import asyncio, email.parser, http.client, json, os, sqlite3, sys
import pytest
state = {i: ("x%d" % i) * 8 for i in range(60000)}  # an agent's working set: dicts, strings
os.mkfifo("/tmp/in"); os.mkfifo("/tmp/out")
open("/tmp/ready", "w").write("1")
while True:
    with open("/tmp/in") as f:
        f.read()
    total = sum(len(v) for v in state.values()) + len(sys.modules)
    with open("/tmp/out", "w") as f:
        f.write(str(total))
"""
ASK = "echo go > /tmp/in; cat /tmp/out"


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q * len(s))) - 1))] if s else float("nan")


def host_used() -> int:
    info = {}
    for line in open("/proc/meminfo"):
        k, v = line.split(":")
        info[k] = int(v.split()[0]) * 1024
    return info["MemTotal"] - info["MemAvailable"]


def swap_used() -> dict[str, int]:
    """Bytes used per active swap area (/proc/swaps)."""
    out = {}
    with open("/proc/swaps") as f:
        next(f, None)
        for line in f:
            parts = line.split()
            if len(parts) >= 4:
                out[parts[0]] = int(parts[3]) * 1024
    return out


def lat(xs: list[float]) -> dict:
    return {"n": len(xs), "p50_ms": round(pct(xs, 0.5) * 1e3, 2), "p99_ms": round(pct(xs, 0.99) * 1e3, 2),
            "max_ms": round(max(xs) * 1e3, 2)}


def wake_times(sbs: list) -> tuple[list[float], list[float]]:
    """resume -> first exec (`true`), and resume -> the Python process answered, on paused sandboxes
    (half are asked one way first, half the other, so neither always pays the page-ins)."""
    first, answer = [], []
    for i, sb in enumerate(sbs):
        cmds = [("exec", "true"), ("answer", ASK)]
        if i % 2:
            cmds.reverse()
        for kind, cmd in cmds:
            sb.pause()
            t = time.perf_counter()
            r = sb.commands.run(cmd, timeout=60)
            dt = time.perf_counter() - t
            if not r.ok:
                raise RuntimeError(f"{sb.id}: {cmd!r} failed: {r.stderr}")
            (first if kind == "exec" else answer).append(dt)
    return first, answer


def one_run(algorithm: str, n: int, target: float, root: str, zram_mb: int) -> dict:
    """`algorithm`: a zram compressor (lz4, lzo-rle), or zswap-NAME: zswap with crypto compressor NAME
    in front of a lzo-rle zram device (what zswap rejects lands there)."""
    from shoal import Sandbox
    from shoal.backends.container import zram, zswap
    from shoal.backends.container.cgroups import CgroupDriver, cgroup_parent
    from shoal.backends.container.reclaim import memory_use

    tmpd = Path(tempfile.mkdtemp(prefix="shoal-reclaim-bench-"))
    state, zswap_state = tmpd / "zram.json", tmpd / "zswap.json"
    zswap_with = algorithm.removeprefix("zswap-") if algorithm.startswith("zswap-") else None
    if zswap.available() and zswap.settings()["enabled"] in ("Y", "1"):
        # zswap is host-wide: left on (by anyone), it takes a zram-only run's pages, and its own run
        # would record "on" as the host's setting to restore
        raise SystemExit("zswap is already enabled on this host; turn it off first "
                         "(echo N > /sys/module/zswap/parameters/enabled)")
    # the top swap priority: a device of equal priority (another user's zram on a shared host) would
    # take every other page round-robin, and its RAM would not be counted here
    dev = zram.setup(zram.ZramConfig(size_mb=zram_mb, algorithm="lzo-rle" if zswap_with else algorithm,
                                     priority=32767), state)
    sbs: list = []
    handles: list = []  # the Python processes live as long as their handles
    try:
        if zswap_with:
            zswap.setup(zswap_with, zswap_state)
        time.sleep(1.0)
        base = host_used()
        zswap_base = zswap.stats()
        others_base = {p: u for p, u in swap_used().items() if p != dev.path}
        for _ in range(n):
            sb = Sandbox.create("python:3.11", url="local", root=root, memory_mb=256, disk_mb=64)
            sbs.append(sb)
            handles.append(sb.commands.start(["python3", "-c", AGENT]))
        for sb in sbs:
            deadline = time.monotonic() + 60
            while not sb.commands.run("test -e /tmp/ready").ok:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{sb.id}: the python process did not start")
                time.sleep(0.05)
            assert sb.commands.run(ASK, timeout=30).stdout.strip()
        time.sleep(1.0)
        used_before = host_used() - base
        for sb in sbs:
            sb.pause()
        paused_first, paused_answer = wake_times(sbs)
        for sb in sbs:
            sb.pause()
        cg = CgroupDriver.detect(parent=cgroup_parent(Path(root)))
        uses_before = [memory_use(cg, sb.id) for sb in sbs]
        results = []
        for sb in sbs:
            t = time.perf_counter()
            r = sb.reclaim(target=target)
            results.append((r, time.perf_counter() - t))
        time.sleep(1.0)
        uses_after = [memory_use(cg, sb.id) for sb in sbs]
        used_after = host_used() - base
        zst = dev.stats()
        zsw = {k: v - zswap_base[k] for k, v in zswap.stats().items()}
        others = {p: u for p, u in swap_used().items() if p != dev.path}
        ram_out = zst["mem_used_total"] + zsw["pool_bytes"]  # what the pushed-out pages cost in RAM
        rec_first, rec_answer = wake_times(sbs)
        before = [r.memory_before for r, _ in results]
        after = [r.memory_after for r, _ in results]
        return {
            "algorithm": algorithm, "sandboxes": n, "target": target,
            "per_sandbox_mib": {
                "cgroup_before_median": round(statistics.median(before) / MIB, 2),
                "cgroup_after_median": round(statistics.median(after) / MIB, 2),
                "anon_before_median": round(statistics.median(r.anon_before for r, _ in results) / MIB, 2),
                "anon_after_median": round(statistics.median(r.anon_after for r, _ in results) / MIB, 2),
                "swapped_median": round(statistics.median(r.swapped for r, _ in results) / MIB, 2),
                "after_over_before": round(sum(after) / sum(before), 3),
            },
            "host_mib": {"before": round(used_before / MIB, 1), "after": round(used_after / MIB, 1),
                         "after_over_before": round(used_after / used_before, 3) if used_before > 0 else None,
                         "zram_ram": round(zst["mem_used_total"] / MIB, 1)},
            # the same from accounting alone (immune to other work on the host): the sandboxes' cgroups
            # before, vs their cgroups after plus the RAM the zram device uses for what they pushed out
            "accounted_mib": {"before": round(sum(before) / MIB, 1),
                              "after": round((sum(after) + ram_out) / MIB, 1),
                              "after_over_before": round((sum(after) + ram_out) / sum(before), 3),
                              "cgroups_after": round(sum(after) / MIB, 1),
                              "compressed_pools": round(ram_out / MIB, 1)},
            # the same without page cache on either side: which sandbox is charged for shared files (libpython,
            # the stdlib) depends on who read them first, and reclaim may drop them; this is the strict figure
            "accounted_no_cache_mib": {
                "before": round(sum(u.charged - u.file for u in uses_before) / MIB, 1),
                "after": round((sum(u.charged - u.file for u in uses_after) + ram_out) / MIB, 1),
                "after_over_before": round((sum(u.charged - u.file for u in uses_after) + ram_out)
                                           / sum(u.charged - u.file for u in uses_before), 3),
                "cache_before": round(sum(u.file for u in uses_before) / MIB, 1),
                "cache_after": round(sum(u.file for u in uses_after) / MIB, 1)},
            # what went out vs the RAM holding it: zram's device, plus zswap's pool where zswap is on (its
            # pool size includes the allocator's overhead, so for zswap both ratios count it)
            "zram": {"stored_mib": round((zst["orig_data_size"] + zsw["stored_bytes"]) / MIB, 1),
                     "compressed_mib": round((zst["compr_data_size"] + zsw["pool_bytes"]) / MIB, 1),
                     "ram_mib": round(ram_out / MIB, 1),
                     "compression_ratio": round((zst["orig_data_size"] + zsw["stored_bytes"])
                                                / (zst["compr_data_size"] + zsw["pool_bytes"]), 3)
                     if zst["compr_data_size"] + zsw["pool_bytes"] else 0.0,
                     "ratio_with_overhead": round((zst["orig_data_size"] + zsw["stored_bytes"]) / ram_out, 3)
                     if ram_out else 0.0},
            # other swap areas' use changed by this much meanwhile (should be ~0: ours has the top priority)
            "other_swap_delta_mib": round((sum(others.values()) - sum(others_base.values())) / MIB, 1),
            "zswap": {"compressor": zswap_with, "stored_mib": round(zsw["stored_bytes"] / MIB, 1),
                      "pool_mib": round(zsw["pool_bytes"] / MIB, 1),
                      "device_stored_mib": round(zst["orig_data_size"] / MIB, 1),
                      "device_ram_mib": round(zst["mem_used_total"] / MIB, 1)} if zswap_with else None,
            "reclaim_ms_per_sandbox": {"p50": round(pct([d for _, d in results], 0.5) * 1e3, 1),
                                       "max": round(max(d for _, d in results) * 1e3, 1)},
            "resume_to_first_exec": {"paused": lat(paused_first), "reclaimed": lat(rec_first)},
            "resume_to_python_answer": {"paused": lat(paused_answer), "reclaimed": lat(rec_answer)},
        }
    finally:
        for h in handles:
            h.close()
        for sb in sbs:
            try:
                sb.kill()
            except Exception:
                pass
        zram.teardown(state)
        if zswap_with:
            zswap.teardown(zswap_state)


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    kinds = sorted({(r["algorithm"], r["target"]) for r in data["runs"]})
    for k, (algo, target) in enumerate(kinds):
        runs = [r for r in data["runs"] if (r["algorithm"], r["target"]) == (algo, target)]
        off = (k - (len(kinds) - 1) / 2) * 0.15
        for j, r in enumerate(runs):
            axes[0].scatter([0 + off, 1 + off], [r["per_sandbox_mib"]["cgroup_before_median"],
                                                 r["per_sandbox_mib"]["cgroup_after_median"]],
                            color=f"C{k}", label=f"{algo}, target {target}" if j == 0 else None)
            axes[1].scatter([0 + off, 1 + off], [r["host_mib"]["before"] / r["sandboxes"],
                                                 r["host_mib"]["after"] / r["sandboxes"]], color=f"C{k}")
            axes[2].scatter([0 + off, 1 + off, 2 + off, 3 + off],
                            [r["resume_to_first_exec"]["paused"]["p50_ms"],
                             r["resume_to_first_exec"]["reclaimed"]["p50_ms"],
                             r["resume_to_python_answer"]["paused"]["p50_ms"],
                             r["resume_to_python_answer"]["reclaimed"]["p50_ms"]], color=f"C{k}")
    axes[0].set_xticks([0, 1], ["before", "after reclaim"])
    axes[0].set_ylabel("MiB per sandbox (cgroup, median)")
    axes[0].set_ylim(bottom=0)
    axes[0].legend()
    axes[1].set_xticks([0, 1], ["before", "after reclaim"])
    axes[1].set_ylabel("host MiB per sandbox (zram RAM included)")
    axes[1].set_ylim(bottom=0)
    axes[2].set_xticks([0, 1, 2, 3], ["exec\npaused", "exec\nreclaimed", "python\npaused", "python\nreclaimed"])
    axes[2].set_ylabel("resume -> done, p50 ms")
    axes[2].set_ylim(bottom=0)
    fig.suptitle(f"{data['sandboxes']} python:3.11 sandboxes reclaimed to zram, one dot per run")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sandboxes", type=int, default=20)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--targets", default="0.75,1.0", help="reclaim targets, each run with every compressor")
    ap.add_argument("--algorithms", default="lz4,lzo-rle")
    ap.add_argument("--zram-mb", type=int, default=2048)
    ap.add_argument("--root", default=os.environ.get("SHOAL_ROOT", "/var/tmp/shoal-py"),
                    help="a Shoal root holding python:3.11 (`shoal env python`)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--table", action="store_true", help="print the docs table from --out and exit")
    ap.add_argument("--append-runs", action="store_true",
                    help="keep the runs already in --out and add these (run numbers continue per kind)")
    args = ap.parse_args()
    if args.table:
        print(table(json.loads(args.out.read_text())))
        return
    if os.geteuid() != 0:
        sys.exit("bench/reclaim.py needs root (sandboxes in-process, zram)")
    runs: list[dict] = []
    targets = [float(x) for x in args.targets.split(",")]
    if args.append_runs and args.out.exists():
        old = json.loads(args.out.read_text())
        runs = old["runs"]
        targets = sorted(set(targets) | set(old["targets"]))
    from shoal.backends.container import reclaim as reclaim_mod

    for i in range(args.runs):
        for algo, target in [(a, t) for t in [float(x) for x in args.targets.split(",")]
                             for a in args.algorithms.split(",")]:
            t = time.monotonic()
            r = one_run(algo, args.sandboxes, target, args.root, args.zram_mb)
            r["run"] = sum(1 for o in runs if (o["algorithm"], o["target"]) == (algo, target))
            r["reclaim_floor_kib"] = reclaim_mod.MIN_GOAL >> 10
            r["method"] = "anon-goal"  # reclaim steps follow anon (runs without this key aimed at the charge)
            r["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
            runs.append(r)
            save(args, targets, runs)  # after every run: a cut-short invocation keeps what it measured
            print(f"run {i} {algo} target {target}: cgroup {r['per_sandbox_mib']['cgroup_before_median']} -> "
                  f"{r['per_sandbox_mib']['cgroup_after_median']} MiB, host x{r['host_mib']['after_over_before']} "
                  f"(accounted x{r['accounted_mib']['after_over_before']}, without page cache "
                  f"x{r['accounted_no_cache_mib']['after_over_before']}), "
                  f"ratio {r['zram']['compression_ratio']}, {r['reclaim_ms_per_sandbox']['p50']} ms/sandbox, "
                  f"exec p50 {r['resume_to_first_exec']['reclaimed']['p50_ms']} ms, python p50 "
                  f"{r['resume_to_python_answer']['reclaimed']['p50_ms']} ms ({time.monotonic() - t:.0f} s)",
                  flush=True)
    print(f"wrote {args.out}")


def table(data: dict) -> str:
    """Markdown rows: median [min-max] over the runs, per compressor and target."""
    def cell(runs: list[dict], *path: str, fmt: str = "{:.1f}") -> str:
        xs = []
        for r in runs:
            v: object = r
            for p in path:
                v = v[p]  # type: ignore[index]
            xs.append(float(v))  # type: ignore[arg-type]
        med = statistics.median(xs)
        return f"{fmt.format(med)} [{fmt.format(min(xs))}–{fmt.format(max(xs))}]"

    kinds = sorted({(r["algorithm"], r["target"], r.get("method", "charge-goal")) for r in data["runs"]},
                   key=lambda k: (k[2], k[1], k[0]))
    rows = ["| compressor, target, reclaim aimed at | runs | cgroup MiB/sandbox before → after | "
            "accounted after/before | without page cache | ratio (pool overhead in) | reclaim ms/sandbox | "
            "resume → exec p50 / p99 ms (paused → reclaimed) | resume → python answered p50 ms (paused → reclaimed) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for algo, target, method in kinds:
        rs = [r for r in data["runs"] if (r["algorithm"], r["target"], r.get("method", "charge-goal")) ==
              (algo, target, method)]
        no_cache = (cell(rs, 'accounted_no_cache_mib', 'after_over_before', fmt='{:.2f}')
                    if all("accounted_no_cache_mib" in r for r in rs) else "–")
        rows.append(
            f"| {algo}, {target}, {'anon' if method == 'anon-goal' else 'charge (old)'} | {len(rs)} | "
            f"{cell(rs, 'per_sandbox_mib', 'cgroup_before_median')} → "
            f"{cell(rs, 'per_sandbox_mib', 'cgroup_after_median')} | "
            f"{cell(rs, 'accounted_mib', 'after_over_before', fmt='{:.2f}')} | {no_cache} | "
            f"{cell(rs, 'zram', 'ratio_with_overhead', fmt='{:.2f}')} | {cell(rs, 'reclaim_ms_per_sandbox', 'p50')} | "
            f"{cell(rs, 'resume_to_first_exec', 'paused', 'p50_ms')} / "
            f"{cell(rs, 'resume_to_first_exec', 'paused', 'p99_ms')} → "
            f"{cell(rs, 'resume_to_first_exec', 'reclaimed', 'p50_ms')} / "
            f"{cell(rs, 'resume_to_first_exec', 'reclaimed', 'p99_ms')} | "
            f"{cell(rs, 'resume_to_python_answer', 'paused', 'p50_ms')} → "
            f"{cell(rs, 'resume_to_python_answer', 'reclaimed', 'p50_ms')} |")
    return "\n".join(rows)


def save(args: argparse.Namespace, targets: list[float], runs: list[dict]) -> None:
    data = {"bench": "reclaim", "targets": targets, "sandboxes": args.sandboxes,
            "host": {"kernel": platform.release(), "cpus": os.cpu_count(),
                     "cgroup": "v2" if Path("/sys/fs/cgroup/cgroup.controllers").exists() else "v1"},
            "note": "shared host: other work ran meanwhile; host MiB are MemTotal-MemAvailable deltas",
            "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    plot(data, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
