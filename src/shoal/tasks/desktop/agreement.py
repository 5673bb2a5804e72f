"""Judge agreement end to end (issue 18 section 2): episodes of the oracle with injected detours,
typos and cut-off ends, synthetic step labels for them, judges, and 1-MAE / Cohen's kappa with
bootstrap intervals.

**Synthetic labels** stand in for human step labels. They come from the construction of each
episode, not from the checkers run during it: a clean oracle run of the task says which oracle
step fulfils which subgoal (`oracle_map`); in a plan, an inserted detour step advances nothing, an
oracle step advances what it advanced in the clean run provided the step is typed as the oracle
types it and the subgoal's dependencies are labelled fulfilled by then. A typo'd step, and every
oracle step after it, advances nothing (the rest of the oracle builds on the mistyped text); a
left-out step advances nothing. From the step labels come per-subgoal labels (fulfilled or
not) and the task-level score (fraction fulfilled).

**Judges** (pluggable: a callable `judge(task, record, final_png) -> [bool per subgoal]`):
- `programmatic`: the runner's own tracking (each subgoal's check in the sandbox after every step);
- `chat_judge(url, model)`: an OpenAI-compatible endpoint asked once per subgoal with the task, the
  subgoal's description and rubric, the action history and the final screenshot (a base64 PNG);
  it answers {"fulfilled": true|false} (or yes / no). The scripted server's `desktop-judge` is a
  heuristic stand-in for a model (tasks.desktop.scripted).

**Metrics** per judge: task-level 1-MAE of the fraction scores (bootstrap over episodes) and
Cohen's kappa of the per-subgoal labels pooled over episodes (bootstrap over subgoals), with
seeded 95% percentile intervals (metrics.py).
"""
from __future__ import annotations

import asyncio
import base64
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...core.errors import InvalidArgument, LLMUnavailable
from .metrics import bootstrap_ci, cohen_kappa, one_minus_mae
from .task import DesktopTask

DETOUR = ["pyautogui.moveTo(700, 500)", "pyautogui.moveTo(30, 30)", "WAIT"]


@dataclass
class Plan:
    """One synthetic episode: the task's oracle with detours {before oracle step i: steps}, typos
    {oracle step i: text typed instead} and the last `cut` oracle steps left out."""

    task: str
    name: str
    detours: dict[int, list[Any]] = field(default_factory=dict)
    typos: dict[int, str] = field(default_factory=dict)
    cut: int = 0

    def spec(self) -> dict:
        return {"kind": "oracle", "name": f"oracle+{self.name}",
                "detours": {str(k): v for k, v in self.detours.items()},
                "typos": {str(k): v for k, v in self.typos.items()}, "cut": self.cut}


def default_plans() -> list[Plan]:
    """A handful of episodes over the editor tasks (the ones every test root builds)."""
    return [
        Plan("editor-append-and-save", "detour", detours={3: DETOUR}),
        Plan("editor-append-and-save", "typo-cut", detours={1: DETOUR[:2]}, typos={5: "cal mom\n"}, cut=2),
        Plan("editor-append-and-save", "cut", detours={6: DETOUR}, cut=4),
        Plan("editor-new-file-save-as", "detour", detours={2: DETOUR, 5: DETOUR[:1]}),
        Plan("editor-new-file-save-as", "cut", detours={1: DETOUR}, cut=5),
        Plan("robust-editor-append-and-save", "detour-cut", detours={4: DETOUR}, cut=2),
    ]


def step_labels(task: DesktopTask, plan: Plan, oracle_map: list[list[str]]) -> list[list[str]]:
    """Per step of the planned episode: the subgoals a careful annotator marks it as advancing."""
    deps = {g.id: g.depends_on for g in task.subgoals}
    done: set[str] = set()
    labels: list[list[str]] = []
    n = len(task.oracle) - plan.cut
    for i in range(n + 1):
        labels += [[] for _ in plan.detours.get(i, [])]
        if i == n:
            break
        adv: list[str] = []
        if not any(j <= i for j in plan.typos):  # a typo spoils the rest of the oracle's plan
            for g in oracle_map[i]:  # in the order fulfilled: one step may fulfil a chain
                if all(d in done for d in deps[g]):
                    done.add(g)
                    adv.append(g)
        labels.append(adv)
    return labels


