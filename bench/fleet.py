#!/usr/bin/env python3
"""The fleet's costs on this machine: a 3-host fleet in network namespaces (tests/fleet/fleetctl.py),
2 gateways, a private PostgreSQL (tests/pgctl.py: fsync off, as in the tests).

  1. gateway overhead: exec (`true`) and create on a host called directly (mTLS, the gateway's own
     client certificate) vs the same through a gateway, interleaved call by call (direct, gateway,
     direct, ...), --runs runs; added p50 = p50(gateway) - p50(direct) per run, min/median/max;
  2. placements per second: the same fleet with *null* hosts (bench/fleet_nullhost.py: the real
     shoald, API, mTLS, admission, idempotency records and fleet agent, over a backend that starts
     nothing), loaded by client processes creating through both gateways for --place-s seconds, --runs
     runs; CPU seconds used by the gateways, PostgreSQL and the hosts per placement; and the
     directory alone (reserve + confirm transactions from threads, no HTTP);
  3. a dead host: a rollout of --episodes episodes through the gateways (the CounterTask of
     tests/fleet/test_rollout.py), the busiest host SIGKILLed mid-run with its sandboxes: time until
     the directory marks it down and its sandboxes LOST (detection: from then on calls on them raise
     SandboxLost) and until the last episode that was on it is done elsewhere (resume; the database's
     clock), --kill-runs runs.

Writes bench/results/fleet.json and fleet.png; prints a table. Needs root (namespaces, sandboxes).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import signal
import statistics
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "fleet"))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from startup import pct  # noqa: E402

from shoal.core import errors as E  # noqa: E402
from shoal.core.contract import CreateRequest, ExecRequest  # noqa: E402

console = Console(width=140)
RESULTS = HERE / "results"
IMAGE = "busybox:test"


def spread(xs: list[float], nd: int = 3) -> dict:
    return {"min": round(min(xs), nd), "median": round(statistics.median(xs), nd), "max": round(max(xs), nd)}


def load() -> float:
    return round(os.getloadavg()[0], 2)


def cpu_s(pid: int) -> float:
    """utime + stime of a process, seconds."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def children(ppid: int) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]) == ppid:
                    out.append(int(p.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


def pg_cpu(pg) -> float:
    """CPU seconds of the postmaster and its live backends (exited backends' time is lost: sampled
    with long-lived connections only, which is what the gateways and hosts hold)."""
    pm = int((pg.data / "postmaster.pid").read_text().split()[0])
    return cpu_s(pm) + sum(cpu_s(c) for c in children(pm))


# ------------------------------------------------------------------------------------- 1. overhead
def overhead(fleet, key: str, runs: int, n_exec: int, n_create: int) -> dict:
    from shoal import Sandbox
    from shoal.backends.http import HttpBackend
    from shoal.fleet.pki import gateway_client_context

    sb = Sandbox.create(IMAGE, url=fleet.gateways[0].url, api_key=key, memory_mb=64, disk_mb=16)
    host = fleet.host_of(sb.id)
    direct = HttpBackend(host.url, "", ssl_context=gateway_client_context(fleet.fleet_dir))
    via = HttpBackend(fleet.gateways[0].url, key)
    ex = ExecRequest(argv=["true"])
    cr = CreateRequest(image=IMAGE, memory_mb=64, disk_mb=16)
    out: dict = {"exec": {"direct": [], "gateway": [], "added": []}, "create": {"direct": [], "gateway": [],
                                                                              "added": []}}
    try:
        for _ in range(5):  # warm both paths (connections, directory caches)
            direct.exec(sb.id, ex)
            via.exec(sb.id, ex)
        for _ in range(runs):
            # the order alternates (direct first, then gateway first): a kill returns before its host
            # has torn the sandbox down, so whichever create follows a kill shares the host with that
            # teardown; each path follows each kind of kill equally often
            d, g = [], []
            for i in range(n_exec):
                for be, acc in ((direct, d), (via, g))[::1 if i % 2 == 0 else -1]:
                    t = time.perf_counter()
                    be.exec(sb.id, ex)
                    acc.append(time.perf_counter() - t)
            dc, gc = [], []
            for i in range(n_create):
                for be, acc in ((direct, dc), (via, gc))[::1 if i % 2 == 0 else -1]:
                    t = time.perf_counter()  # a fresh key on both paths, as the SDK sends (the host records it)
                    info = be.create(cr, idempotency_key=uuid.uuid4().hex)
                    acc.append(time.perf_counter() - t)
                    be.kill(info.id)
            for kind, dd, gg in (("exec", d, g), ("create", dc, gc)):
                a, b = statistics.median(dd) * 1000, statistics.median(gg) * 1000
                out[kind]["direct"].append(a)
                out[kind]["gateway"].append(b)
                out[kind]["added"].append(b - a)
                out[kind].setdefault("p99_direct", []).append(pct(dd, 0.99) * 1000)
                out[kind].setdefault("p99_gateway", []).append(pct(gg, 0.99) * 1000)
    finally:
        sb.kill()
        direct.close()
        via.close()
    res = {"n_exec_per_run": n_exec, "n_create_per_run": n_create, "runs": runs,
           "create_keys": "a fresh Idempotency-Key on both paths (as the SDK sends)",
           "order": "alternating call by call: direct then gateway, gateway then direct (before 2026-12-01 "
                    "direct always went first, so every gateway create followed a direct kill's teardown)"}
    for kind in ("exec", "create"):
        res[kind] = {k: spread(v) for k, v in out[kind].items()}
        res[kind]["per_run_added_p50_ms"] = [round(x, 3) for x in out[kind]["added"]]
    return res


# ------------------------------------------------------------------------------------- 2. placements
def _client(urls: list[str], keys: list[str], ca: str, seconds: float, threads: int, q) -> None:
    os.environ["SHOAL_CA_CERT"] = ca
    from shoal.backends.http import HttpBackend

    stop = time.monotonic() + seconds
    lat: list[float] = []
    errs: dict[str, int] = {}
    lock = threading.Lock()

    def one(i: int) -> None:
        be = HttpBackend(urls[i % len(urls)], keys[i % len(keys)])
        cr = CreateRequest(image=IMAGE, memory_mb=16, disk_mb=16, cpu=0.01)
        try:
            while time.monotonic() < stop:
                t = time.perf_counter()
                try:
                    be.create(cr)
                except E.ShoalError as e:
                    with lock:
                        errs[type(e).__name__] = errs.get(type(e).__name__, 0) + 1
                    continue
                dt = time.perf_counter() - t
                with lock:
                    lat.append(dt)
        finally:
            be.close()

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(threads)))
    q.put((lat, errs))


