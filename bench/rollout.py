#!/usr/bin/env python3
"""Trajectory log and rollout benchmark.

  * log overhead: exec `true` in a python:3.11 sandbox directly vs through the trajectory log
    (interleaved, same sandbox), medians and the ratio (goal: <= 5% of the round trip);
  * fast-forward: record R exec steps, then replay them from a restarted client (goal: >= 5,000
    steps/s);
  * the bundled SWE suite through the full agent loop: --episodes oracle episodes (goal: 1,000,
    100% resolved) plus one null and one random-edit episode per task (null: 0%), on worker
    processes; at --kill-at of the run one worker is killed with SIGKILL and a new one started.
    Afterwards: no episode lost, and no completed command ran twice (the log holds each once).

Uses the environments cached under --root (built on first use: Debian base, Python, workspaces).
Writes bench/results/rollout.json and rollout.png and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sqlite3
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from shoal import Host, Sandbox  # noqa: E402
from shoal.envs.debian import PYTHON_IMAGE, ensure_python_base  # noqa: E402
from shoal.envs.workspaces import CATALOG, build_workspace  # noqa: E402
from shoal.rollout.runner import Rollout, resolve_table, write_jsonl, write_parquet  # noqa: E402
from shoal.tasks.swe import load_suite  # noqa: E402
from shoal.trajlog import LoggedSandbox, TrajectoryLog  # noqa: E402

console = Console(width=140)
RESULTS = Path(__file__).parent / "results"


def med_ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1000, 4)


def log_overhead(root: Path, n: int, work: Path, cmd: list[str]) -> dict:
    """Same sandbox, interleaved: exec direct, then the same exec through the log."""
    log = TrajectoryLog(work / f"overhead-{len(cmd)}.db")
    direct, logged = [], []
    with Sandbox.create(PYTHON_IMAGE, root=root, url="local") as sb:
        lsb = LoggedSandbox(sb, log.stream("overhead", sandbox=sb.id))
        for _ in range(20):  # warm-up
            sb.commands.run(cmd)
            lsb.exec(cmd)
        for _ in range(n):
            t = time.perf_counter()
            sb.commands.run(cmd)
            direct.append(time.perf_counter() - t)
            t = time.perf_counter()
            lsb.exec(cmd)
            logged.append(time.perf_counter() - t)
    d, lg = med_ms(direct), med_ms(logged)
    return {"cmd": cmd, "n": n, "direct_p50_ms": d, "logged_p50_ms": lg, "overhead_ms": round(lg - d, 4),
            "overhead_pct": round(100 * (lg - d) / d, 2)}


def replay_rate(root: Path, steps: int, work: Path) -> dict:
    log = TrajectoryLog(work / "replay.db")
    with Sandbox.create(PYTHON_IMAGE, root=root, url="local") as sb:
        rec = LoggedSandbox(sb, log.stream("replay", sandbox=sb.id))
        t = time.perf_counter()
        for i in range(steps):
            rec.exec(["echo", str(i)])
        record_s = time.perf_counter() - t
        again = LoggedSandbox(sb, log.stream("replay", sandbox=sb.id))  # a restarted client
        t = time.perf_counter()
        for i in range(steps):
            r = again.exec(["echo", str(i)])
        replay_s = time.perf_counter() - t
        assert r.stdout == f"{steps - 1}\n" and again.stream.executed == 0 and again.stream.replayed == steps
    return {"steps": steps, "record_steps_per_s": round(steps / record_s),
            "replay_steps_per_s": round(steps / replay_s),
            "replay_vs_live": round(record_s / replay_s, 1)}


def over_runs(runs: list[dict], keys: tuple[str, ...]) -> dict:
    """The median run's values for `keys` (the others from the first run), plus `runs`: every run,
    and `spread`: min / median / max of each key over the runs."""
    out = dict(runs[0])
    spread = {}
    for k in keys:
        v = sorted(r[k] for r in runs)
        out[k] = statistics.median(v)
        spread[k] = {"min": v[0], "median": statistics.median(v), "max": v[-1]}
    return {**out, "spread": spread, "runs": runs}


def ensure_envs(host: Host, tasks) -> None:
    ensure_python_base(host)
    for spec in CATALOG:
        if any(t.repo == spec.name for t in tasks):
            build_workspace(host, spec)


def duplicates(log_db: Path) -> int:
    """Sandbox operations (exec, write) of one episode that were run by more than one writer: a
    resumed worker re-running what a dead one had done. Must be 0."""
    with sqlite3.connect(log_db) as c:
        rows = c.execute("SELECT stream, req_hash FROM entries WHERE stream LIKE '%/sandbox' AND kind IN "
                         "('exec', 'write') GROUP BY stream, req_hash HAVING COUNT(DISTINCT writer) > 1").fetchall()
    return len(rows)


def rollout(root: Path, tasks, episodes: int, workers: int, concurrency: int, kill_at: float, work: Path) -> dict:
    ro = Rollout(work / "rollout.db")
    ro.submit([tasks[i % len(tasks)] for i in range(episodes)], {"kind": "oracle"}, prefix="oracle")
    ro.submit(tasks, {"kind": "null"}, prefix="null")
    ro.submit(tasks, {"kind": "random", "seed": 1}, prefix="random")
    total = ro.counts()["total"]
    t0 = time.time()
    ro.start_workers(workers, url="local", root=root, concurrency=concurrency, log_dir=work)
    killed = None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[live]}"), console=console) as bar:
        job = bar.add_task("episodes", total=total, live="")
        while True:
            c = ro.counts()
            done = c["done"] + c["failed"] + c["paused"]
            note = "  [killed a worker]" if killed else ""
            bar.update(job, completed=done,
                       live=f"running {c['running']}  failed {c['failed']}  reward {c['reward']:.0f}{note}")
            if killed is None and done >= kill_at * total:
                victim = ro.workers[0]
                os.kill(victim.pid, signal.SIGKILL)
                victim.wait()
                killed = {"at_done": done, "at_s": round(time.time() - t0, 1), "pid": victim.pid}
                ro.start_workers(1, url="local", root=root, concurrency=concurrency, log_dir=work)
            if c["queued"] + c["running"] == 0:
                break
            time.sleep(0.5)
    wall = time.time() - t0
    ro.stop_workers()
    recs = ro.records()
    counts = ro.counts()
    table = resolve_table(recs)
    with sqlite3.connect(ro.db) as c:
        finished = sorted(r[0] - t0 for r in c.execute("SELECT finished FROM episodes WHERE finished IS NOT NULL"))
    resumed = [r for r in recs if r["extra"].get("attempt", 1) > 1]
    oracle = [r for r in recs if r["policy"] == "oracle"]
    write_jsonl(recs, work / "episodes.jsonl")
    write_parquet(recs, work / "episodes.parquet")
    timing = {k: med_ms([r["timings"][k] for r in oracle]) for k in ("wall_s", "setup_s", "llm_s", "tools_s",
                                                                      "grade_s")}
    return {
        "episodes_total": total, "counts": {k: counts[k] for k in ("done", "failed", "paused", "queued", "running")},
        "wall_s": round(wall, 1), "episodes_per_s": round(total / wall, 2),
        "oracle_episodes": len(oracle), "oracle_resolve_rate": sum(r["resolved"] for r in oracle) / max(1, len(oracle)),
        "by_policy": table, "killed_worker": killed, "resumed_episodes": len(resumed),
        "resumed_replayed_ops": sum(r["replayed"]["sandbox"] + r["replayed"]["llm"] for r in resumed),
        "unknown_ops": sum(r["unknown_ops"] for r in recs), "re_executed_ops": duplicates(ro.log_path),
        "oracle_timings_p50_ms": timing, "finished_at_s": finished,
        "by_bug_type": dict(Counter(r["labels"]["bug_type"] for r in oracle)),
    }


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(16, 4.5))
    o = res["log_overhead"]
    ax[0].bar(["exec direct", "exec through the log"], [o["direct_p50_ms"], o["logged_p50_ms"]],
              color=["#888", "#2a7"])
    ax[0].set_ylabel("median round trip (ms)")
    ax[0].set_title(f"trajectory-log overhead: {o['overhead_pct']:+.1f}%")
    r = res["rollout"]
    fin = r["finished_at_s"]
    ax[1].plot(fin, range(1, len(fin) + 1), color="#27a")
    if r["killed_worker"]:
        ax[1].axvline(r["killed_worker"]["at_s"], color="#c33", ls="--", label="worker killed (-9)")
        ax[1].legend()
    ax[1].set_xlabel("seconds")
    ax[1].set_ylabel("episodes finished")
    ax[1].set_title(f"{r['episodes_total']} episodes, {r['episodes_per_s']} /s, {r['counts']['failed']} failed")
    pols = r["by_policy"]
    ax[2].bar([p["policy"] for p in pols], [100 * p["resolve_rate"] for p in pols], color="#a72")
    for i, p in enumerate(pols):
        ax[2].text(i, 100 * p["resolve_rate"] + 1, f"{100 * p['resolve_rate']:.1f}% of {p['episodes']}", ha="center")
    ax[2].set_ylim(0, 110)
    ax[2].set_ylabel("resolved (%)")
    ax[2].set_title("bundled SWE suite by policy")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default="/var/lib/shoal-bench")
    ap.add_argument("--episodes", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--kill-at", type=float, default=0.3, help="fraction of episodes done when a worker is killed")
    ap.add_argument("--overhead-n", type=int, default=500)
    ap.add_argument("--replay-steps", type=int, default=5000)
    ap.add_argument("--out", default=str(RESULTS / "rollout.json"))
    ap.add_argument("--runs", type=int, default=3,
                    help="runs of the log-overhead and replay measurements (the rollout itself runs once)")
    ap.add_argument("--skip-rollout", action="store_true",
                    help="measure the log only; keep the rollout section of an existing --out file")
    a = ap.parse_args()
    root = Path(a.root)
    host = Host.get(root)
    tasks = load_suite()
    if not a.skip_rollout:
        console.print(f"preparing environments under {root} ...")
        ensure_envs(host, tasks)
    work = Path(tempfile.mkdtemp(prefix="shoal-rollout-bench-"))
    res = {"machine": {"cpus": os.cpu_count()}, "suite": {"tasks": len(tasks), "repos": len({t.repo for t in tasks})},
           "runs": a.runs, "rollout_runs": 1, "load_avg_before": round(os.getloadavg()[0], 2)}
    over = ("direct_p50_ms", "logged_p50_ms", "overhead_ms", "overhead_pct")
    for key, cmd in (("log_overhead", ["true"]),
                     ("log_overhead_agent_shell", ["bash", "-c", "echo $((6*7))"])):  # the agent's shell tool
        console.print(f"trajectory-log overhead, {cmd} ({a.runs} runs) ...")
        res[key] = over_runs([log_overhead(root, a.overhead_n, work / f"{key}-{i}", cmd) for i in range(a.runs)],
                             over)
    console.print(f"fast-forward replay ({a.runs} runs) ...")
    res["replay"] = over_runs([replay_rate(root, a.replay_steps, work / f"replay-{i}") for i in range(a.runs)],
                              ("record_steps_per_s", "replay_steps_per_s", "replay_vs_live"))
    res["load_avg_after_log"] = round(os.getloadavg()[0], 2)
    if a.skip_rollout:
        res["rollout"] = json.loads(Path(a.out).read_text())["rollout"]
    else:
        console.print(f"rollout: {a.episodes} oracle episodes + null + random over {len(tasks)} tasks ...")
        res["rollout"] = rollout(root, tasks, a.episodes, a.workers, a.concurrency, a.kill_at, work)
    res["work_dir"] = str(work)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    plot(res, out.with_suffix(".png"))

    o, rp, r = res["log_overhead"], res["replay"], res["rollout"]
    t = Table(title="trajectory log and rollout (medians)")
    for col in ("measurement", "result", "goal"):
        t.add_column(col)
    t.add_row("exec `true` direct / through the log", f"{o['direct_p50_ms']:.3f} / {o['logged_p50_ms']:.3f} ms "
              f"({o['overhead_pct']:+.1f}%)", "<= +5%")
    o2 = res["log_overhead_agent_shell"]
    t.add_row("agent shell call (bash -c) direct / logged", f"{o2['direct_p50_ms']:.3f} / {o2['logged_p50_ms']:.3f} ms "
              f"({o2['overhead_pct']:+.1f}%)", "<= +5%")
    t.add_row("fast-forward replay", f"{rp['replay_steps_per_s']:,} steps/s ({rp['replay_vs_live']}x live)",
              ">= 5,000 steps/s")
    t.add_row("episodes (oracle + null + random)", f"{r['episodes_total']} in {r['wall_s']} s = "
              f"{r['episodes_per_s']} /s", "1,000 oracle")
    for p in r["by_policy"]:
        goal = {"oracle": "100%", "null": "0%"}.get(p["policy"], "-")
        t.add_row(f"  {p['policy']} resolved", f"{p['resolved']}/{p['episodes']} = {100 * p['resolve_rate']:.1f}%",
                  goal)
    t.add_row("worker killed -9 at", f"{r['killed_worker']}", "no episode lost")
    t.add_row("lost / failed episodes", f"{r['counts']['queued'] + r['counts']['running']} / {r['counts']['failed']}",
              "0 / 0")
    t.add_row("resumed episodes (ops replayed)", f"{r['resumed_episodes']} ({r['resumed_replayed_ops']})", "")
    t.add_row("completed ops re-executed", str(r["re_executed_ops"]), "0")
    t.add_row("oracle episode p50 (setup/llm/tools/grade)", " / ".join(
        f"{r['oracle_timings_p50_ms'][k]:.0f}" for k in ("setup_s", "llm_s", "tools_s", "grade_s")) + " ms", "")
    console.print(t)
    console.print(f"wrote {out} and {out.with_suffix('.png')}; episodes in {work}/episodes.(jsonl|parquet)")


if __name__ == "__main__":
    main()
