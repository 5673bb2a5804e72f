#!/usr/bin/env python3
"""FLARE's mechanism on the bundled SWE suite: breakpoint regeneration vs global resampling vs no
intervention, at equal agent-token budgets; and each diagnoser's ROC-AUC against RADAR-style labels.

With the scripted policy (default) this measures the mechanism, not FLARE's model: the policy is a
"fallible oracle" that knows the gold patch, makes a mistake with probability --p per turn, and
follows a fix when told one (shoal.flare.policy). With SHOAL_LLM_URL (and SHOAL_LLM_MODEL) set, the
policy is that OpenAI-compatible model instead.

Per task and seed:
- no intervention: one episode;
- global resampling, N = 1..--n-max: N independent episodes (seeds differ); the answer is the one
  whose worst step the diagnoser rated lowest (ties: the first), so both methods use the same
  signal; tokens are the sum over the N episodes;
- breakpoint regeneration, for each R in --regens: one episode that branches back before any step
  rated >= --threshold, at most R times, with the diagnosis and fix in the policy's context.
Tokens are the policy's prompt + completion tokens (every call, discarded branches included).
"pass@N (any)" is also reported: whether any of the N episodes resolved; it needs the grader at
selection time, so it is a ceiling, not a method.

--part labels: failure-track labels (branches from each failed no-intervention episode) and
success-track labels (mistakes injected into oracle runs), then ROC-AUC of the programmatic
diagnoser and, with --judge-url/--judge-model (or SHOAL_JUDGE_URL/SHOAL_JUDGE_MODEL), of the LLM judge.

Run under the shared lock: flock /tmp/shoal-bench.lock .venv/bin/python bench/flare.py --part compare
Writes bench/results/flare.json + flare.png (compare) and flare_auc.json (labels).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from shoal import Host  # noqa: E402
from shoal.core.errors import ImageNotFound  # noqa: E402
from shoal.envs.debian import PYTHON_IMAGE, ensure_python_base  # noqa: E402
from shoal.envs.workspaces import CATALOG, build_workspace  # noqa: E402
from shoal.flare.judge import LLMJudge  # noqa: E402
from shoal.flare.labels import failure_track, roc_auc, score, success_track  # noqa: E402
from shoal.flare.policy import FallibleOraclePolicy  # noqa: E402
from shoal.flare.programmatic import ProgrammaticDiagnoser  # noqa: E402
from shoal.flare.regen import Budget, GradeCache, run_flare  # noqa: E402
from shoal.rollout.policy import ChatEndpointPolicy, Policy  # noqa: E402
from shoal.tasks.swe import load_suite  # noqa: E402

RESULTS = Path(__file__).parent / "results"
REPOS = ("iniconfig", "idna", "parse", "six", "toolz", "more-itertools")
INJECT = ((1, "destructive-edit"), (1, "wrong-file"), (1, "test-tampering"), (1, "premature-submit"),
          (2, "wrong-hypothesis"), (2, "environment-misuse"), (2, "loop"))


def pick_tasks(n: int):
    suite = load_suite()
    out = []
    for repo in REPOS:
        cands = sorted((t for t in suite if t.repo == repo), key=lambda t: (len(t.FAIL_TO_PASS), t.instance_id))
        if cands:
            out.append(cands[0])
    return out[:n]


def prepare(host: Host, tasks) -> None:
    try:
        host.store.get_image(PYTHON_IMAGE)  # present (perhaps copied from another root): no rebuild
    except ImageNotFound:
        ensure_python_base(host)
    for spec in CATALOG:
        if any(t.repo == spec.name for t in tasks):
            build_workspace(host, spec)


def make_policy(task, p: float, seed: int) -> Policy:
    url = os.environ.get("SHOAL_LLM_URL")
    if url:
        return ChatEndpointPolicy(url, os.environ.get("SHOAL_LLM_MODEL", "default"), temperature=0.7,
                                  extra_body={"seed": seed})
    return FallibleOraclePolicy(task, p=p, seed=seed)


def spread(xs: list[float]) -> dict:
    return {"mean": round(statistics.fmean(xs), 4), "min": round(min(xs), 4), "max": round(max(xs), 4),
            "runs": [round(x, 4) for x in xs]}


async def compare(a, host: Host, tasks) -> dict:
    grades = GradeCache()
    rows: list[dict] = []  # one per (seed, task, method)
    t0 = time.monotonic()
    for seed in range(a.seeds):
        for task in tasks:
            eps = []
            for i in range(a.n_max):
                ep = await run_flare(task, make_policy(task, a.p, 1000 * seed + i), host, threshold=None,
                                     grades=grades, max_steps=a.max_steps)
                eps.append(ep)
            for n in range(1, a.n_max + 1):
                first = eps[:n]
                worst = [max((d.risk.level for d in e.diagnoses), default=0) for e in first]
                chosen = first[worst.index(min(worst))]
                rows.append({"seed": seed, "task": task.id, "method": f"global N={n}", "resolved": chosen.resolved,
                             "tokens": sum(e.tokens for e in first), "sandbox_s": sum(e.sandbox_s for e in first),
                             "any_resolved": any(e.resolved for e in first)})
            for r in a.regens:
                ep = await run_flare(task, make_policy(task, a.p, 1000 * seed), host, threshold=a.threshold,
                                     budget=Budget(regenerations=r), grades=grades, max_steps=a.max_steps)
                rows.append({"seed": seed, "task": task.id, "method": f"breakpoint R={r}", "resolved": ep.resolved,
                             "tokens": ep.tokens, "sandbox_s": ep.sandbox_s, "regenerations": ep.regenerations,
                             "flagged": [i["diagnosis"]["error_class"] for i in ep.interventions]})
            print(f"seed {seed} {task.id}: done at {time.monotonic() - t0:.0f} s", flush=True)
    methods = [f"global N={n}" for n in range(1, a.n_max + 1)] + [f"breakpoint R={r}" for r in a.regens]
    table = []
    for m in methods:
        per_seed = [[x for x in rows if x["method"] == m and x["seed"] == s] for s in range(a.seeds)]
        entry = {"method": m, "resolve_rate": spread([sum(x["resolved"] for x in ps) / len(ps) for ps in per_seed]),
                 "tokens_per_task": spread([statistics.fmean(x["tokens"] for x in ps) for ps in per_seed]),
                 "sandbox_s_per_task": spread([statistics.fmean(x["sandbox_s"] for x in ps) for ps in per_seed])}
        if m.startswith("global"):
            entry["pass_at_n_any"] = spread([sum(x["any_resolved"] for x in ps) / len(ps) for ps in per_seed])
        if m == "global N=1":
            entry["note"] = "= no intervention"
        table.append(entry)
    return {"rows": rows, "table": table, "grades": grades.graded, "seconds": round(time.monotonic() - t0, 1)}


async def synthesize(a, host: Host, tasks, grades: GradeCache) -> list:
    """RADAR-style labelled traces: the failure track of each seed's episode, the success track's injections."""
    data = []
    t0 = time.monotonic()
    for task in tasks:
        for seed in range(a.seeds):
            ep = await run_flare(task, make_policy(task, a.p, 1000 * seed), host, threshold=None, grades=grades,
                                 max_steps=a.max_steps)
            lab = await failure_track(task, ep, host, grades, max_steps=a.max_steps)
            if lab:
                data.append(lab)
        for turn, kind in INJECT:
            lab = await success_track(task, host, grades, turn, kind, max_steps=a.max_steps)
            if lab:
                data.append(lab)
        print(f"labels {task.id}: done at {time.monotonic() - t0:.0f} s", flush=True)
    return data


def label_counts(data: list) -> dict:
    return {"labelled_steps": sum(len(d.labels) for d in data),
            "positives": sum(x.label for d in data for x in d.labels),
            "by_track": {tr: {"steps": sum(1 for d in data for x in d.labels if x.track == tr),
                              "positives": sum(x.label for d in data for x in d.labels if x.track == tr)}
                         for tr in ("failure", "success")}}


async def labels(a, host: Host, tasks) -> dict:
    grades = GradeCache()
    t0 = time.monotonic()
    data = await synthesize(a, host, tasks, grades)
    out: dict = {"labelled_steps": sum(len(d.labels) for d in data),
                 "positives": sum(x.label for d in data for x in d.labels),
                 "by_track": {tr: {"steps": sum(1 for d in data for x in d.labels if x.track == tr),
                                   "positives": sum(x.label for d in data for x in d.labels if x.track == tr)}
                              for tr in ("failure", "success")},
                 "labels": [x.to_dict() for d in data for x in d.labels], "auc": {}}
    diagnosers: list = [ProgrammaticDiagnoser()]
    url = a.judge_url or os.environ.get("SHOAL_JUDGE_URL")
    server = None
    if not url:  # the judge's HTTP path with the scripted judge (the rules behind the API): plumbing, not a model
        server, url = _scripted_server()
        out["judge_note"] = "judge:judge is the scripted server's judge (the programmatic rules over HTTP)"
    diagnosers.append(LLMJudge(url, a.judge_model or os.environ.get("SHOAL_JUDGE_MODEL", "judge")))
    for dg in diagnosers:
        s, y = await score(dg, data)
        by = {}
        for tr in ("failure", "success"):
            sel = [(si, yi) for (si, yi), x in zip(zip(s, y), [x for d in data for x in d.labels]) if x.track == tr]
            by[tr] = roc_auc([q for q, _ in sel], [w for _, w in sel])
        out["auc"][dg.name] = {"all": roc_auc(s, y), **by}
        await dg.aclose()
    if server is not None:
        server.terminate()
        server.wait()
    out["seconds"] = round(time.monotonic() - t0, 1)
    return out


async def local_model(a, host: Host, tasks) -> dict:
    """The judge and the policy against a real (tiny, local) transformers model behind the project's
    OpenAI-compatible server: what such a model gives, measured, not what FLARE's 4B judge gives."""
    from shoal.annotate.demo_models import make_bpe_model
    from shoal.flare.exports import record_token_rewards
    from shoal.flare.judge import JudgeOutputInvalid
    from shoal.flare.schema import Trace
    from shoal.rollout.episode import run_episode
    from shoal.trajlog import TrajectoryLog

    grades = GradeCache()
    t0 = time.monotonic()
    data = await synthesize(a, host, tasks, grades)
    steps = [(item.trace.prefix(x.step), x) for item in data for x in item.labels]
    y = [x.label for _, x in steps]
    out: dict = {**label_counts(data), "models": [], "programmatic_auc": None}
    prog = ProgrammaticDiagnoser()
    out["programmatic_auc"] = roc_auc([prog.diagnose_now(p).risk.score for p, _ in steps], y)
    cache = Path(a.model_dir)
    for seed in range(a.model_seeds):
        path = make_bpe_model(cache / f"bpe-{seed}", seed=seed)
        server, url = _scripted_server("--model", str(path))
        row: dict = {"model": path.name, "seed": seed, "params": None}
        try:
            from transformers import AutoModelForCausalLM  # the parameter count, from the saved weights

            row["params"] = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters())
            row["context"] = int(json.loads((path / "config.json").read_text())["n_positions"])
            for mode, schema in (("json_schema", True), ("free_text", False)):
                judge = LLMJudge(url, path.name, json_schema=schema, retries=2, backoff_s=0.05)
                scores, failed, t1 = [], 0, time.monotonic()
                for prefix, _ in steps:
                    try:
                        scores.append((await judge.diagnose(prefix)).risk.score)
                    except JudgeOutputInvalid:
                        failed += 1
                        scores.append(None)
                await judge.aclose()
                kept = [(s_, yi) for s_, yi in zip(scores, y) if s_ is not None]
                row[mode] = {
                    "requests": judge.calls, "invalid_answers": judge.invalid,
                    "parse_failure_rate": round(judge.invalid / judge.calls, 4) if judge.calls else None,
                    "steps_without_diagnosis": failed,
                    "auc_on_diagnosed": roc_auc([s_ for s_, _ in kept], [yi for _, yi in kept]),
                    "auc_failures_as_none": roc_auc([s_ if s_ is not None else 0.0 for s_ in scores], y),
                    "risk_histogram": {r: sum(1 for s_ in scores if s_ == v)
                                       for r, v in (("none", 0.0), ("low", 0.25), ("medium", 0.5), ("high", 0.75),
                                                    ("critical", 1.0))},
                    "seconds": round(time.monotonic() - t1, 1)}
            # the policy: the same model drives the agent loop through ChatEndpointPolicy
            pol: dict = {"episodes": 0, "turns": 0, "turns_with_tool_call": 0, "resolved": 0, "prompt_tokens_cut": []}
            for task in tasks:
                log = TrajectoryLog(Path(tempfile.mkdtemp(prefix="shoal-flare-lm-")) / "traj.db")
                policy = ChatEndpointPolicy(url, path.name, max_tokens=128)
                rec = await run_episode(task, policy, log, host, f"lm-{seed}-{task.id}", max_steps=a.lm_steps)
                await policy.aclose()
                pol["episodes"] += 1
                pol["resolved"] += int(rec.resolved)
                pol["turns"] += len(rec.turns)
                pol["turns_with_tool_call"] += sum(1 for m in rec.messages if m["role"] == "assistant"
                                                   and m.get("tool_calls"))
                pol["prompt_tokens_cut"] += [(t.get("usage") or {}).get("prompt_tokens_cut", 0) for t in rec.turns]
                tr = Trace.from_record(rec)
                diags = [prog.diagnose_now(tr.prefix(k)) for k in range(1, len(tr.steps) + 1)]
                per = record_token_rewards(rec, diags)  # aligned with the model's own token ids
                assert [len(x) for x in per] == [len(t["token_ids"]) for t in rec.turns]
            pol["tool_call_parse_rate"] = round(pol["turns_with_tool_call"] / pol["turns"], 4) if pol["turns"] else None
            cut = pol.pop("prompt_tokens_cut")
            pol["prompt_tokens_cut_median"] = statistics.median(cut) if cut else 0
            row["policy"] = pol
        finally:
            server.terminate()
            server.wait()
        out["models"].append(row)
        print(json.dumps({k: row[k] for k in ("model", "json_schema", "free_text")}, indent=1), flush=True)
    for mode in ("json_schema", "free_text"):
        aucs = [m[mode]["auc_failures_as_none"] for m in out["models"] if m[mode]["auc_failures_as_none"] is not None]
        rates = [m[mode]["parse_failure_rate"] for m in out["models"] if m[mode]["parse_failure_rate"] is not None]
        out[f"{mode}_summary"] = {"auc": spread(aucs) if aucs else None,
                                  "parse_failure_rate": spread(rates) if rates else None}
    out["note"] = ("tiny GPT-2 models (make_bpe_model: a 400-token BPE vocabulary, 2 layers, width 64, a "
                   "128-token context, trained on 8 sentences) served by the project's server; they see only "
                   "the last ~80 tokens of the judge prompt. A capable model is needed for a meaningful AUC; "
                   "none is reachable here (no network, no model weights on the host)")
    out["seconds"] = round(time.monotonic() - t0, 1)
    return out


