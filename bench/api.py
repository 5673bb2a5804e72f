#!/usr/bin/env python3
"""API benchmark and load test: shoald over its Unix socket vs in-process, and N concurrent sandboxes.

  * exec round trip of `echo` through the HTTP API vs in-process (p50/p99);
  * create (+ kill) through the API vs in-process: the API's added latency;
  * hold N (default 500) sandboxes created through the API by 16 client threads (admission
    refusals are retried, as a client should), drive an exec churn over them for --churn-s seconds,
    then kill them all and check that nothing leaked (mounts, cgroups, state dirs, daemon fds) and
    that the daemon's RSS stayed flat.

Every measurement runs --runs times (default 3); latencies are pooled over the runs and each one
also records the min/median/max of its per-run p50.

Starts its own shoald on a private root; writes bench/results/api.json and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from startup import pct  # noqa: E402

from shoal import Host, QuotaExceeded, Sandbox  # noqa: E402
from shoal.backends.container.cgroups import CgroupDriver, cgroup_parent  # noqa: E402
from shoal.backends.http import close_clients  # noqa: E402
from shoal.layers.busybox import make_busybox_tree  # noqa: E402

console = Console(width=140)
RESULTS = Path(__file__).parent / "results"


def ms(xs: list[float]) -> dict:
    v = [x * 1000 for x in xs]
    return {"n": len(v), "p50_ms": round(statistics.median(v), 3), "p99_ms": round(pct(v, 0.99), 3)}


def pooled(runs: list[list[float]]) -> dict:
    """p50/p99 over every sample of every run, plus min/median/max of the per-run p50s."""
    out = ms([x for r in runs for x in r])
    p50s = sorted(statistics.median(r) * 1000 for r in runs)
    out["p50_runs_ms"] = {"min": round(p50s[0], 3), "median": round(statistics.median(p50s), 3),
                          "max": round(p50s[-1], 3)}
    return out


def spread(values: list[float], nd: int = 1) -> dict:
    v = sorted(values)
    return {"min": round(v[0], nd), "median": round(statistics.median(v), nd), "max": round(v[-1], nd)}


def rss_kb(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def leftovers(root: Path) -> dict:
    mounts = sum(1 for l in open("/proc/self/mountinfo") if str(root / "sandboxes") in l)
    cgroups = len(CgroupDriver.detect(cgroup_parent(root)).list_ids())  # counted, not swept
    state = sum(1 for _ in (root / "sandboxes").iterdir()) if (root / "sandboxes").exists() else 0
    return {"mounts": mounts, "cgroups": cgroups, "state_dirs": state}


def start_daemon(root: Path) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, SHOAL_ROOT=str(root))
    env.pop("SHOAL_URL", None)
    sock = root / "shoald.sock"  # private: the host daemon's /run/shoal/shoald.sock is left alone
    proc = subprocess.Popen([sys.executable, "-m", "shoal.cli", "serve", "--socket", str(sock),
                             "--max-sandboxes", "2048"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            if sock.exists() and httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)),
                                              base_url="http://x").get("/v1/health").status_code == 200:
                return proc, f"unix://{sock}"
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    proc.kill()
    raise SystemExit("shoald did not start")


def create_retrying(image: str, url: str, refusals: list[int]) -> Sandbox:
    delay = 0.01
    while True:
        try:
            return Sandbox.create(image, url=url, memory_mb=64, disk_mb=16, pids=64, cpu=0.1)
        except QuotaExceeded:
            refusals.append(1)
            time.sleep(delay + random.random() * delay)
            delay = min(delay * 2, 0.5)


def hold_and_churn(proc: subprocess.Popen, root: Path, image: str, url: str, hold: int, churn_s: float) -> dict:
    """Hold `hold` sandboxes created through the API by 16 clients, drive an exec churn over them,
    kill them all, and report throughput, the daemon's RSS and fds, and anything left behind."""
    rss0 = rss_kb(proc.pid)
    fds0 = len(os.listdir(f"/proc/{proc.pid}/fd"))
    refusals: list[int] = []
    t0 = time.perf_counter()
    with ThreadPoolExecutor(16) as ex:
        held = list(ex.map(lambda _: create_retrying(image, url, refusals), range(hold)))
    create_wall = time.perf_counter() - t0
    live = len(Sandbox.list(url=url))
    rss_full = rss_kb(proc.pid)
    counts = {"ok": 0, "errors": 0}
    err_examples: list[str] = []
    stop = time.monotonic() + churn_s
    lock = threading.Lock()

    def churn():
        rnd = random.Random()
        while time.monotonic() < stop:
            sb = rnd.choice(held)
            try:
                r = sb.commands.run(["sh", "-c", "echo $HOSTNAME"], timeout=30)
                ok = r.exit_code == 0 and r.stdout.strip() == sb.id
            except Exception as e:  # counted, reported
                ok = False
                with lock:
                    err_examples.append(repr(e)[:200])
            with lock:
                counts["ok" if ok else "errors"] += 1

    t1 = time.perf_counter()
    threads = [threading.Thread(target=churn) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    churn_wall = time.perf_counter() - t1
    rss_churn = rss_kb(proc.pid)
    with ThreadPoolExecutor(16) as ex:
        list(ex.map(lambda sb: sb.kill(), held))
    close_clients()  # our 16 keep-alive connections would otherwise count as daemon fds
    time.sleep(1)
    left = leftovers(root)
    fds1 = len(os.listdir(f"/proc/{proc.pid}/fd"))
    return {"sandboxes": hold, "live_seen": live, "create_wall_s": round(create_wall, 2),
            "admission_refusals_retried": len(refusals), "churn_s": round(churn_wall, 1),
            "execs_ok": counts["ok"], "exec_errors": counts["errors"], "error_examples": err_examples[:3],
            "execs_per_s": round(counts["ok"] / churn_wall, 1),
            "daemon_rss_kb": {"before": rss0, "holding": rss_full, "after_churn": rss_churn,
                              "after_kill": rss_kb(proc.pid)},
            "daemon_fds": {"before": fds0, "after": fds1}, "leftovers_after_kill": left}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=200, help="iterations of the latency measurements")
    ap.add_argument("--hold", type=int, default=500, help="concurrent sandboxes held through the API")
    ap.add_argument("--churn-s", type=float, default=20.0, help="seconds of exec churn over them")
    ap.add_argument("--runs", type=int, default=3, help="runs of every measurement (spread = min/median/max)")
    ap.add_argument("--out", default=str(RESULTS / "api.json"))
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="shoal-api-", dir="/tmp"))
    host = Host.get(root)
    with tempfile.TemporaryDirectory() as d:
        host.store.build_from_dir(make_busybox_tree(Path(d) / "bb"), name="busybox")
    image = "bench:busybox"
    host.store.create_image(image, ["busybox"])
    proc, url = start_daemon(root)
    res: dict = {"date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count(), "runs": args.runs,
                 "load_avg_before": round(os.getloadavg()[0], 2)}
    lat: dict[str, list[list[float]]] = {"in_process": [], "api": []}
    clat: dict[str, list[list[float]]] = {"in_process": [], "api": []}
    holds: list[dict] = []
    try:
        for run in range(args.runs):
            # -------------------------------------------------------- latency: exec (interleaved)
            local = Sandbox.create(image, root=root, url="local")
            remote = Sandbox.create(image, url=url)
            for sb in (local, remote):
                for _ in range(20):
                    sb.commands.run(["echo", "x"])
            for name in lat:
                lat[name].append([])
            for _ in range(args.n):
                for name, sb in (("in_process", local), ("api", remote)):
                    t0 = time.perf_counter()
                    sb.commands.run(["echo", "x"])
                    lat[name][-1].append(time.perf_counter() - t0)
            local.kill()
            remote.kill()

            # -------------------------------------------------------- latency: create (interleaved)
            for name in clat:
                clat[name].append([])
            for _ in range(max(20, args.n // 4)):
                for name, kw in (("in_process", {"root": root, "url": "local"}), ("api", {"url": url})):
                    t0 = time.perf_counter()
                    sb = Sandbox.create(image, **kw)
                    clat[name][-1].append(time.perf_counter() - t0)
                    sb.kill()

            # -------------------------------------------------------- hold N and churn
            holds.append(hold_and_churn(proc, root, image, url, args.hold, args.churn_s))
            console.print(f"run {run + 1}/{args.runs}: exec p50 in-process "
                          f"{statistics.median(lat['in_process'][-1]) * 1000:.2f} ms, api "
                          f"{statistics.median(lat['api'][-1]) * 1000:.2f} ms; {holds[-1]['execs_per_s']} execs/s")
        res["exec_echo"] = {k: pooled(v) for k, v in lat.items()}
        res["create"] = {k: pooled(v) for k, v in clat.items()}
        res["create"]["api_overhead_p50_ms"] = round(res["create"]["api"]["p50_ms"] -
                                                     res["create"]["in_process"]["p50_ms"], 3)
        res["hold"] = dict(holds[-1], runs=holds,
                           execs_per_s_runs=spread([h["execs_per_s"] for h in holds]),
                           create_wall_s_runs=spread([h["create_wall_s"] for h in holds], 2),
                           exec_errors=sum(h["exec_errors"] for h in holds))
        res["load_avg_after"] = round(os.getloadavg()[0], 2)
    finally:
        proc.terminate()
        proc.wait(30)
        host.gc()
        host.store.gc(keep_named=False)
        subprocess.run(["rm", "-rf", str(root)])

    t = Table(title=f"shoald API on this machine ({res['date']}, {res['cores']} cores)")
    for c in ("measurement", "p50", "p99", "goal"):
        t.add_column(c)
    e, c = res["exec_echo"], res["create"]
    t.add_row("exec `echo`, in-process", f"{e['in_process']['p50_ms']:.2f} ms", f"{e['in_process']['p99_ms']:.2f} ms",
              "<= 2 ms")
    t.add_row("exec `echo`, through the API", f"{e['api']['p50_ms']:.2f} ms", f"{e['api']['p99_ms']:.2f} ms", "<= 5 ms")
    t.add_row("create, in-process", f"{c['in_process']['p50_ms']:.2f} ms", f"{c['in_process']['p99_ms']:.2f} ms", "")
    t.add_row("create, through the API", f"{c['api']['p50_ms']:.2f} ms", f"{c['api']['p99_ms']:.2f} ms",
              f"adds {c['api_overhead_p50_ms']:.2f} ms (goal <= 5 ms)")
    h = res["hold"]
    t.add_row(f"hold {h['sandboxes']} sandboxes via API", f"{h['create_wall_s']} s to create",
              f"{h['admission_refusals_retried']} refusals retried", f"live seen: {h['live_seen']}")
    t.add_row(f"exec churn {h['churn_s']} s, 16 clients", f"{h['execs_per_s']} execs/s",
              f"{h['exec_errors']} errors", "no errors")
    r = h["daemon_rss_kb"]
    t.add_row("daemon RSS (KiB)", f"{r['before']} -> {r['holding']} -> {r['after_churn']} -> {r['after_kill']}", "",
              "flat")
    t.add_row("leftovers after kill", json.dumps(h["leftovers_after_kill"]),
              f"fds {h['daemon_fds']['before']} -> {h['daemon_fds']['after']}", "none")
    console.print(t)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
