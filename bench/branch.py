#!/usr/bin/env python3
"""Branching an episode from any step (rollout.branch, docs/flare.md), on the bundled SWE tasks.

Per run and task, a long scripted episode (--steps tool calls, then submit) through the real agent
loop and ToolBox on the task's sandbox: reading and grepping the repository, appending to notes,
editing a source file in place (non-idempotent), a python one-liner, and the task's tests every 25th
step. It is recorded twice, without and with a snapshot after every step, and:

  * branch latency at k = 5, 20, 50 (--reps each): `snapshot` (a create from step k's snapshot) and
    `fastforward` (from the start: a create, then k steps' logged effects re-applied and checked).
    Goal: p50 <= 200 ms at any k <= 50 (the automatic choice takes the snapshot where there is one);
  * the step overhead of snapshotting every step: loop seconds per step with vs without, with the
    scripted policy answering at once (the worst case: nothing to hide the snapshot behind) and with
    a policy that takes --think seconds per step (the snapshot runs while the policy thinks).
    Goal: <= 10% of the step time;
  * storage per episode: the snapshot layers (each a whole copy of the writable upper) and the log.

Run under `flock /tmp/shoal-bench.lock`. Writes bench/results/branch.json and branch.png.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from shoal import Host  # noqa: E402
from shoal.envs.debian import ensure_python_base  # noqa: E402
from shoal.envs.workspaces import CATALOG, build_workspace  # noqa: E402
from shoal.rollout.branch import Episode  # noqa: E402
from shoal.rollout.episode import run_episode  # noqa: E402
from shoal.rollout.policy import ScriptPolicy  # noqa: E402
from shoal.tasks.swe import load_suite  # noqa: E402
from shoal.trajlog import TrajectoryLog  # noqa: E402

console = Console(width=140)
RESULTS = Path(__file__).parent / "results"
KS = (5, 20, 50)
REPOS = ("iniconfig", "parse")


def script(steps: int) -> list[list]:
    """A working agent's kind of steps, deterministic; effects that are not idempotent on purpose."""
    src = "$(git ls-files '*.py' | grep -v -i test | head -1)"
    kinds = [
        "git ls-files | head -40",
        "grep -rn 'def ' --include='*.py' . | head -30",
        "echo 'step {i}: looked around' >> NOTES.md && wc -l NOTES.md",
        f"sed -i '1i # touched at step {{i}}' {src} && head -3 {src}",
        "python -c 'import sys, platform; print(sys.version, platform.machine())'",
        "git status --short && git diff --stat",
        f"cat {src} | head -60",
        "n=$(cat .count 2>/dev/null || echo 0); echo $((n + 1)) > .count; cat .count",
        "ls -la && find . -name '*.py' | wc -l",
    ]
    out: list[list] = []
    for i in range(steps):
        if i % 25 == 24:
            out.append(["shell", {"command": "python -m pytest -q -x -p no:cacheprovider 2>&1 | tail -3"}])
        elif i % 7 == 6:
            out.append(["create_file", {"path": f"scratch/note_{i}.txt", "content": f"hypothesis {i}\n" * 20}])
        else:
            out.append(["shell", {"command": kinds[i % len(kinds)].format(i=i)}])
    return out


class ThinkingPolicy(ScriptPolicy):
    """ScriptPolicy that takes `think` seconds per call, as a model would (the snapshot hides behind it)."""

    def __init__(self, actions: list[list], think: float):
        super().__init__(actions)
        self.think = think

    async def complete(self, request: dict) -> dict:
        await asyncio.sleep(self.think)
        return await super().complete(request)


