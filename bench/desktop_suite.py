#!/usr/bin/env python3
"""Validate the bundled desktop suite (issue 18 section 3): every task, in a fresh desktop sandbox,
has 0 subgoals fulfilled before its oracle and all of them (in dependency order) after it.

    flock /tmp/shoal-bench.lock .venv/bin/python bench/desktop_suite.py [--only ID ...] [--repeat N]
    .venv/bin/python bench/desktop_suite.py --rows      # docs/desktop.md's tables from the JSON

Builds (or finds cached) the desktop base, the four app layers and the Robustness variant on
--root (default $SHOAL_DESKTOP_ROOT or /var/tmp/shoal-desktop; the browser layer is large: the
first build takes minutes). Writes bench/results/desktop_suite.json: the suite's figures against
the issue's bar, and per task the subgoals, fulfilled before/after, whether in order and seconds.
Exit 1 if any task fails or the suite misses the bar."""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))
OUT = REPO / "bench" / "results" / "desktop_suite.json"


APPS = ("editor", "spreadsheet", "files", "browser")


def summary_rows(j: dict) -> list[str]:
    """docs/desktop.md's suite table: per category, tasks per app and subgoals (tests/test_docs_numbers.py)."""
    recs = j["tasks"]
    rows = []
    for cat in ("Diversity", "Coordination", "Robustness", "all"):
        xs = [r for r in recs if cat in ("all", r["category"])]
        n_sub = [r["subgoals"] for r in xs]
        ok = sum(r["ok"] for r in xs)
        rows.append(f"| {cat} | {len(xs)} | " + " | ".join(str(sum(a in r["apps"] for r in xs)) for a in APPS)
                    + f" | {sum(len(r['apps']) >= 3 for r in xs)} | {sum(r['variant'] for r in xs)} | {sum(n_sub)} "
                    f"| {sum(n_sub) / len(xs):.2f} | {ok}/{len(xs)} |")
    return rows


def task_rows(j: dict) -> list[str]:
    """docs/desktop.md's per-task table: subgoals, fulfilled before and after the oracle, seconds."""
    return [f"| `{r['id']}` | {r['category']} | {', '.join(r['apps'])}{' (icewm)' if r['variant'] else ''} "
            f"| {r['subgoals']} | {r.get('fulfilled_before', '-')} | {r.get('fulfilled_after', '-')} "
            f"| {r['seconds']:.1f} |" for r in j["tasks"]]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default=os.environ.get("SHOAL_DESKTOP_ROOT", "/var/tmp/shoal-desktop"))
    ap.add_argument("--only", nargs="*", default=None, help="task ids (default: all)")
    ap.add_argument("--repeat", type=int, default=1, help="validate each task this many times")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--rows", action="store_true", help="print docs/desktop.md's tables from --out and exit")
    args = ap.parse_args()
    if args.rows:
        j = json.loads(args.out.read_text())
        print("\n".join(summary_rows(j)) + "\n\n" + "\n".join(task_rows(j)))
        return 0

    from shoal import Host
    from shoal.envs.desktop import ensure_desktop
    from shoal.tasks.desktop.task import load_suite
    from shoal.tasks.desktop.validation import BAR, suite_figures, suite_problems, validate_task

    suite = load_suite()
    tasks = [t for t in suite if args.only is None or t.id in args.only]
    unknown = set(args.only or []) - {t.id for t in suite}
    if unknown:
        print(f"unknown task ids: {sorted(unknown)}", file=sys.stderr)
        return 2
    host = Host.get(args.root)
    t = time.monotonic()
    ensure_desktop(host, apps=sorted({a for x in tasks for a in x.apps}), variant=any(x.variant for x in tasks))
    build_s = time.monotonic() - t
    records = []
    t_all = time.monotonic()
    for task in tasks:
        for i in range(args.repeat):
            rec = validate_task(host, task)
            rec["repeat"] = i
            records.append(rec)
            print(f"{'ok  ' if rec['ok'] else 'FAIL'} {task.id:40s} {task.category:12s} "
                  f"before {rec.get('fulfilled_before', '-')}/{rec['subgoals']} "
                  f"after {rec.get('fulfilled_after', '-')}/{rec['subgoals']} {rec['seconds']:6.1f} s"
                  + (f"  {rec.get('error') or rec.get('unfulfilled')}" if not rec["ok"] else ""), flush=True)
    figures = suite_figures(suite)
    problems = suite_problems(suite)
    secs = [r["seconds"] for r in records]
    result = {"bench": "desktop_suite", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(),
              "kernel": platform.release(), "cpus": os.cpu_count(), "load_avg": os.getloadavg(),
              "args": {k: str(v) for k, v in vars(args).items()}, "build_or_cache_s": round(build_s, 1),
              "bar": BAR, "figures": figures, "problems": problems,
              "validated": len(records), "passed": sum(r["ok"] for r in records),
              "seconds_total": round(time.monotonic() - t_all, 1),
              "seconds_per_task": {"min": min(secs, default=0), "median": sorted(secs)[len(secs) // 2] if secs else 0,
                                   "max": max(secs, default=0)},
              "tasks": records}
    if args.only is None or args.out != OUT:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {args.out}")
    print(f"{result['passed']}/{result['validated']} validated in {result['seconds_total']} s; "
          f"problems: {problems or 'none'}")
    return 0 if result["passed"] == result["validated"] and not problems else 1


if __name__ == "__main__":
    raise SystemExit(main())