def subgoal_labels(task: DesktopTask, steps: list[list[str]]) -> list[bool]:
    got = {g for s in steps for g in s}
    return [g.id in got for g in task.subgoals]


# ------------------------------------------------------------------------------------------ judges
Judge = Callable[[DesktopTask, dict, bytes], list[bool]]


def programmatic(task: DesktopTask, record: dict, final_png: bytes) -> list[bool]:
    """The runner's tracking: each subgoal's check in the sandbox after every step."""
    return [t is not None for t in record["fulfilled_at"]]


def _history(record: dict) -> list[Any]:
    return [json.loads(r["text"]) if r["text"].startswith("{") else r["text"] for r in record["records"]]


def judge_messages(task: DesktopTask, subgoal_id: str, record: dict, final_png: bytes) -> list[dict]:
    g = next(x for x in task.subgoals if x.id == subgoal_id)
    hist = "\n".join(json.dumps(h, ensure_ascii=False) for h in _history(record))
    text = (f"You judge whether one subgoal of a desktop task was fulfilled by the agent's episode.\n"
            f"TASK: {json.dumps(task.instruction, ensure_ascii=False)}\nSUBGOAL: {g.id}\n"
            f"DESCRIPTION: {g.description}\nRUBRIC: {g.rubric or g.description}\n"
            f"HISTORY:\n{hist}\nEND HISTORY\n"
            'The final screen is attached. Answer with JSON only: {"fulfilled": true} or {"fulfilled": false}.')
    url = "data:image/png;base64," + base64.b64encode(final_png).decode()
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


def parse_verdict(text: str) -> bool:
    m = re.search(r"\{.*\}", text, re.S)
    if m:
        try:
            v = json.loads(m.group(0)).get("fulfilled")
            if isinstance(v, bool):
                return v
        except (ValueError, AttributeError):
            pass
    word = text.strip().lower()
    if word.startswith(("yes", "true")):
        return True
    if word.startswith(("no", "false")):
        return False
    raise InvalidArgument(f"the judge's answer is not a verdict: {text[:200]!r}")


def chat_judge(url: str, model: str, api_key: str | None = None, timeout_s: float = 120.0) -> Judge:
    """An OpenAI-compatible vision endpoint as a judge: one request per subgoal."""
    import httpx

    base = url.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def judge(task: DesktopTask, record: dict, final_png: bytes) -> list[bool]:
        out = []
        with httpx.Client(timeout=timeout_s, headers=headers) as c:
            for g in task.subgoals:
                r = c.post(f"{base}/chat/completions", json={
                    "model": model, "temperature": 0, "max_tokens": 50,
                    "messages": judge_messages(task, g.id, record, final_png)})
                if r.status_code != 200:
                    raise LLMUnavailable(f"judge {model} at {base}: HTTP {r.status_code}: {r.text[:300]}")
                out.append(parse_verdict(r.json()["choices"][0]["message"]["content"] or ""))
        return out

    return judge


# ------------------------------------------------------------------------------------------ running
def oracle_map_of(record: dict, n_steps: int) -> list[list[str]]:
    """From a clean oracle episode's record: per oracle step, the subgoals it fulfilled."""
    out: list[list[str]] = [[] for _ in range(n_steps)]
    for r_i, r in enumerate(record["records"]):
        out[r_i] = list(r["fulfilled"])
    return out


async def _episode(task: Any, spec: dict, log: Any, backend: Any, eid: str) -> tuple[dict, dict]:
    from ...rollout.episode import run_episode
    from ...rollout.policy import make_policy

    pol = make_policy(spec, task)
    rec = await run_episode(task, pol, log, backend, eid, max_steps=80)
    await pol.aclose()
    try:
        backend.kill(rec.sandbox)
    except Exception:  # noqa: BLE001 - already gone
        pass
    return json.loads(rec.patch), rec.report