def loop_s_per_step(rec) -> float:
    """Seconds per step of the agent loop: the policy, the tools and any wait for a step's snapshot."""
    t = rec.timings
    return (t["llm_s"] + t["tools_s"] + t["mark_wait_s"]) / rec.steps


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def one_run(host: Host, tasks, steps: int, reps: int, ff_reps: int, think: float, think_steps: int, work: Path,
            run: int) -> dict:
    log = TrajectoryLog(work / f"run{run}.traj.db")
    out: dict = {"tasks": [], "latency_ms": {}, "overhead": {}, "storage": {}}
    ks = [k for k in KS if k <= steps]
    lat: dict[str, list[float]] = {f"{s}@{k}": [] for s in ("snapshot", "fastforward") for k in ks}
    per_step = {"none": [], "every": [], "none_think": [], "every_think": []}
    snap_bytes, log_bytes, snap_s = [], [], []
    acts = script(steps)
    short = script(min(steps, think_steps))  # the thinking policy's episodes: the overhead per step needs fewer
    for task in tasks:
        eid = f"r{run}-{task.id}"
        recs = {}
        for mode, every, pol in (("none", None, ScriptPolicy(acts)), ("every", 1, ScriptPolicy(acts)),
                                 ("none_think", None, ThinkingPolicy(short, think)),
                                 ("every_think", 1, ThinkingPolicy(short, think))):
            recs[mode] = asyncio.run(run_episode(task, pol, log, host, f"{eid}-{mode}", max_steps=steps + 1,
                                                 snapshot_every=every))
            per_step[mode].append(loop_s_per_step(recs[mode]))
        ep = Episode(log, f"{eid}-every", host)
        marks = ep.marks()
        assert len(marks) == steps + 1, (len(marks), steps)
        info = log.history(f"{eid}-every/steps")
        snap_bytes.append(sum((e.result or {}).get("size", 0) for e in info))
        snap_s.extend((e.result or {}).get("snapshot_s", 0.0) for e in info)
        log_bytes.append(sum(len(json.dumps(e.request)) + len(json.dumps(e.result)) for s in ("sandbox", "llm", "steps")
                             for e in log.history(f"{eid}-every/{s}")))
        for k in ks:
            for strategy in ("snapshot", "fastforward"):
                for _ in range(reps if strategy == "snapshot" else ff_reps):
                    t0 = time.perf_counter()
                    b = ep.branch(step=k, strategy=strategy, from_step=0 if strategy == "fastforward" else None)
                    lat[f"{strategy}@{k}"].append(time.perf_counter() - t0)
                    b.kill()
        out["tasks"].append({"task": task.id, "resolved_none": recs["none"].resolved})
        # keep the bench root's store small: the snapshots go again (images first: identical uppers
        # share one content-addressed layer)
        made = [e.result for mode in ("every", "every_think") for e in log.history(f"{eid}-{mode}/steps")
                if e.result and e.result.get("image")]
        for image in {r["image"] for r in made}:  # a step that changed nothing kept the one before it
            host.store.remove_image(image)
        for layer in {r["layer"] for r in made}:
            try:
                host.store.remove_layer(layer)
            except Exception as exc:  # noqa: BLE001 - a leftover layer is harmless: say so and go on
                console.print(f"[dim]kept layer {layer}: {exc}[/dim]")
    out["latency_ms"] = {k: {"p50": round(1000 * statistics.median(v), 1), "p99": round(1000 * pct(v, 0.99), 1),
                             "n": len(v)} for k, v in lat.items()}
    med = {k: statistics.median(v) for k, v in per_step.items()}
    out["overhead"] = {
        "step_ms_no_snapshots": round(1000 * med["none"], 1),
        "step_ms_snapshot_every_step": round(1000 * med["every"], 1),
        "overhead_pct": round(100 * (med["every"] / med["none"] - 1), 1),
        "think_s": think, "step_ms_no_snapshots_think": round(1000 * med["none_think"], 1),
        "step_ms_snapshot_every_step_think": round(1000 * med["every_think"], 1),
        "overhead_pct_think": round(100 * (med["every_think"] / med["none_think"] - 1), 1),
        "snapshot_ms_p50": round(1000 * statistics.median(snap_s), 1),
        "snapshot_ms_p99": round(1000 * pct(snap_s, 0.99), 1)}
    out["storage"] = {"snapshot_bytes_per_episode": int(statistics.median(snap_bytes)),
                      "log_bytes_per_episode": int(statistics.median(log_bytes)), "steps": steps + 1}
    return out