def readme_rows(j: dict) -> list[list[str]]:
    """README's FLARE tables (flare.json, flare_p05.json): method, resolve rate, policy tokens per task."""
    return [[r["method"], f"{r['resolve_rate']['mean']:.2f} ({r['resolve_rate']['min']:.2f}–"
             f"{r['resolve_rate']['max']:.2f})", f"{r['tokens_per_task']['mean']:,.0f}"] for r in j["table"]]


def local_model_rows(j: dict) -> list[list[str]]:
    """README's real-model table (flare_local_model.json): per judge mode, the parse-failure rate and
    the ROC-AUC (steps without a diagnosis scored as risk none), mean (min–max) over the models."""
    def cell(d: dict | None) -> str:
        return "n/a" if d is None else f"{d['mean']:.2f} ({d['min']:.2f}–{d['max']:.2f})"
    rows = [["judge, JSON schema enforced by the server", cell(j["json_schema_summary"]["parse_failure_rate"]),
             cell(j["json_schema_summary"]["auc"])],
            ["judge, free text (schema in the prompt only)", cell(j["free_text_summary"]["parse_failure_rate"]),
             cell(j["free_text_summary"]["auc"])]]
    pol = [m["policy"] for m in j["models"]]
    turns, calls = sum(p["turns"] for p in pol), sum(p["turns_with_tool_call"] for p in pol)
    rows.append(["policy: turns with a tool call / resolved episodes", f"{calls} of {turns} turns",
                 f"{sum(p['resolved'] for p in pol)} of {sum(p['episodes'] for p in pol)} episodes"])
    return rows


