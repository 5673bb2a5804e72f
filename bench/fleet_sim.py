#!/usr/bin/env python3
"""A discrete-event simulation (SimPy) of a Shoal fleet at DSec's load, fed only with costs measured
on this machine and the assumptions stated in ASSUMPTIONS (each printed and written with the result).

Measured inputs (read from the committed JSON):
  bench/results/fleet.json    gateway, PostgreSQL and host CPU per placement (null hosts); the gateway's
                              added latency per create and per exec; directory transactions per second
                              per thread (reserve + confirm); dead-host detection and resume times
  bench/results/api.json      a host's create latency through its API (p50, p99); exec p50; sandboxes
                              held by one 2-core host (500, daemon RSS flat)
  bench/results/startup.json  creations per second on 2 cores (in-process), i.e. host CPU per create

The model: creates arrive (Poisson) at the target rate, spread over T tenants. Each passes a gateway
replica (a single-core process: service = its CPU per placement), the tenant's row lock (held while
fleet_reserve runs in PostgreSQL: one tenant's creates serialize, by design, for an exact quota),
PostgreSQL (a pool of cores: service = its CPU per placement), the host's create (latency drawn from
a lognormal through the measured p50/p99; hosts are never short of cores at DSec's density), and
network hops. The confirm uses PostgreSQL's CPU but is off the create's path (batched by the gateway).
Output: create p50/p99, utilizations, each component's ceiling, hosts, gateway
replicas, PostgreSQL writes per second, and what breaks first.

    python bench/fleet_sim.py            # writes bench/results/fleet_sim.json
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

DSEC = {"creates_per_s": 5000, "concurrent": 380_000, "per_day": 3_000_000}

ASSUMPTIONS = {
    "node_threads": 384,  # DSec's CPU node: 2x AMD EPYC 9655 (96 cores x 2 SMT), shared/reference/sandbox.md
    "node_density": 3200,  # DSec's stable per-node point (containers); we measured no memory-bound density
    "host_headroom": 0.2,  # hosts kept free for a host loss and rolling restarts
    "gateway_core_util": 0.6,  # a gateway replica (one Python process = one core) is run to 60 % CPU
    "pg_cores": 64,  # the PostgreSQL server's cores
    "pg_util": 0.7,
    "hop_ms": 0.25,  # one network hop in a data centre (client->gateway, gateway->PG, gateway->host)
    # round trips while the tenant's row is locked: none. fleet_reserve takes the lock inside its one
    # call and commits at its end, so the lock is held for the function's run in the server only
    # (its share of PostgreSQL's CPU below); before it, a reserve held it across 6 round trips
    "reserve_statements": 0,
    "tool_calls_per_sandbox_s": 0.1,  # one tool call every 10 s per live sandbox (the agent waits on the LLM)
    "writes_per_tool_call": 2,  # trajectory log: the PENDING entry, then its result
    "lease_s": 10.0,  # production lease (heartbeat every lease/3)
    "sim_seconds": 10.0,
    "tenants": [1, 20, 100],  # DSec's load from one RL job (one tenant), or spread over 20 / 100
    "cpu_scale_to_server": 1.0,  # this machine's core = a server core (no speed-up assumed)
}


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def lognormal_from(p50: float, p99: float):
    mu = math.log(p50)
    sigma = max(1e-6, (math.log(p99) - mu) / 2.326)
    return lambda rng: rng.lognormvariate(mu, sigma)


def inputs() -> dict:
    f, api, st = load("fleet.json"), load("api.json"), load("startup.json")
    cpu = f["placements"]["cpu_ms_per_placement"]
    d = f["placements"]["directory_only"]
    split = d["postgres_cpu_split"]
    return {
        "gw_cpu_ms": cpu["gateways"]["median"],
        "pg_cpu_ms": cpu["postgres"]["median"],
        "host_api_cpu_ms": cpu["hosts"]["median"],
        # reserve + confirm per thread, serial, on this loaded 2-core machine (CPU queueing included)
        "reserve_confirm_ms": 1000 * d["threads"] / d["per_s"],
        "gateway_added_create_ms": f["overhead"]["create"]["added"]["median"],
        "gateway_added_exec_ms": f["overhead"]["exec"]["added"]["median"],
        "host_create_p50_ms": api["create"]["api"]["p50_ms"],
        "host_create_p99_ms": api["create"]["api"]["p99_ms"],
        "host_create_cpu_ms": 1000 * (st["host"]["cores"] / st["shoal"]["creations_per_s_2t"]),
        "host_held_per_core": api["hold"]["sandboxes"] / api["cores"],
        "detect_s": f["dead_host"]["detect_s"]["median"],
        "resume_all_s": f["dead_host"]["resume_all_s"]["median"],
        "measured_lease_s": f["lease_s"],
        "placements_per_s_here": f["placements"]["per_s"]["median"],
        # the reserve's share of PostgreSQL's CPU per placement (the rest: its confirm, batched off the
        # create's path), measured by bench/fleet.py with the confirms held back, then sent
        "reserve_pg_share": round(split["reserve_cpu_ms"]
                                  / (split["reserve_cpu_ms"] + split["confirm_cpu_ms_batched"]), 3),
    }


def lock_hold_ms(m: dict, a: dict) -> float:
    """How long one reserve holds its tenant's row lock: its PostgreSQL CPU plus its round trips."""
    return m["pg_cpu_ms"] * m["reserve_pg_share"] + a["reserve_statements"] * a["hop_ms"]