def spread(runs: list[dict], section: str, key: str, sub: str | None = None) -> dict:
    v = sorted(r[section][key][sub] if sub else r[section][key] for r in runs)
    return {"min": v[0], "median": statistics.median(v), "max": v[-1]}


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(13, 4.5))
    ks = res["ks"]
    for i, strategy in enumerate(("snapshot", "fastforward")):
        p50 = [res["latency_ms"][f"{strategy}@{k}"]["p50"]["median"] for k in ks]
        p99 = [res["latency_ms"][f"{strategy}@{k}"]["p99"]["median"] for k in ks]
        xs = [j + (i - 0.5) * 0.38 for j in range(len(ks))]
        ax[0].bar(xs, p50, width=0.36, label=f"{strategy} p50", color=("#2a7", "#a72")[i])
        ax[0].scatter(xs, p99, marker="_", s=300, color="k", label="p99" if i == 0 else None)
    ax[0].axhline(200, color="#c33", ls="--", label="goal: p50 <= 200 ms")
    ax[0].set_xticks(range(len(ks)), [f"k = {k}" for k in ks])
    ax[0].set_ylabel("branch latency (ms, median of runs)")
    ax[0].set_yscale("log")
    ax[0].legend(fontsize=8)
    ax[0].set_title("branch at step k of an SWE episode")
    o = res["overhead"]
    labels = ["policy answers at once", f"policy thinks {o['think_s']['median']} s"]
    none = [o["step_ms_no_snapshots"]["median"], o["step_ms_no_snapshots_think"]["median"]]
    every = [o["step_ms_snapshot_every_step"]["median"], o["step_ms_snapshot_every_step_think"]["median"]]
    ax[1].bar([0 - 0.19, 1 - 0.19], none, width=0.36, label="no snapshots", color="#888")
    ax[1].bar([0 + 0.19, 1 + 0.19], every, width=0.36, label="snapshot every step", color="#27a")
    for j, key in enumerate(("overhead_pct", "overhead_pct_think")):
        ax[1].text(j + 0.19, every[j], f"{o[key]['median']:+.1f}%", ha="center", va="bottom")
    ax[1].set_xticks([0, 1], labels)
    ax[1].set_ylabel("agent-loop ms per step (median of runs)")
    ax[1].legend(fontsize=8)
    ax[1].set_title("step overhead of a snapshot after every step (goal <= 10%)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default="/var/lib/shoal-bench")
    ap.add_argument("--steps", type=int, default=55)
    ap.add_argument("--reps", type=int, default=5, help="snapshot branches per (k, task) in each run")
    ap.add_argument("--ff-reps", type=int, default=2, help="fastforward branches per (k, task) in each run")
    ap.add_argument("--think-steps", type=int, default=20, help="steps of the thinking policy's episodes")
    ap.add_argument("--think", type=float, default=0.25)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--repos", default=",".join(REPOS))
    ap.add_argument("--out", default=str(RESULTS / "branch.json"))
    a = ap.parse_args()
    root = Path(a.root)
    host = Host.get(root)
    tasks = [next(t for t in load_suite() if t.repo == r) for r in a.repos.split(",")]
    ensure_python_base(host)
    for spec in CATALOG:
        if any(t.repo == spec.name for t in tasks):
            build_workspace(host, spec)
    work = Path(tempfile.mkdtemp(prefix="shoal-branch-bench-"))
    load0 = os.getloadavg()[0]
    runs = []
    for i in range(a.runs):
        console.print(f"run {i + 1}/{a.runs}: {len(tasks)} tasks x 4 episodes of {a.steps} steps, branches ...")
        runs.append(one_run(host, tasks, a.steps, a.reps, a.ff_reps, a.think, a.think_steps, work, i))
    res: dict = {"machine": {"cpus": os.cpu_count()}, "runs": a.runs, "tasks": [t.id for t in tasks],
                 "steps": a.steps, "reps": a.reps, "ff_reps": a.ff_reps, "think_steps": a.think_steps,
                 "ks": [k for k in KS if k <= a.steps],
                 "load_avg_before": round(load0, 2),
                 "load_avg_after": round(os.getloadavg()[0], 2), "per_run": runs,
                 "latency_ms": {k: {q: spread(runs, "latency_ms", k, q) for q in ("p50", "p99")}
                                for k in runs[0]["latency_ms"]},
                 "overhead": {k: spread(runs, "overhead", k) for k in runs[0]["overhead"]},
                 "storage": {k: spread(runs, "storage", k) for k in runs[0]["storage"]},
                 "goals": {"branch_p50_ms": 200, "snapshot_overhead_pct": 10}}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    plot(res, out.with_suffix(".png"))

    t = Table(title=f"branching ({a.runs} runs: median [min-max])")
    for col in ("measurement", "result", "goal"):
        t.add_column(col)

    def fmt(s: dict, unit: str = "") -> str:
        return f"{s['median']}{unit} [{s['min']}-{s['max']}]"

    for k in res["ks"]:
        for strategy in ("snapshot", "fastforward"):
            L = res["latency_ms"][f"{strategy}@{k}"]
            t.add_row(f"branch k={k} {strategy} p50 / p99", f"{fmt(L['p50'], ' ms')} / {fmt(L['p99'], ' ms')}",
                      "p50 <= 200 ms")
    o = res["overhead"]
    t.add_row("loop per step, none / every step", f"{fmt(o['step_ms_no_snapshots'], ' ms')} / "
              f"{fmt(o['step_ms_snapshot_every_step'], ' ms')}", "")
    t.add_row("snapshot-every-step overhead (policy answers at once)", fmt(o["overhead_pct"], "%"), "<= 10%")
    t.add_row(f"... with a policy thinking {a.think} s", fmt(o["overhead_pct_think"], "%"), "<= 10%")
    t.add_row("one snapshot p50 / p99", f"{fmt(o['snapshot_ms_p50'], ' ms')} / {fmt(o['snapshot_ms_p99'], ' ms')}", "")
    s = res["storage"]
    t.add_row(f"storage per episode ({a.steps + 1} steps): snapshots / log",
              f"{fmt(s['snapshot_bytes_per_episode'], ' B')} / {fmt(s['log_bytes_per_episode'], ' B')}", "")
    console.print(t)


if __name__ == "__main__":
    main()