def placements(pg, seconds: float, runs: int, procs: int, threads: int, gateways: int, tenants: int = 8) -> dict:
    from fleetctl import build_fleet

    fleet = build_fleet(pg, serve_cmd=[sys.executable, str(HERE / "fleet_nullhost.py")],
                        serve_args=["--max-sandboxes", "1000000", "--creates-per-s", "1000000", "--max-starting",
                                    "256"], n_gateways=gateways)
    try:
        os.environ["SHOAL_CA_CERT"] = str(fleet.fleet_dir / "ca.pem")
        # several tenants: one tenant's creates serialize on its row lock (its quota check), by design
        keys = [fleet.tenant(f"place-{k}-{uuid.uuid4().hex[:6]}", sandboxes=10_000_000, cpu=1e9, memory_mb=1e12,
                             disk_mb=1e12) for k in range(tenants)]
        urls = [g.url for g in fleet.gateways]
        rows = []
        for r in range(runs):
            gw_pids = [g.proc.pid for g in fleet.gateways]
            host_pids = [h.proc.pid for h in fleet.hosts]
            c0 = (sum(cpu_s(p) for p in gw_pids), pg_cpu(pg), sum(cpu_s(p) for p in host_pids))
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            ca = str(fleet.fleet_dir / "ca.pem")
            ps = [ctx.Process(target=_client, args=(urls, keys[j::procs] or keys, ca, seconds, threads, q))
                  for j in range(procs)]
            t0 = time.monotonic()
            for p in ps:
                p.start()
            got = [q.get(timeout=seconds + 120) for _ in ps]
            for p in ps:
                p.join(30)
            wall = time.monotonic() - t0
            c1 = (sum(cpu_s(p) for p in gw_pids), pg_cpu(pg), sum(cpu_s(p) for p in host_pids))
            lat = [x for g in got for x in g[0]]
            errs: dict[str, int] = {}
            for g in got:
                for k, v in g[1].items():
                    errs[k] = errs.get(k, 0) + v
            n = len(lat)
            rows.append({"placed": n, "seconds": seconds, "per_s": round(n / seconds, 1), "wall_s": round(wall, 2),
                         "p50_ms": round(statistics.median(lat) * 1000, 2) if lat else None,
                         "p99_ms": round(pct(lat, 0.99) * 1000, 2) if lat else None, "errors": errs,
                         "cpu_ms_per_placement": {"gateways": round((c1[0] - c0[0]) / max(n, 1) * 1000, 3),
                                                  "postgres": round((c1[1] - c0[1]) / max(n, 1) * 1000, 3),
                                                  "hosts": round((c1[2] - c0[2]) / max(n, 1) * 1000, 3)},
                         "load_after": load()})
            console.print(f"  placements run {r + 1}: {rows[-1]}")
        direct = directory_rate(fleet.dsn, seconds=min(seconds, 5.0), threads=8, pg=pg)
        with __import__("psycopg").connect(fleet.dsn, autocommit=True) as c:
            live_rows = c.execute("SELECT count(*) FROM fleet_sandboxes").fetchone()[0]
    finally:
        fleet.close()
    per_s = [r["per_s"] for r in rows]
    cpu = {k: spread([r["cpu_ms_per_placement"][k] for r in rows]) for k in ("gateways", "postgres", "hosts")}
    return {"client_processes": procs, "threads_per_process": threads, "gateways": gateways, "hosts": 3,
            "tenants": tenants,
            "backend": "null (bench/fleet_nullhost.py: real shoald, no sandbox started)",
            "per_s": spread(per_s, 1), "p50_ms": spread([r["p50_ms"] for r in rows], 2),
            "p99_ms": spread([r["p99_ms"] for r in rows], 2), "cpu_ms_per_placement": cpu,
            "directory_rows_at_end": live_rows, "runs": rows, "directory_only": direct}