def _scripted_server(*args: str):
    from shoal.rollout import scripted_server

    return scripted_server.spawn(*args, env={"PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")},
                                 timeout=300.0)


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for prefix, style in (("global", "o-"), ("breakpoint", "s-")):
        rows = [r for r in res["table"] if r["method"].startswith(prefix)]
        xs = [r["tokens_per_task"]["mean"] for r in rows]
        ys = [r["resolve_rate"]["mean"] for r in rows]
        err = [[y - r["resolve_rate"]["min"] for y, r in zip(ys, rows)],
               [r["resolve_rate"]["max"] - y for y, r in zip(ys, rows)]]
        ax.errorbar(xs, ys, yerr=err, fmt=style, capsize=3,
                    label="global resampling (N=1..)" if prefix == "global" else "breakpoint regeneration (R)")
        for x, y, r in zip(xs, ys, rows):
            ax.annotate(r["method"].split()[-1], (x, y), textcoords="offset points", xytext=(4, -10), fontsize=8)
    n1 = next(r for r in res["table"] if r["method"] == "global N=1")
    ax.axhline(n1["resolve_rate"]["mean"], color="grey", ls=":", label="no intervention")
    ax.set_xlabel("policy tokens per task (prompt + completion)")
    ax.set_ylabel("resolve rate")
    ax.set_title(f"{res['config']['policy']}, p={res['config']['p']}: mean of {res['config']['seeds']} seeds "
                 "(bars: min-max)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("compare", "labels", "local-model"), default="compare")
    ap.add_argument("--model-dir", default="/var/tmp/shoal-flare-models", help="local-model: where the tiny models go")
    ap.add_argument("--model-seeds", type=int, default=3, help="local-model: how many tiny models (seeds)")
    ap.add_argument("--lm-steps", type=int, default=3, help="local-model: policy steps per episode")
    ap.add_argument("--root", default=os.environ.get("SHOAL_BENCH_ROOT", "/var/tmp/shoal-flare"))
    ap.add_argument("--tasks", type=int, default=6)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--p", type=float, default=0.3)
    ap.add_argument("--n-max", type=int, default=4)
    ap.add_argument("--regens", default="1,3")
    ap.add_argument("--threshold", default="high")
    ap.add_argument("--max-steps", type=int, default=10)
    ap.add_argument("--judge-url")
    ap.add_argument("--judge-model")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    a.regens = [int(x) for x in a.regens.split(",") if x]
    host = Host.get(a.root)
    tasks = pick_tasks(a.tasks)
    prepare(host, tasks)
    policy = f"chat:{os.environ.get('SHOAL_LLM_MODEL', 'default')}" if os.environ.get("SHOAL_LLM_URL") \
        else "fallible-oracle (scripted)"
    config = {"policy": policy, "p": a.p, "seeds": a.seeds, "tasks": [t.id for t in tasks], "n_max": a.n_max,
              "regens": a.regens, "threshold": a.threshold, "max_steps": a.max_steps, "diagnoser": "programmatic",
              "note": "scripted policy: measures the mechanism, not FLARE's model" if "scripted" in policy else ""}
    RESULTS.mkdir(exist_ok=True)
    if a.part == "compare":
        res = {"config": config, **asyncio.run(compare(a, host, tasks))}
        out = Path(a.out or RESULTS / "flare.json")
        out.write_text(json.dumps(res, indent=1) + "\n")
        plot(res, out.with_suffix(".png"))
        print(f"{'method':<18} {'resolve rate (min-max)':<26} {'tokens/task':>12} {'sandbox-s/task':>15}")
        for r in res["table"]:
            rr, tk, sb = r["resolve_rate"], r["tokens_per_task"], r["sandbox_s_per_task"]
            print(f"{r['method']:<18} {rr['mean']:.3f} ({rr['min']:.2f}-{rr['max']:.2f}){'':<10} "
                  f"{tk['mean']:>12.0f} {sb['mean']:>15.1f}")
    elif a.part == "local-model":
        res = {"config": {**config, "diagnoser": "LLMJudge over a local model"},
               **asyncio.run(local_model(a, host, tasks))}
        out = Path(a.out or RESULTS / "flare_local_model.json")
        out.write_text(json.dumps(res, indent=1) + "\n")
        print(json.dumps({k: res[k] for k in ("labelled_steps", "positives", "programmatic_auc",
                                              "json_schema_summary", "free_text_summary")}, indent=1))
    else:
        res = {"config": config, **asyncio.run(labels(a, host, tasks))}
        out = Path(a.out or RESULTS / "flare_auc.json")
        out.write_text(json.dumps(res, indent=1) + "\n")
        print(json.dumps({k: res[k] for k in ("labelled_steps", "positives", "by_track", "auc")}, indent=1))


if __name__ == "__main__":
    main()
