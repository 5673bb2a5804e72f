#!/usr/bin/env python3
"""What a request to a sandbox port costs: `get_host` through the E2B front vs `connect_port` in-process.

A busybox `httpd` serves a 4 KiB file on 127.0.0.1:8080 inside a sandbox (no network). Timed per
request, after warm-up:
- front: `httpx` GET through `shoal e2b serve` (its own process, SHOAL_URL=local) with the Host name
  `get_host(8080)` builds and the traffic token: auth, `connect_port` (setns thread), HTTP/1.1 relay;
- direct: Shoal's SDK in this process, `connect_port(8080)` + a raw HTTP/1.0 GET read to EOF;
- connect: `connect_port` alone, in-process (the netns-join + TCP connect the route pays per request).
--runs runs (default 3) of --n requests; reported: p50 per path per run, the front's added p50
(front - direct) per run and its min/median/max over the runs. Writes bench/results/e2b_ports.json
(+ .png). Needs root.
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

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2b_front import RESULTS, _version, build_image, start_front, wipe_root  # noqa: E402

from shoal import Sandbox  # noqa: E402

PAGE = b"x" * 4096
PORT = 8080
SERVE = f"mkdir -p /tmp/www && httpd -p 127.0.0.1:{PORT} -h /tmp/www"


def _get_direct(sb: Sandbox) -> bytes:
    with sb.connect_port(PORT) as s:
        s.sendall(b"GET /page HTTP/1.0\r\nHost: x\r\n\r\n")
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--n", type=int, default=200, help="requests per run and path")
    ap.add_argument("--out", type=Path, default=RESULTS / "e2b_ports.json")
    args = ap.parse_args()
    from e2b import Sandbox as E2bSandbox

    root = Path(tempfile.mkdtemp(prefix="shoal-e2bp-", dir="/tmp"))
    direct_root = Path(tempfile.mkdtemp(prefix="shoal-e2bq-", dir="/tmp"))
    proc = e2b_sb = sb = None
    try:
        image = build_image(root)
        build_image(direct_root)
        proc, url, key = start_front(root, image)
        e2b_sb = E2bSandbox.create("base", timeout=600, api_url=url, sandbox_url=url, api_key=key)
        e2b_sb.files.write("/tmp/www/page", PAGE)
        e2b_sb.commands.run(SERVE)
        sb = Sandbox.create(image, url="local", root=direct_root)
        sb.files.write("/tmp/www/page", PAGE)
        sb.commands.run(SERVE, check=True)
        http = httpx.Client(base_url=url, headers={"Host": e2b_sb.get_host(PORT),
                                                   "E2B-Traffic-Access-Token": e2b_sb.traffic_access_token})
        time.sleep(0.5)
        for _ in range(20):  # warm-up (and the servers' first bind)
            assert http.get("/page").content == PAGE
            assert _get_direct(sb).endswith(PAGE)
        runs = []
        for run in range(args.runs):
            t: dict[str, list[float]] = {"front": [], "direct": [], "connect": []}
            for _ in range(args.n):  # interleaved, so drift hits every path
                t0 = time.perf_counter()
                r = http.get("/page")
                t1 = time.perf_counter()
                body = _get_direct(sb)
                t2 = time.perf_counter()
                sb.connect_port(PORT).close()
                t3 = time.perf_counter()
                assert r.content == PAGE and body.endswith(PAGE)
                t["front"].append(t1 - t0)
                t["direct"].append(t2 - t1)
                t["connect"].append(t3 - t2)
            row = {k: round(statistics.median(v) * 1000, 3) for k, v in t.items()}
            row["added_ms"] = round(row["front"] - row["direct"], 3)
            runs.append(row)
            print(f"run {run + 1}: front {row['front']:.2f} ms, direct {row['direct']:.2f} ms, "
                  f"connect {row['connect']:.2f} ms, added {row['added_ms']:+.2f} ms", flush=True)

        def spread(key: str) -> dict[str, float]:
            v = sorted(r[key] for r in runs)
            return {"min": v[0], "median": round(statistics.median(v), 3), "max": v[-1]}

        out = {"bench": "e2b_ports", "what": "GET of a 4 KiB file from busybox httpd inside a sandbox: through "
                                             "`shoal e2b serve` by get_host's Host name (front) vs Shoal's "
                                             "SDK connect_port + raw GET in-process (direct); connect = "
                                             "connect_port alone; p50 ms per run",
               "e2b_sdk": _version("e2b"), "runs": args.runs, "n_per_run": args.n, "cpus": os.cpu_count(),
               "note": "shared 2-core machine, other work running: noisy",
               "summary": {k: spread(k) for k in ("front", "direct", "connect", "added_ms")}, "per_run": runs}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1) + "\n")
        _plot(out, args.out.with_suffix(".png"))
        print(json.dumps(out["summary"]))
    finally:
        for s in (e2b_sb, sb):
            try:
                if s is not None:
                    s.kill()
            except Exception:
                pass
        if proc is not None:
            proc.terminate()
            proc.wait(30)
        wipe_root(root)
        wipe_root(direct_root)


def _plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["front", "direct", "connect"]
    med = [out["summary"][k]["median"] for k in keys]
    lo = [m - out["summary"][k]["min"] for k, m in zip(keys, med, strict=True)]
    hi = [out["summary"][k]["max"] - m for k, m in zip(keys, med, strict=True)]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(["get_host via front", "connect_port + GET\n(in-process)", "connect_port only"], med, yerr=[lo, hi],
           capsize=4, color=["#4c72b0", "#55a868", "#c44e52"])
    ax.set_ylabel("p50 per request, ms (median of runs; bars: min-max)")
    ax.set_title("A request to a port inside a sandbox")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