def directory_rate(dsn: str, seconds: float, threads: int, pg=None) -> dict:
    """reserve + confirm straight on the Directory (what a gateway does in PostgreSQL per create;
    confirms batched in the background, as a gateway sends them), from `threads` threads with their
    own connections, one tenant each (no tenant lock contention). With `pg`, then PostgreSQL's CPU
    per placement split between the reserves (confirms held back) and their batched confirms."""
    from shoal.core.contract import Limits, SandboxInfo, SandboxState
    from shoal.fleet import placement
    from shoal.fleet.directory import Directory
    from shoal.fleet.schema import open_db
    from shoal.server.state import Tenant

    d = Directory(open_db(dsn))
    import psycopg
    from psycopg.types.json import Jsonb

    with psycopg.connect(dsn, autocommit=True) as c:
        for i in range(threads):
            c.execute("INSERT INTO fleet_tenants(name, key_hash, quotas, created) VALUES (%s, %s, %s, 0) "
                      "ON CONFLICT DO NOTHING", (f"dir-{i}", uuid.uuid4().hex,
                                                 Jsonb({"sandboxes": 1e9, "cpu": 1e9, "memory_mb": 1e12,
                                                        "disk_mb": 1e12})))
    # its own hosts, registered in the directory only, under a long lease: the fleet's hosts would
    # end these rows (their sandboxes do not exist there), and their agents' work would be measured
    real = d.up_hosts()
    inv = {"images": [{"ref": IMAGE, "layers": [], "created": 0.0}], "cached": {}}
    for k in range(3):
        d.register(f"dirh{k}", f"https://dirh{k}.invalid", f"dom{k}", 3600.0, {"sandboxes": 10**9, "memory_mb": 10**12},
                   {}, inv, f"dirh-inv-{k}")
    lim = Limits(cpu=0.01, memory_mb=16, disk_mb=16)
    errors: list[str] = []

    def run(for_s: float) -> int:
        stop = time.monotonic() + for_s
        counts = [0] * threads

        def one(i: int) -> None:
            t = Tenant(name=f"dir-{i}")
            want = placement.Wanted(refs=(IMAGE,), memory_mb=lim.memory_mb)
            while time.monotonic() < stop:
                try:
                    slot = d.reserve(t, lim, want, None, avoid=real)
                    info = SandboxInfo(id=f"sb-x-{uuid.uuid4().hex[:12]}", image=IMAGE, layers=[], limits=lim,
                                       state=SandboxState.RUNNING, created=time.time())
                    if confirms is None:  # the code before background confirms (before/after runs)
                        d.confirm(slot.slot, info)
                    else:
                        confirms.submit(slot.slot, info)
                    counts[i] += 1
                except Exception as e:  # noqa: BLE001 - counted, shown
                    errors.append(f"{type(e).__name__}: {e}"[:200])
                    if len(errors) > 20:
                        return

        list(pool.map(one, range(threads)))
        return sum(counts)

    confirms = getattr(d, "confirms", None)
    with ThreadPoolExecutor(threads) as pool:  # one pool: its threads' connections live through both parts
        t0 = time.monotonic()
        n = run(seconds)
        if confirms is not None:
            confirms.flush(60)  # every confirm landed (batched in the background, as in a gateway)
        wall = time.monotonic() - t0
        split = None
        if pg is not None and confirms is not None:
            confirms.held = True
            c0 = pg_cpu(pg)
            nb = run(2.0)
            c1 = pg_cpu(pg)
            confirms.held = False
            confirms.flush(60)
            c2 = pg_cpu(pg)
            split = {"placements": nb, "reserve_cpu_ms": round((c1 - c0) / max(nb, 1) * 1000, 3),
                     "confirm_cpu_ms_batched": round((c2 - c1) / max(nb, 1) * 1000, 3)}
    return {"threads": threads, "seconds": round(wall, 2), "placed": n, "per_s": round(n / wall, 1),
            "confirms": "batched in the background (Directory.confirms), as a gateway does",
            "postgres_cpu_split": split, "errors": errors[:5]}


