#!/usr/bin/env python3
"""What the E2B front adds: the unmodified `e2b` SDK through `shoal e2b serve` vs Shoal's own SDK, same host.

Both paths drive the container backend, each on a private root of its own (so neither process
sweeps up after the other's kills): Shoal's SDK in this process (`url="local"`), and the E2B SDK
over loopback HTTP to `shoal e2b serve` (a separate process with SHOAL_URL=local). Per iteration,
on each path: create, run (`/bin/bash -l -c "echo hi"`, the argv the E2B SDK sends), write (4 KiB),
read, kill. The paths alternate, so drift hits both. --runs runs (default 3) of --n iterations
each; create and kill are also timed from plain httpx (the front alone, without the E2B SDK's own
client work). Reported: p50 per op and path, the overhead (E2B p50 - Shoal p50) per run, and the
min/median/max of that overhead over the runs.

Writes bench/results/e2b_front.json. Needs root.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from roots import wipe_root  # noqa: E402

from shoal import Host, Sandbox  # noqa: E402
from shoal.layers.busybox import make_busybox_tree  # noqa: E402

RESULTS = Path(__file__).parent / "results"
OPS = ("create", "run", "write", "read", "kill")
HTTP_OPS = {"create_http": "create", "kill_http": "kill"}  # E2B op measured with plain httpx -> Shoal op
PAYLOAD = b"x" * 4096
ARGV = ["/bin/bash", "-l", "-c", "echo hi"]


def build_image(root: Path) -> str:
    host = Host.get(root)
    with tempfile.TemporaryDirectory() as d:
        base = host.store.build_from_dir(make_busybox_tree(Path(d) / "bb"), source="busybox", name="busybox")
        extra = Path(d) / "extra"
        (extra / "bin").mkdir(parents=True)
        (extra / "home/user").mkdir(parents=True)
        (extra / "bin/bash").write_bytes(b'#!/bin/sh\nexec /bin/sh "$@"\n')
        (extra / "bin/bash").chmod(0o755)
        # E2B's user: the E2B path runs its commands and owns its uploads as uid 1000, as E2B does
        (extra / "etc").mkdir()
        (extra / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/sh\n")
        (extra / "etc/group").write_text("root:x:0:\nuser:x:1000:\n")
        os.chown(extra / "home/user", 1000, 1000)
        top = host.store.build_from_dir(extra, name="e2b-bench")
    host.store.create_image("e2b-bench:latest", [base.digest, top.digest])
    return "e2b-bench:latest"


def start_front(root: Path, image: str) -> tuple[subprocess.Popen, str, str]:
    env = {**os.environ, "SHOAL_URL": "local", "SHOAL_ROOT": str(root)}
    cli = [sys.executable, "-m", "shoal.cli", "e2b"]
    keys = root / "e2b-keys.json"
    key = subprocess.run([*cli, "key", "create", "bench", "--keys", str(keys)], env=env, check=True,
                         capture_output=True, text=True).stdout.strip()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([*cli, "serve", "--listen", f"127.0.0.1:{port}", "--keys", str(keys),
                             "--template", f"base={image}"], env=env)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            httpx.get(url + "/v2/sandboxes", timeout=1)
            return proc, url, key
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("shoal e2b serve did not come up")


def one_e2b(opts: dict, t: dict[str, list[float]], http: httpx.Client) -> None:
    from e2b import Sandbox as E2BSandbox

    # the front alone: the same REST calls from plain httpx, without the E2B SDK's own client work
    key = {"X-API-KEY": opts["api_key"]}
    h0 = time.perf_counter()
    sid = http.post(opts["api_url"] + "/v2/sandboxes", json={"templateID": "base", "timeout": 120},
                    headers=key).json()["sandboxID"]
    h1 = time.perf_counter()
    assert http.delete(opts["api_url"] + f"/sandboxes/{sid}", headers=key).status_code == 204
    h2 = time.perf_counter()
    t["create_http"].append(h1 - h0)
    t["kill_http"].append(h2 - h1)

    t0 = time.perf_counter()
    s = E2BSandbox.create("base", timeout=120, **opts)
    t1 = time.perf_counter()
    r = s.commands.run("echo hi")
    t2 = time.perf_counter()
    s.files.write("/tmp/f", PAYLOAD)
    t3 = time.perf_counter()
    data = s.files.read("/tmp/f", format="bytes")
    t4 = time.perf_counter()
    s.kill()
    t5 = time.perf_counter()
    assert r.stdout == "hi\n" and bytes(data) == PAYLOAD
    for op, a, b in zip(OPS, (t0, t1, t2, t3, t4), (t1, t2, t3, t4, t5), strict=True):
        t[op].append(b - a)


def one_shoal(image: str, root: Path, t: dict[str, list[float]]) -> None:
    t0 = time.perf_counter()
    s = Sandbox.create(image, url="local", root=root, ttl=120)
    t1 = time.perf_counter()
    r = s.commands.run(ARGV)
    t2 = time.perf_counter()
    s.files.write("/tmp/f", PAYLOAD)
    t3 = time.perf_counter()
    data = s.files.read_bytes("/tmp/f")
    t4 = time.perf_counter()
    s.kill()
    t5 = time.perf_counter()
    assert r.stdout == "hi\n" and data == PAYLOAD
    for op, a, b in zip(OPS, (t0, t1, t2, t3, t4), (t1, t2, t3, t4, t5), strict=True):
        t[op].append(b - a)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--n", type=int, default=30, help="iterations per run")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS / "e2b_front.json")
    ap.add_argument("--plot", type=Path, default=None, help="only draw the PNG of this JSON (next to it)")
    args = ap.parse_args()
    if args.plot:
        plot(args.plot)
        return
    load_before = os.getloadavg()
    root = Path(tempfile.mkdtemp(prefix="shoal-e2bb-", dir="/tmp"))  # the front's
    direct = Path(tempfile.mkdtemp(prefix="shoal-e2bd-", dir="/tmp"))  # Shoal's SDK's, in this process
    proc = None
    try:
        image = build_image(root)
        build_image(direct)
        proc, url, key = start_front(root, image)
        opts = {"api_url": url, "sandbox_url": url, "api_key": key}
        http = httpx.Client()
        for _ in range(args.warmup):
            one_e2b(opts, {op: [] for op in (*OPS, *HTTP_OPS)}, http)
            one_shoal(image, direct, {op: [] for op in OPS})
        runs = []
        for run in range(args.runs):
            e2b: dict[str, list[float]] = {op: [] for op in (*OPS, *HTTP_OPS)}
            shoal: dict[str, list[float]] = {op: [] for op in OPS}
            for _ in range(args.n):
                one_e2b(opts, e2b, http)
                one_shoal(image, direct, shoal)
            row = {}
            for op in (*OPS, *HTTP_OPS):
                pe, ps = statistics.median(e2b[op]) * 1000, statistics.median(shoal[HTTP_OPS.get(op, op)]) * 1000
                row[op] = {"e2b_p50_ms": round(pe, 3), "shoal_p50_ms": round(ps, 3), "overhead_ms": round(pe - ps, 3)}
            runs.append(row)
            print(f"run {run + 1}: " + ", ".join(f"{op} +{row[op]['overhead_ms']:.2f} ms" for op in OPS), flush=True)
        summary = {}
        for op in (*OPS, *HTTP_OPS):
            ov = sorted(r[op]["overhead_ms"] for r in runs)
            summary[op] = {"overhead_ms": {"min": ov[0], "median": round(statistics.median(ov), 3), "max": ov[-1]},
                           "e2b_p50_ms_median": round(statistics.median(r[op]["e2b_p50_ms"] for r in runs), 3),
                           "shoal_p50_ms_median": round(statistics.median(r[op]["shoal_p50_ms"] for r in runs), 3)}
        out = {"bench": "e2b_front", "what": "E2B SDK through `shoal e2b serve` vs Shoal's SDK in-process, "
                                             "container backend, one root each; "
                                             "overhead = E2B p50 - Shoal p50 per run; "
                                             "create_http / kill_http: the same REST calls from plain httpx "
                                             "(the front alone, without the E2B SDK's client-side work)",
               "e2b_sdk": _version("e2b"), "runs": args.runs, "n_per_run": args.n, "payload_bytes": len(PAYLOAD),
               "cpus": os.cpu_count(), "note": "shared 2-core machine, other work running: noisy",
               "loadavg_1m": {"before": round(load_before[0], 2), "after": round(os.getloadavg()[0], 2)},
               "e2b_user": "the E2B path runs its commands and owns its uploads as `user` (uid 1000)",
               "summary": summary, "per_run": runs}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1) + "\n")
        plot(args.out)
        for op in (*OPS, *HTTP_OPS):
            s = summary[op]
            print(f"{op:7s} e2b {s['e2b_p50_ms_median']:8.2f} ms  shoal {s['shoal_p50_ms_median']:8.2f} ms  "
                  f"overhead median {s['overhead_ms']['median']:+.2f} ms "
                  f"[{s['overhead_ms']['min']:+.2f}, {s['overhead_ms']['max']:+.2f}]")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
        wipe_root(root)
        wipe_root(direct)


def plot(path: Path) -> None:
    """<path>.png: per call, the overhead's median over the runs with the min..max spread, and the goal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(path.read_text())
    ops = list(data["summary"])
    med = [data["summary"][op]["overhead_ms"]["median"] for op in ops]
    lo = [m - data["summary"][op]["overhead_ms"]["min"] for op, m in zip(ops, med, strict=True)]
    hi = [data["summary"][op]["overhead_ms"]["max"] - m for op, m in zip(ops, med, strict=True)]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(ops, med, yerr=[lo, hi], capsize=4, color="#4c72b0")
    ax.axhline(5, color="#c44e52", linestyle="--", label="goal: at most +5 ms at p50")
    ax.set_ylabel("added p50, ms (E2B SDK via front - Shoal SDK)")
    load = data.get("loadavg_1m")
    ax.set_title(f"E2B front overhead, {data['runs']} runs x {data['n_per_run']}"
                 + (f" (1-min load {load['before']}-{load['after']} on {data['cpus']} CPUs)" if load else ""))
    ax.legend()
    plt.setp(ax.get_xticklabels(), rotation=20)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=100)


def _version(pkg: str) -> str:
    from importlib.metadata import version

    return version(pkg)


if __name__ == "__main__":
    main()