def simulate(m: dict, a: dict, rate: float, tenants: int, gateways: int, seed: int = 1) -> dict:
    import simpy

    rng = random.Random(seed)
    env = simpy.Environment()
    gw = [simpy.Resource(env, capacity=1) for _ in range(gateways)]
    pg = simpy.Resource(env, capacity=a["pg_cores"])
    locks = [simpy.Resource(env, capacity=1) for _ in range(tenants)]
    host_create = lognormal_from(m["host_create_p50_ms"], m["host_create_p99_ms"])
    hop = a["hop_ms"] / 1000
    lat: list[float] = []
    busy = {"gw": 0.0, "pg": 0.0}
    # the gateway's CPU is split: before the reserve (auth, parse), after (forward, confirm, answer)
    g_cpu = m["gw_cpu_ms"] / 1000
    p_cpu = m["pg_cpu_ms"] / 1000
    lock_hold = lock_hold_ms(m, a) / 1000

    def exp(mean: float) -> float:
        return rng.expovariate(1 / mean) if mean > 0 else 0.0

    def create(env, t_in: float):
        g = gw[rng.randrange(gateways)]
        yield env.timeout(hop)
        with g.request() as r:
            yield r
            s = exp(g_cpu / 2)
            busy["gw"] += s
            yield env.timeout(s)
        lock = locks[rng.randrange(tenants)]
        with lock.request() as r:  # the tenant's row lock, held through the reserve transaction
            yield r
            with pg.request() as q:
                yield q
                s = exp(p_cpu * m["reserve_pg_share"])
                busy["pg"] += s
                yield env.timeout(s)
            yield env.timeout(max(0.0, lock_hold - p_cpu * m["reserve_pg_share"]))  # the round trips
        yield env.timeout(2 * hop + host_create(rng) / 1000)  # the host creates
        env.process(confirm(env))  # off the create's path: the gateway answers without waiting for it
        with g.request() as r:
            yield r
            s = exp(g_cpu / 2)
            busy["gw"] += s
            yield env.timeout(s + hop)
        if env.now > a["sim_seconds"] * 0.2:  # after warm-up
            lat.append(env.now - t_in)

    def confirm(env):
        with pg.request() as q:  # batched in the gateway: its PostgreSQL CPU still counts
            yield q
            s = exp(p_cpu * (1 - m["reserve_pg_share"]))
            busy["pg"] += s
            yield env.timeout(s)

    def arrivals(env):
        while env.now < a["sim_seconds"]:
            yield env.timeout(rng.expovariate(rate))
            env.process(create(env, env.now))

    env.process(arrivals(env))
    env.run(until=a["sim_seconds"] * 1.5)
    done = len(lat)
    expected = rate * a["sim_seconds"] * 0.8
    lat.sort()
    return {"tenants": tenants, "gateways": gateways, "rate": rate,
            "completed_share": round(done / expected, 3) if expected else None,
            "p50_ms": round(statistics.median(lat) * 1000, 2) if lat else None,
            "p99_ms": round(lat[min(done - 1, int(0.99 * done))] * 1000, 2) if lat else None,
            "gw_util": round(busy["gw"] / (gateways * a["sim_seconds"]), 3),
            "pg_util": round(busy["pg"] / (a["pg_cores"] * a["sim_seconds"]), 3)}