def run(backend: Any, log_path: str | Path, plans: list[Plan] | None = None,
        judges: dict[str, Judge] | None = None, n_boot: int = 2000, seed: int = 0) -> dict:
    """Run the clean oracle of each planned task and every plan; judge; compute the agreement."""
    from ...trajlog import TrajectoryLog
    from ...trajlog.blobs import blobs_for
    from .runner import load_desktop_tasks

    plans = plans or default_plans()
    judges = judges or {"programmatic": programmatic}
    tasks = {t.id: t for t in load_desktop_tasks()}
    log = TrajectoryLog(str(log_path))
    blobs = blobs_for(log)
    stamp = str(int(time.time() * 1000))
    maps: dict[str, list[list[str]]] = {}
    t0 = time.perf_counter()
    for tid in dict.fromkeys(p.task for p in plans):
        rec, rep = asyncio.run(_episode(tasks[tid], {"kind": "oracle"}, log, backend, f"agree-{stamp}-{tid}-clean"))
        if not rep["complete"]:
            raise InvalidArgument(f"the clean oracle of {tid} did not fulfil every subgoal: {rep['subgoals']}")
        maps[tid] = oracle_map_of(rec, len(tasks[tid].task.oracle))
    episodes = []
    for k, p in enumerate(plans):
        t = tasks[p.task].task
        rec, rep = asyncio.run(_episode(tasks[p.task], p.spec(), log, backend, f"agree-{stamp}-{k}-{p.name}"))
        steps = step_labels(t, p, maps[p.task])
        if len(steps) != rec["steps"]:
            raise InvalidArgument(f"plan {p.name} on {p.task}: {len(steps)} labelled steps, {rec['steps']} run")
        human = subgoal_labels(t, steps)
        final = blobs.get(rec["records"][-1]["shot"])
        verdicts = {name: j(t, rec, final) for name, j in judges.items()}
        episodes.append({"task": p.task, "plan": p.name, "steps": rec["steps"], "step_labels": steps,
                         "labels": human, "judges": verdicts, "runner": {k2: rep[k2] for k2 in
                                                                         ("fraction", "prefix", "drift", "typing")}})
    result: dict[str, Any] = {"episodes": episodes, "bootstrap": {"n": n_boot, "seed": seed, "level": 0.95},
                              "wall_s": time.perf_counter() - t0, "agreement": {}}
    for name in judges:
        result["agreement"][name] = agreement([e["labels"] for e in episodes], [e["judges"][name] for e in episodes],
                                              n_boot, seed)
    return result


def agreement(human: list[list[bool]], judge: list[list[bool]], n_boot: int = 2000, seed: int = 0) -> dict:
    """Task-level 1-MAE (fractions) and pooled per-subgoal kappa, each with a bootstrap interval."""
    hf = [sum(h) / len(h) for h in human]
    jf = [sum(j) / len(j) for j in judge]
    hs = [x for h in human for x in h]
    js = [x for j in judge for x in j]
    return {"episodes": len(human), "subgoals": len(hs),
            "one_minus_mae": one_minus_mae(jf, hf), "one_minus_mae_ci": bootstrap_ci(one_minus_mae, jf, hf, n_boot,
                                                                                      seed=seed),
            "kappa": cohen_kappa(js, hs), "kappa_ci": bootstrap_ci(cohen_kappa, js, hs, n_boot, seed=seed),
            "subgoal_agreement": sum(a == b for a, b in zip(js, hs, strict=True)) / len(hs)}


def main() -> None:
    import argparse
    import tempfile

    from ...host import Host

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default="/var/tmp/shoal-desktop", help="a Shoal root with the desktop images")
    ap.add_argument("--judge-url", default=None, help="an OpenAI-compatible endpoint (default: spawn the scripted "
                                                      "server and use its desktop-judge)")
    ap.add_argument("--judge-model", default="desktop-judge")
    ap.add_argument("--out", default="bench/results/desktop_agreement.json")
    a = ap.parse_args()
    host = Host.get(a.root)
    proc = None
    url = a.judge_url
    if url is None:
        from ...rollout.scripted_server import spawn

        proc, url = spawn()
    try:
        with tempfile.TemporaryDirectory(prefix="shoal-agree-") as d:
            res = run(host, Path(d) / "traj.db",
                      judges={"programmatic": programmatic, f"chat:{a.judge_model}": chat_judge(url, a.judge_model)})
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
    res["judge_url"] = "scripted server (spawned)" if a.judge_url is None else a.judge_url
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res["agreement"], indent=1))


if __name__ == "__main__":
    main()
