"""A fixed, representative sample of the bundled suite validated on real desktop sandboxes, the way
bench/desktop_suite.py validates all of it (bench/results/desktop_suite.json): nothing fulfilled
before the oracle, every subgoal after it, in dependency order. The sample covers the categories
the editor tasks of test_tasks.py do not: a Coordination task over three apps (the browser's DOM,
the clipboard into the editor, Thunar copying the saved file) and a Robustness task on the icewm
variant. The whole suite's schema is checked in tests/unit/test_desktop_suite.py."""
from __future__ import annotations

import pytest

from shoal.envs.desktop import ensure_desktop
from shoal.tasks.desktop.task import load_suite
from shoal.tasks.desktop.validation import validate_task

SAMPLE = ("coord-quote-clipboard", "robust-browser-checklist")


@pytest.mark.parametrize("tid", SAMPLE)
def test_sample_task_validates(host, desktop_images, tid):
    task = next(t for t in load_suite() if t.id == tid)
    ensure_desktop(host, apps=tuple(task.apps), variant=task.variant)  # cached per host after the first
    rec = validate_task(host, task)
    assert rec.get("error") is None, rec.get("trace")
    assert rec["fulfilled_before"] == 0, rec
    assert rec["fulfilled_after"] == len(task.subgoals), rec["unfulfilled"]
    assert rec["in_order"] and rec["ok"], rec
