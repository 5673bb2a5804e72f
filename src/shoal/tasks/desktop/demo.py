"""`make demo`'s desktop section: the oracle and a detouring policy on a few desktop tasks, run by
rollout workers that are clients of shoald, then the process table (per subgoal and per task),
scores by category, and one episode's HTML report (filmstrip from the log's screenshot blobs)."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from ...host import Host
from .agreement import DETOUR

DEMO_TASKS = ("editor-append-and-save", "editor-new-file-save-as", "robust-editor-append-and-save")
# the oracle with a pointer detour before its third step and its last two steps (the quit) left out
DETOUR_POLICY: dict[str, Any] = {"kind": "oracle", "name": "oracle+detours", "detours": {"2": DETOUR}, "cut": 2}


def desktop_demo(host: Host, work: Path, url: str, console: Console) -> Path:
    from ...envs.desktop import ensure_desktop
    from ...rollout.runner import Rollout
    from ...trajlog import TrajectoryLog
    from ...trajlog.blobs import blobs_for
    from . import report
    from .runner import episode_of, load_desktop_tasks
    from .task import TaskScore, by_category

    tasks = [t for t in load_desktop_tasks() if t.id in DEMO_TASKS]
    console.print(Panel.fit("Shoal demo: desktop tasks, process-level scores (issue 18)", style="bold cyan"))
    t0 = time.perf_counter()
    with console.status("building the desktop images (X, openbox, mousepad, the icewm variant; first run only) ..."):
        ensure_desktop(host, apps=("editor",), variant=True)
    console.print(f"desktop images ready in {time.perf_counter() - t0:.1f} s")
    ro = Rollout(work / "desktop.db")
    for pol in ({"kind": "oracle"}, DETOUR_POLICY):
        ro.submit(tasks, pol, prefix=str(pol.get("name", pol["kind"])))
    ro.start_workers(2, url=url, concurrency=1, extra=["--kind", "desktop"], log_dir=work)
    t0 = time.perf_counter()
    try:
        counts = ro.wait(title="desktop episodes on 2 workers")
    finally:
        ro.stop_workers()
    recs = sorted(ro.records(), key=lambda r: (r["instance_id"], r["policy"]))
    byid = {t.id: t.task for t in tasks}
    tab = Table(title=f"process table: {counts['done']} desktop episodes in {time.perf_counter() - t0:.0f} s, "
                      f"{counts['failed']} failed. subgoals: the step that fulfilled each, in order (✗: never)")
    for col in ("task", "policy", "subgoals", "fulfilled", "prefix", "steps", "longest drift", "typing errors"):
        tab.add_column(col, justify="left" if col in ("task", "policy", "subgoals") else "right")
    scores = []
    for r in recs:
        rep, t = r["report"], byid[r["instance_id"]]
        marks = " ".join(f"[green]{at}[/]" if at is not None else "[red]✗[/]" for at in rep["fulfilled_at"])
        typ = rep["typing"]
        tab.add_row(r["instance_id"], r["policy"], marks, f"{rep['fraction']:.2f}", f"{rep['prefix']:.2f}",
                    str(rep["steps"]), str(rep["drift"]["longest"]),
                    f"{typ['edits']}/{typ['chars']}" if typ["chars"] else "-")
        scores.append((r["policy"], TaskScore(t.id, t.category, [x is not None for x in rep["fulfilled_at"]])))
    console.print(tab)
    for rt in tasks:
        console.print(f"  [dim]{rt.id} ({rt.task.category}) subgoals: {', '.join(g.id for g in rt.task.subgoals)}[/]")
    cat = Table(title="by category (per policy): completion rate, mean fraction, mean ordered prefix")
    for col in ("policy", "category", "tasks", "completion", "fraction", "prefix"):
        cat.add_column(col)
    for pol in dict.fromkeys(p for p, _ in scores):
        for c, row in by_category([s for p, s in scores if p == pol]).items():
            cat.add_row(pol, c, str(int(row["tasks"])), f"{row['completion']:.2f}", f"{row['fraction']:.2f}",
                        f"{row['prefix']:.2f}")
    console.print(cat)
    pick = next(r for r in recs if r["policy"] == DETOUR_POLICY["name"])
    blobs = blobs_for(TrajectoryLog(ro.log_path))
    page = report.write(episode_of(byid[pick["instance_id"]], json.loads(pick["patch"]), blobs),
                        work / f"report-{pick['instance_id']}.html")
    console.print(Panel.fit(f"one episode's HTML report (filmstrip, subgoal marks, drift): {page}\n"
                            f"episodes' screenshots: {blobs.root}; trajectory log: {ro.log_path}",
                            title="report", style="green"))
    return page
