"""The bundled suite's bar (issue 18 section 3) and its validation, task by task.

`suite_figures(tasks)` counts what the issue asks of the suite (tasks, apps, categories, subgoals
per task, Coordination tasks over 3+ apps, tasks on the Robustness variant); `suite_problems` says
which part of the bar a suite misses. `validate_task` runs one task like the SWE tasks are
validated: in a fresh sandbox, nothing fulfilled before, then the oracle, which must fulfil every
subgoal, in dependency order. bench/desktop_suite.py runs it over the whole suite and writes
bench/results/desktop_suite.json."""
from __future__ import annotations

import time
import traceback
from collections import Counter
from typing import Any

from .task import DesktopTask, validate

# issue 18 section 3
BAR = {"tasks": 24, "apps": 4, "mean_subgoals": 5.0, "coordination_3apps": 6, "variant_tasks": 6}
CATEGORIES = ("Diversity", "Coordination", "Robustness")


def suite_figures(tasks: list[DesktopTask]) -> dict[str, Any]:
    n_sub = [len(t.subgoals) for t in tasks]
    return {
        "tasks": len(tasks),
        "apps": sorted({a for t in tasks for a in t.apps}),
        "by_category": {c: sum(t.category == c for t in tasks) for c in CATEGORIES},
        "by_app": dict(sorted(Counter(a for t in tasks for a in t.apps).items())),
        "subgoals": sum(n_sub),
        "mean_subgoals": sum(n_sub) / len(tasks) if tasks else 0.0,
        "min_subgoals": min(n_sub, default=0),
        "max_subgoals": max(n_sub, default=0),
        "coordination_3apps": sum(t.category == "Coordination" and len(set(t.apps)) >= 3 for t in tasks),
        "variant_tasks": sum(t.variant for t in tasks),
        "mean_apps": sum(len(set(t.apps)) for t in tasks) / len(tasks) if tasks else 0.0,
        "programmatic_checks": sum(g.check is not None for t in tasks for g in t.subgoals),
        "check_types": dict(sorted(Counter(g.check.type for t in tasks for g in t.subgoals
                                           if g.check is not None).items())),
    }


def suite_problems(tasks: list[DesktopTask]) -> list[str]:
    """What the suite misses of the issue's bar (empty when it meets it)."""
    f = suite_figures(tasks)
    out = []
    if f["tasks"] < BAR["tasks"]:
        out.append(f"{f['tasks']} tasks, fewer than {BAR['tasks']}")
    if len(f["apps"]) < BAR["apps"]:
        out.append(f"{len(f['apps'])} apps, fewer than {BAR['apps']}")
    if f["mean_subgoals"] < BAR["mean_subgoals"]:
        out.append(f"{f['mean_subgoals']:.2f} subgoals per task on average, fewer than {BAR['mean_subgoals']}")
    missing = [c for c, n in f["by_category"].items() if n == 0]
    if missing:
        out.append(f"no task in {missing}")
    if f["coordination_3apps"] < BAR["coordination_3apps"]:
        out.append(f"{f['coordination_3apps']} Coordination tasks over 3+ apps, fewer than {BAR['coordination_3apps']}")
    if f["variant_tasks"] < BAR["variant_tasks"]:
        out.append(f"{f['variant_tasks']} tasks on the Robustness variant, fewer than {BAR['variant_tasks']}")
    ids = [t.id for t in tasks]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        out.append(f"task ids repeat: {dup}")
    no_check = [t.id for t in tasks if not any(g.check is not None for g in t.subgoals)]
    if no_check:
        out.append(f"tasks without any programmatic check: {no_check}")
    no_oracle = [t.id for t in tasks if not t.oracle]
    if no_oracle:
        out.append(f"tasks without an oracle: {no_oracle}")
    return out


def validate_task(backend: Any, task: DesktopTask) -> dict[str, Any]:
    """One task's validation record: subgoals fulfilled before (must be 0) and after the oracle
    (must be all), whether they were fulfilled in order, the oracle's steps and the seconds taken."""
    t0 = time.monotonic()
    rec: dict[str, Any] = {"id": task.id, "category": task.category, "apps": task.apps, "variant": task.variant,
                           "subgoals": len(task.subgoals), "oracle_steps": len(task.oracle)}
    try:
        before, ep = validate(backend, task)
    except Exception as e:  # a broken task is a record, not the end of the suite's run
        rec.update(ok=False, error=f"{type(e).__name__}: {e}"[:500], trace=traceback.format_exc()[-1500:],
                   seconds=round(time.monotonic() - t0, 2))
        return rec
    at = ep.fulfilled_at
    done = [x for x in at if x is not None]
    rec.update(fulfilled_before=sum(before), fulfilled_after=len(done), fulfilled_at=at,
               in_order=done == sorted(done),
               unfulfilled=[g.id for g, x in zip(task.subgoals, at, strict=True) if x is None],
               seconds=round(time.monotonic() - t0, 2))
    rec["ok"] = rec["fulfilled_before"] == 0 and rec["fulfilled_after"] == len(task.subgoals) and rec["in_order"]
    return rec
