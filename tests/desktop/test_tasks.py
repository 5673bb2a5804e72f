"""Process-level evaluation on real desktop sandboxes: the bundled editor tasks are valid (nothing
fulfilled before, the oracle fulfils every subgoal, in order), a detouring policy's drift is
measured, and a null policy fulfils nothing."""
from __future__ import annotations

from shoal.tasks.desktop import report
from shoal.tasks.desktop.metrics import drift
from shoal.tasks.desktop.task import load_suite, open_task_sandbox, track, validate


def _task(tid):
    return next(t for t in load_suite() if t.id == tid)


def test_editor_tasks_validate(host, desktop_images):
    for tid in ("editor-append-and-save", "editor-new-file-save-as"):
        task = _task(tid)
        before, ep = validate(host, task)
        assert before == [False] * len(task.subgoals), tid
        assert all(t is not None for t in ep.fulfilled_at), (tid, ep.fulfilled_at)
        assert ep.fulfilled_at == sorted(ep.fulfilled_at), tid  # dependencies hold in time too
        assert ep.score.fraction == 1.0 and ep.score.prefix == 1.0


def test_detours_and_null_policy(host, desktop_images):
    task = _task("editor-append-and-save")
    detour = ["pyautogui.moveTo(600, 400)", "pyautogui.moveTo(620, 420)", "WAIT"]
    # three irrelevant steps after the first save, and the last two steps (quit) left out
    steps = task.oracle[:4] + detour + task.oracle[4:-2]
    sb = open_task_sandbox(host, task)
    try:
        ep = track(sb, task, steps, record=0.25)
    finally:
        sb.kill()
    page = report.render(ep)  # the filmstrip: one screenshot per step, subgoal marks, drift
    assert page.count("<figure") == len(steps) == len(ep.shots) and "✓ saved" in page and "not fulfilled" in page
    assert [t is not None for t in ep.fulfilled_at] == [True, True, True, True, False]
    assert ep.score.fraction == 0.8 and ep.score.prefix == 0.8
    d = drift(ep.advances)
    assert d["longest"] >= 3  # the detour (plus the steps between saves that fulfil nothing)

    sb = open_task_sandbox(host, task)
    try:
        null = track(sb, task, ["WAIT"] * 3)
    finally:
        sb.kill()
    assert null.fulfilled_at == [None] * 5 and drift(null.advances) == {"runs": 1, "longest": 3, "steps": 3}