# ------------------------------------------------------------------------------------- 3. dead host
def dead_host(fleet, pg, episodes: int) -> dict:
    import psycopg
    from test_rollout import SCRIPT, CounterTask

    from shoal import Host
    from shoal.rollout.runner import Rollout
    from shoal.rollout.worker import Worker

    dsn = pg.new_database()
    key = fleet.tenant(f"dead-{uuid.uuid4().hex[:6]}", sandboxes=40, cpu=64, memory_mb=16384, disk_mb=16384)
    ro = Rollout(dsn)
    ro.submit([CounterTask()], {"kind": "script", "actions": SCRIPT}, repeats=episodes)
    workers = [Worker(dsn, url=fleet.url, api_key=key, tasks=[CounterTask()], concurrency=6, create_rate=200,
                      lease_s=20, node=f"w{i}") for i in (1, 2)]
    threads = [threading.Thread(target=lambda w=w: asyncio.run(w.run()), daemon=True) for w in workers]
    for t in threads:
        t.start()
    victim = None
    while victim is None:
        if ro.counts()["done"] >= episodes // 3:
            busiest = max(fleet.hosts, key=lambda h: len(fleet.local_ids(h)))
            if fleet.local_ids(busiest):
                victim = busiest
        time.sleep(0.02)
    with psycopg.connect(dsn, autocommit=True) as c:
        t_db = c.execute("SELECT extract(epoch from clock_timestamp())").fetchone()[0]
    t0 = time.monotonic()
    fleet.stop_host(victim, signal.SIGKILL)
    lost = Host.get(victim.root)
    for sid in lost.live_ids():
        try:
            lost.kill(sid)
        except E.ShoalError:
            pass
    detect = None  # the directory marks the host down and its sandboxes LOST (what SandboxLost reports)
    with psycopg.connect(fleet.dsn, autocommit=True) as c:
        while detect is None and time.monotonic() - t0 < 60:
            if c.execute("SELECT state FROM fleet_hosts WHERE id=%s", (victim.name,)).fetchone()[0] == "down":
                detect = time.monotonic() - t0
            time.sleep(0.02)
    for t in threads:
        t.join(120)
    fleet.start_host(victim)
    counts = ro.counts()
    recs = ro.records()
    moved = [r["episode_id"] for r in recs if r["extra"].get("moves")]
    with psycopg.connect(dsn, autocommit=True) as c:
        last = c.execute("SELECT max(finished) FROM episodes WHERE id = ANY(%s)", (moved,)).fetchone()[0]
    return {"episodes": episodes, "done": counts["done"], "failed": counts["failed"], "moved": len(moved),
            "detect_s": round(detect, 2) if detect is not None else None,
            "resume_all_s": round(float(last) - float(t_db), 2) if last else None, "victim": victim.name}


