#!/usr/bin/env python3
"""KSM benchmark: what same-page merging saves on N idle Python interpreters, and what it costs.

N sandboxes of python:3.11, each running one idle interpreter that imported a typical set of modules
(asyncio, json, email, http, unittest, sqlite3, ssl, decimal, ...), as an agent's session keeps one
between tool calls. Three configurations, each on the same N:

  off          the default: no KSM;
  ksm          ksm=True (prctl PR_SET_MEMORY_MERGE in every sandbox process; ksmd started by Shoal);
  ksm+layout   ksm=True, aslr=False and PYTHONHASHSEED=0: identical interpreters lay out identically
               and build identical dicts, so their heaps are page-for-page equal more often.

Per configuration: anonymous memory per sandbox (the sum of the sandboxes' cgroup anon memory
(`total_rss` on v1, `anon` on v2; a merged page stays charged to one cgroup, its duplicates are
freed), divided by N) when KSM has converged (pages_sharing changes < 1% over 10 s, or the wait
limit), the time to converge after the last interpreter started, and ksmd's CPU (cores: while
converging and once converged). The host's AnonPages delta is kept too (noisy: the machine is shared).

Writes bench/results/ksm.json (+ .png). `--runs R` runs the three configurations R times (rotated
order); `--append` adds this invocation's runs to the JSON instead of replacing it (to keep each
invocation under 10 minutes). Needs root and the python:3.11 image in the root (SHOAL_ROOT).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from shoal import Host, Sandbox  # noqa: E402
from shoal.backends.container import ksm  # noqa: E402

RESULTS = Path(__file__).parent / "results"
CONFIGS = {"off": {}, "ksm": {"ksm": True}, "ksm+layout": {"ksm": True, "aslr": False, "hashseed": "0"}}
IMPORTS = ("import asyncio, json, email.parser, http.client, unittest, sqlite3, ssl, decimal, argparse, "
           "logging, subprocess, xml.etree.ElementTree, urllib.request, dataclasses, typing, pathlib, re, time")
IDLE = IMPORTS + "; print('ready', flush=True); time.sleep(86400)"


def ksmd_ticks() -> int:
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if (d / "comm").read_text().strip() == "ksmd":
                    f = (d / "stat").read_text().rpartition(")")[2].split()
                    return int(f[11]) + int(f[12])
            except OSError:
                continue
    return 0


def anon_bytes(cg, sandbox_id: str) -> int:
    d = cg._dir("memory", sandbox_id)
    stat = dict(line.split() for line in (d / "memory.stat").read_text().splitlines())
    return int(stat["anon"]) if cg.version == 2 else int(stat["total_rss"])


def meminfo(key: str) -> int:
    for line in open("/proc/meminfo"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def run_config(host: Host, image: str, name: str, n: int, wait_s: float) -> dict:
    opts = CONFIGS[name]
    be = host.backend("container")
    cg = be.cgroups
    tick = os.sysconf("SC_CLK_TCK")
    anon0 = meminfo("AnonPages")
    env = {"PYTHONHASHSEED": opts["hashseed"]} if "hashseed" in opts else None
    boxes: list[Sandbox] = []
    procs = []

    def one(_: int) -> tuple[Sandbox, object]:
        sb = Sandbox.create(image, root=host.settings.root, ksm=opts.get("ksm", False), aslr=opts.get("aslr", True),
                            memory_mb=256, url="local")
        p = sb.commands.start(["python3", "-c", IDLE], env=env)
        return sb, p

    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(4) as ex:
            for sb, p in ex.map(one, range(n)):
                boxes.append(sb)
                procs.append(p)
        # every interpreter has finished its imports
        deadline = time.monotonic() + 120
        for p in procs:
            while "ready" not in (out := p.output()).stdout:
                if out.exit_code is not None:
                    raise RuntimeError(f"an interpreter exited ({out.exit_code}): {out.stderr[-500:]}")
                if time.monotonic() > deadline:
                    raise RuntimeError("interpreters not ready after 120 s")
                time.sleep(0.05)
        started = time.monotonic()
        create_s = started - t0
        k0 = ksmd_ticks()
        series = []
        last_change = started
        prev_sharing = None
        converged_s = None
        while True:
            time.sleep(2.0)
            now = time.monotonic()
            st = be.ksm_host.stats()
            total = sum(anon_bytes(cg, sb.id) for sb in boxes)
            series.append({"t": round(now - started, 1), "anon_per_sandbox": total / n,
                           "pages_sharing": st["pages_sharing"], "pages_shared": st["pages_shared"]})
            if name == "off":
                if now - started >= 10:
                    break
                continue
            sharing = st["pages_sharing"] or 0
            if prev_sharing is None or abs(sharing - prev_sharing) > 0.01 * max(prev_sharing, 1):
                last_change, prev_sharing = now, sharing
            if sharing > 0 and now - last_change >= 10:
                converged_s = last_change - started
                break
            if now - started > wait_s:
                break
        converge_ticks = ksmd_ticks() - k0
        converge_wall = time.monotonic() - started
        k1, w1 = ksmd_ticks(), time.monotonic()
        time.sleep(10)
        steady_cores = (ksmd_ticks() - k1) / tick / (time.monotonic() - w1)
        total = sum(anon_bytes(cg, sb.id) for sb in boxes)
        merging = sum(ksm.merging_pages(cg.procs(sb.id)) for sb in boxes)
        return {"config": name, "n": n, "create_and_import_s": round(create_s, 1),
                "anon_per_sandbox_bytes": total / n,
                "host_anon_delta_per_sandbox_bytes": (meminfo("AnonPages") - anon0) / n,
                "merging_pages_per_sandbox": merging / n, "converged_s": converged_s,
                "waited_s": round(converge_wall, 1),
                "ksmd_cores_converging": converge_ticks / tick / converge_wall if converge_wall else 0.0,
                "ksmd_cores_steady": steady_cores, "ksm_host": be.ksm_host.stats(), "series": series}
    finally:
        with ThreadPoolExecutor(4) as ex:
            list(ex.map(lambda sb: sb.kill(), boxes))


def summarize(runs: list[dict]) -> dict:
    out: dict = {}
    for name in CONFIGS:
        rows = [r for run in runs for r in run["configs"] if r["config"] == name]
        if not rows:
            continue
        s: dict = {"runs": len(rows)}
        for key in ("anon_per_sandbox_bytes", "converged_s", "ksmd_cores_converging", "ksmd_cores_steady",
                    "host_anon_delta_per_sandbox_bytes"):
            xs = [r[key] for r in rows if r.get(key) is not None]
            if xs:
                s[key] = {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}
        out[name] = s
    if "off" in out:
        base = out["off"]["anon_per_sandbox_bytes"]["median"]
        for s in out.values():
            s["saving_vs_off"] = 1 - s["anon_per_sandbox_bytes"]["median"] / base
    return out


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(doc["summary"])
    med = [doc["summary"][k]["anon_per_sandbox_bytes"]["median"] / 2**20 for k in names]
    lo = [m - doc["summary"][k]["anon_per_sandbox_bytes"]["min"] / 2**20 for k, m in zip(names, med)]
    hi = [doc["summary"][k]["anon_per_sandbox_bytes"]["max"] / 2**20 - m for k, m in zip(names, med)]
    a.bar(names, med, yerr=[lo, hi], color=["#999", "#6a9", "#38c"])
    a.set_ylabel("anonymous memory per idle interpreter (MiB)")
    a.set_title(f"N={doc['n']} python:3.11 sandboxes, {len(doc['runs'])} runs")
    for name in names[1:]:
        for run in doc["runs"]:
            for r in run["configs"]:
                if r["config"] == name:
                    b.plot([p["t"] for p in r["series"]], [p["anon_per_sandbox"] / 2**20 for p in r["series"]],
                           label=name if run is doc["runs"][0] else None, color="#6a9" if name == "ksm" else "#38c")
    b.set_xlabel("seconds after the last interpreter started")
    b.set_ylabel("MiB per sandbox")
    b.set_title("convergence")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--image", default="python:3.11")
    ap.add_argument("--root", default=os.environ.get("SHOAL_ROOT", "/var/tmp/shoal-py"))
    ap.add_argument("--wait", type=float, default=150.0, help="longest wait for KSM to converge (s)")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--out", type=Path, default=RESULTS / "ksm.json")
    ap.add_argument("--append", action="store_true", help="add runs to an existing JSON")
    a = ap.parse_args()
    host = Host.get(a.root)
    names = a.configs.split(",")
    doc: dict = {"runs": []}
    if a.append and a.out.exists():
        doc = json.loads(a.out.read_text())
    for i in range(a.runs):
        k = len(doc["runs"]) % len(names)  # doc["runs"] grows by one per run: each run starts one later
        order = names[k:] + names[:k]
        run = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "order": order,
               "loadavg_start": os.getloadavg()[0], "configs": []}
        for name in order:
            r = run_config(host, a.image, name, a.n, a.wait)
            print(f"run {i + 1} {name:11s} anon/sandbox {r['anon_per_sandbox_bytes'] / 2**20:6.2f} MiB  "
                  f"converged {r['converged_s']} s  ksmd {r['ksmd_cores_converging']:.3f} cores "
                  f"(steady {r['ksmd_cores_steady']:.3f})", flush=True)
            run["configs"].append(r)
        run["loadavg_end"] = os.getloadavg()[0]
        doc["runs"].append(run)
    doc.update(n=a.n, image=a.image, kernel=platform.release(), cpus=os.cpu_count(),
               ksm_config={"pages_to_scan": host.backend("container").ksm_host.config.pages_to_scan,
                           "sleep_millisecs": host.backend("container").ksm_host.config.sleep_millisecs},
               note="shared 2-core machine: other work ran meanwhile (loadavg per run)")
    doc["summary"] = summarize(doc["runs"])
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=1))
    plot(doc, a.out.with_suffix(".png"))
    for name, s in doc["summary"].items():
        m = s["anon_per_sandbox_bytes"]
        print(f"{name:11s} {m['median'] / 2**20:6.2f} MiB (min {m['min'] / 2**20:.2f}, max {m['max'] / 2**20:.2f}) "
              f"saving {s['saving_vs_off']:+.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