def plan(m: dict, a: dict) -> dict:
    rate, conc = DSEC["creates_per_s"], DSEC["concurrent"]
    # hosts: concurrency at the assumed density, creation rate at the measured per-core host CPU
    per_host_conc = min(a["node_density"], m["host_held_per_core"] * a["node_threads"])
    host_create_cap = a["node_threads"] * 1000 / (m["host_create_cpu_ms"] + m["host_api_cpu_ms"])
    hosts_conc = conc / per_host_conc
    hosts_rate = rate / host_create_cap
    hosts = math.ceil(max(hosts_conc, hosts_rate) * (1 + a["host_headroom"]))
    gw_cap = 1000 / m["gw_cpu_ms"]  # placements/s one replica does at 100 % of its core
    gateways = math.ceil(rate / (gw_cap * a["gateway_core_util"]))
    pg_cap = a["pg_cores"] * a["pg_util"] * 1000 / m["pg_cpu_ms"]
    tenant_cap = 1000 / lock_hold_ms(m, a)
    heartbeats = hosts / (a["lease_s"] / 3)
    writes = {"directory (reserve, confirm, end)": 3 * rate,
              "heartbeats": round(heartbeats, 1),
              "trajectory log": conc * a["tool_calls_per_sandbox_s"] * a["writes_per_tool_call"],
              "episode queue (claim, heartbeat, finish)": round(3 * DSEC["per_day"] / 86400, 1)}
    ceilings = {"one tenant's row lock (creates/s per tenant)": round(tenant_cap, 1),
                "PostgreSQL CPU (placements/s)": round(pg_cap, 1),
                "a gateway replica (placements/s)": round(gw_cap, 1),
                "a host (creates/s)": round(host_create_cap, 1)}
    return {"hosts": hosts, "hosts_for_concurrency": math.ceil(hosts_conc), "hosts_for_rate": math.ceil(hosts_rate),
            "per_host_concurrent": per_host_conc, "gateway_replicas": gateways, "pg_writes_per_s": writes,
            "pg_writes_total_per_s": round(sum(writes.values())), "ceilings": ceilings,
            "pg_cpu_util_at_peak": round(rate / pg_cap, 3)}


def table_rows(res: dict) -> list[list[str]]:
    """docs/scale.md's table (tests/test_docs_numbers.py checks the doc against fleet_sim.json with it)."""
    p, sims = res["plan"], {s["tenants"]: s for s in res["simulations"]}
    w = p["pg_writes_per_s"]
    rows = [["hosts needed", f"{p['hosts']} ({p['hosts_for_concurrency']} for 380,000 at "
             f"{p['per_host_concurrent']:,} per host, + {res['assumptions']['host_headroom'] * 100:.0f}% headroom; "
             f"{p['hosts_for_rate']} for 5,000 creates/s)"],
            ["gateway replicas (one core each, 60% busy)", f"{p['gateway_replicas']}"],
            ["PostgreSQL writes/s", f"{p['pg_writes_total_per_s']:,} (directory "
             f"{w['directory (reserve, confirm, end)']:,.0f}, trajectory log {w['trajectory log']:,.0f}, "
             f"heartbeats {w['heartbeats']:,.0f}, queue "
             f"{w['episode queue (claim, heartbeat, finish)']:,.0f})"],
            ["PostgreSQL CPU at 5,000 placements/s", f"{p['pg_cpu_util_at_peak'] * 100:.0f}% of the assumed server"]]
    for t, s in sims.items():
        rows.append([f"create p50 / p99, {t} tenant{'s' if t > 1 else ''}",
                     f"{s['p50_ms']:,.1f} / {s['p99_ms']:,.1f} ms "
                     f"({s['completed_share'] * 100:.0f}% of creates served)"])
    for b in res["breaks_first"]:
        rows.append([f"ceiling: {b['component']}", f"{b['ceiling']:,.0f} (needed {b['needed']:,})"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(RESULTS / "fleet_sim.json"))
    a = ap.parse_args()
    asm = dict(ASSUMPTIONS)
    m = inputs()
    p = plan(m, asm)
    sims = []
    t0 = time.monotonic()
    for tenants in asm["tenants"]:
        sims.append(simulate(m, asm, DSEC["creates_per_s"], tenants, p["gateway_replicas"]))
    breaks = []
    for what, cap in p["ceilings"].items():
        need = DSEC["creates_per_s"]
        if "tenant" in what:
            breaks.append({"component": what, "ceiling": cap, "needed": need, "ok": cap >= need,
                           "fix": f"spread the load over >= {math.ceil(need / cap)} tenants (sub-keys with a "
                                  "share of the quota each), or group concurrent creates of a tenant into one "
                                  "fleet_reserve call"})
        elif "PostgreSQL" in what:
            breaks.append({"component": what, "ceiling": cap, "needed": need, "ok": cap >= need,
                           "fix": "shard the directory by tenant (docs/scale.md)"})
    res = {"date": time.strftime("%Y-%m-%d"), "load": DSEC, "measured": m, "assumptions": asm, "plan": p,
           "simulations": sims, "breaks_first": sorted(breaks, key=lambda b: b["ceiling"] / b["needed"]),
           "sim_wall_s": round(time.monotonic() - t0, 1)}
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    for row in table_rows(res):
        print("| " + " | ".join(row) + " |")
    json.dump({"plan": p, "simulations": sims, "breaks_first": res["breaks_first"]}, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