# ------------------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--exec-n", type=int, default=200)
    ap.add_argument("--create-n", type=int, default=100)
    ap.add_argument("--place-s", type=float, default=8.0)
    ap.add_argument("--clients", type=int, default=2, help="client processes for the placement load")
    ap.add_argument("--threads", type=int, default=16, help="threads per client process")
    ap.add_argument("--episodes", type=int, default=60)
    ap.add_argument("--kill-runs", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "fleet.json"))
    ap.add_argument("--only-placements", action="store_true", help="just part 2 (printed; --part-out writes it)")
    ap.add_argument("--only-overhead", action="store_true", help="just part 1 (printed; --part-out writes it)")
    ap.add_argument("--part-out", help="with --only-*: write that part's JSON here (before/after comparisons)")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/fleet.py needs root (network namespaces, sandboxes)")

    from fleetctl import LEASE_S, build_fleet
    from pgctl import PgServer

    from shoal.backends.container.native import build

    build()
    import logging

    logging.getLogger("shoal.rollout").setLevel(logging.ERROR)  # each move logs a warning
    res: dict = {"date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count(), "load_avg_before": load(),
                 "postgres": "Debian's PostgreSQL, private instance, fsync=off synchronous_commit=off (as tests)",
                 "lease_s": LEASE_S}
    pg = PgServer()
    if a.only_placements or a.only_overhead:
        try:
            if a.only_placements:
                res["placements"] = placements(pg, a.place_s, a.runs, a.clients, a.threads, gateways=2)
            else:
                fleet = build_fleet(pg)
                try:
                    os.environ["SHOAL_CA_CERT"] = str(fleet.fleet_dir / "ca.pem")
                    key = fleet.tenant(f"bench-{uuid.uuid4().hex[:6]}", sandboxes=64, cpu=64, memory_mb=65536,
                                       disk_mb=65536)
                    res["overhead"] = overhead(fleet, key, a.runs, a.exec_n, a.create_n)
                finally:
                    fleet.close()
        finally:
            pg.close()
        res["load_avg_after"] = load()
        console.print(res)
        if a.part_out:
            Path(a.part_out).write_text(json.dumps(res, indent=1) + "\n")
        return
    try:
        console.print("[bold]1. gateway overhead, 2. dead host[/]  (real fleet)")
        fleet = build_fleet(pg)
        try:
            os.environ["SHOAL_CA_CERT"] = str(fleet.fleet_dir / "ca.pem")
            key = fleet.tenant(f"bench-{uuid.uuid4().hex[:6]}", sandboxes=64, cpu=64, memory_mb=65536,
                               disk_mb=65536)
            res["overhead"] = overhead(fleet, key, a.runs, a.exec_n, a.create_n)
            console.print(res["overhead"])
            kills = []
            for r in range(a.kill_runs):
                kills.append(dead_host(fleet, pg, a.episodes))
                console.print(f"  kill run {r + 1}: {kills[-1]}")
            res["dead_host"] = {"runs": kills, "detect_s": spread([k["detect_s"] for k in kills], 2),
                                "resume_all_s": spread([k["resume_all_s"] for k in kills], 2),
                                "lost_or_failed": sum(k["episodes"] - k["done"] + k["failed"] for k in kills)}
        finally:
            fleet.close()
        console.print("[bold]3. placements per second[/]  (null hosts)")
        res["placements"] = placements(pg, a.place_s, a.runs, a.clients, a.threads, gateways=2)
    finally:
        pg.close()
    res["load_avg_after"] = load()
    res["goals"] = goals(res)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    table(res)
    plot(res, Path(a.out).with_suffix(".png"))


def goals(res: dict) -> dict:
    o, p, d = res["overhead"], res["placements"], res["dead_host"]
    return {"exec_added_p50_ms<=3": o["exec"]["added"]["median"] <= 3,
            "create_added_p50_ms<=3": o["create"]["added"]["median"] <= 3,
            "placements_per_s>=2000": p["per_s"]["median"] >= 2000,
            "detect_and_resume_s<=15": d["resume_all_s"]["max"] <= 15}


def table(res: dict) -> None:
    t = Table(title="fleet (bench/fleet.py)")
    for c in ("measure", "median [min–max]", "goal", "met"):
        t.add_column(c)
    for label, m, goal, ok in rows(res):
        t.add_row(label, m, goal, ok)
    console.print(t)


def rows(res: dict) -> list[list[str]]:
    """The README's Fleet table (tests/test_docs_numbers.py renders it from fleet.json with this)."""
    def sp(m: dict, fmt: str) -> str:
        return f"{m['median']:{fmt}} [{m['min']:{fmt}}–{m['max']:{fmt}}]"

    o, p, d, g = res["overhead"], res["placements"], res["dead_host"], res["goals"]
    yes = lambda b: "yes" if b else "no"  # noqa: E731
    return [
        ["exec p50, host direct → via gateway (ms)",
         f"{sp(o['exec']['direct'], '.1f')} → {sp(o['exec']['gateway'], '.1f')}", "", ""],
        ["gateway added per exec, p50 (ms)", sp(o["exec"]["added"], ".2f"), "≤ 3", yes(g["exec_added_p50_ms<=3"])],
        ["create p50, host direct → via gateway (ms)",
         f"{sp(o['create']['direct'], '.1f')} → {sp(o['create']['gateway'], '.1f')}", "", ""],
        ["gateway added per create, p50 (ms)", sp(o["create"]["added"], ".2f"), "≤ 3",
         yes(g["create_added_p50_ms<=3"])],
        ["placements/s, 2 gateways + PostgreSQL, null hosts", sp(p["per_s"], ".0f"), "≥ 2,000",
         yes(g["placements_per_s>=2000"])],
        ["placements/s, directory transactions alone", f"{p['directory_only']['per_s']:.0f}", "", ""],
        [f"dead host detected (lease {res['lease_s']:.0f} s)", sp(d["detect_s"], ".1f"), "", ""],
        ["dead host: its episodes all done elsewhere (s)", sp(d["resume_all_s"], ".1f"), "≤ 15",
         yes(g["detect_and_resume_s<=15"])],
    ]


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    o, p, d = res["overhead"], res["placements"], res["dead_host"]
    fig, ax = plt.subplots(1, 3, figsize=(14, 4))
    for i, kind in enumerate(("exec", "create")):
        x = [i * 3, i * 3 + 1]
        med = [o[kind]["direct"]["median"], o[kind]["gateway"]["median"]]
        lo = [med[0] - o[kind]["direct"]["min"], med[1] - o[kind]["gateway"]["min"]]
        hi = [o[kind]["direct"]["max"] - med[0], o[kind]["gateway"]["max"] - med[1]]
        ax[0].bar(x, med, yerr=[lo, hi], color=["tab:gray", "tab:blue"], capsize=4)
    ax[0].set_xticks([0, 1, 3, 4], ["exec\ndirect", "exec\ngateway", "create\ndirect", "create\ngateway"])
    ax[0].set_ylabel("p50 ms (min–max over runs)")
    ax[0].set_title("gateway overhead")
    runs = p["runs"]
    ax[1].bar(range(len(runs)), [r["per_s"] for r in runs], color="tab:blue")
    ax[1].axhline(2000, color="tab:red", ls="--", label="goal 2,000/s")
    ax[1].set_xlabel("run")
    ax[1].set_ylabel("placements / s")
    ax[1].set_title("placements (null hosts)")
    ax[1].legend()
    k = d["runs"]
    ax[2].bar([i - 0.2 for i in range(len(k))], [r["detect_s"] for r in k], 0.4, label="detected (SandboxLost)")
    ax[2].bar([i + 0.2 for i in range(len(k))], [r["resume_all_s"] for r in k], 0.4, label="its episodes done")
    ax[2].axhline(15, color="tab:red", ls="--", label="goal 15 s")
    ax[2].set_xlabel("run")
    ax[2].set_ylabel("s after SIGKILL")
    ax[2].set_title(f"dead host (lease {res['lease_s']:.0f} s)")
    ax[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
