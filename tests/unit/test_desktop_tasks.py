"""Process-level scoring and agreement metrics against hand-computed values; the task schema's
validation; the bundled suite parses."""
from __future__ import annotations

import pytest

from shoal.core.errors import InvalidArgument
from shoal.tasks.desktop.metrics import bootstrap_ci, cohen_kappa, drift, one_minus_mae
from shoal.tasks.desktop.task import TaskScore, by_category, load_suite, load_task


def test_scores_by_hand():
    s = TaskScore("t", "Diversity", [True, True, False, True, False])
    assert s.fraction == pytest.approx(3 / 5) and s.prefix == pytest.approx(2 / 5) and not s.complete
    full = TaskScore("u", "Diversity", [True] * 4)
    none = TaskScore("v", "Coordination", [False, True])
    cats = by_category([s, full, none])
    assert cats["Diversity"] == {"tasks": 2, "completion": 0.5, "fraction": pytest.approx((0.6 + 1) / 2),
                                 "prefix": pytest.approx((0.4 + 1) / 2)}
    assert cats["Coordination"]["fraction"] == 0.5 and cats["Coordination"]["prefix"] == 0.0


def test_agreement_by_hand():
    # |0.9-1| + |0.5-0.25| + |0-0| + |1-0.5| = 0.1 + 0.25 + 0 + 0.5 = 0.85; mean 0.2125
    assert one_minus_mae([0.9, 0.5, 0.0, 1.0], [1.0, 0.25, 0.0, 0.5]) == pytest.approx(78.75)
    # 10 items: both yes 4, both no 3, judge yes/human no 2, judge no/human yes 1
    judge = [1] * 4 + [0] * 3 + [1] * 2 + [0]
    human = [1] * 4 + [0] * 3 + [0] * 2 + [1]
    po = 0.7
    pe = 0.6 * 0.5 + 0.4 * 0.5  # judge yes 6/10, human yes 5/10
    assert cohen_kappa(judge, human) == pytest.approx((po - pe) / (1 - pe))  # 0.4
    assert cohen_kappa([1, 1], [1, 1]) == 1.0 and cohen_kappa([1, 0, 1], [1, 0, 1]) == 1.0
    lo, hi = bootstrap_ci(cohen_kappa, judge, human, n=500)
    assert lo <= 0.4 <= hi and -1 <= lo < hi <= 1
    assert bootstrap_ci(cohen_kappa, judge, human, n=500) == (lo, hi)  # seeded
    with pytest.raises(InvalidArgument):
        one_minus_mae([1.5], [1])
    with pytest.raises(InvalidArgument):
        cohen_kappa([1], [1, 0])


def test_drift_by_hand():
    assert drift([True, False, False, True, False, False, False, True, False]) == \
        {"runs": 3, "longest": 3, "steps": 6}
    assert drift([True, True]) == {"runs": 0, "longest": 0, "steps": 0}
    assert drift([]) == {"runs": 0, "longest": 0, "steps": 0}


def _task(subgoals):
    return {"id": "t", "instruction": "x", "category": "Diversity", "apps": ["editor"], "subgoals": subgoals}


def test_schema_is_checked():
    ok = {"id": "a", "description": "a", "check": {"type": "file_exists", "path": "/x"}}
    load_task(_task([ok, {"id": "b", "description": "b", "depends_on": ["a"], "rubric": "judge it"}]))
    bad = [
        [ok, ok],  # repeated id
        [{"id": "b", "description": "b", "depends_on": ["a"], "rubric": "r"}, ok],  # depends on a later one
        [{"id": "a", "description": "a"}],  # neither check nor rubric
        [{"id": "a", "description": "a", "check": {"type": "shell", "cmd": "id"}}],  # unknown check
        [],
    ]
    for sg in bad:
        with pytest.raises(InvalidArgument):
            load_task(_task(sg))
    with pytest.raises(InvalidArgument):
        load_task({**_task([ok]), "category": "Other"})


def test_bundled_suite_parses():
    tasks = load_suite()
    assert len(tasks) >= 4 and all(t.oracle for t in tasks)
    assert {t.category for t in tasks} >= {"Diversity", "Robustness"}
    assert all(t.variant for t in tasks if t.category == "Robustness")


def test_osworld_task_converts():
    from shoal.tasks.desktop.osworld import from_osworld

    osw = {"id": "030eeff7", "snapshot": "chrome", "instruction": "Turn on Do Not Track in Chrome.",
           "source": "https://example.org", "related_apps": ["chrome"],
           "config": [{"type": "launch", "parameters": {"command": ["google-chrome", "--remote-debugging-port=1337"]}},
                      {"type": "launch",
                       "parameters": {"command": ["socat", "tcp-listen:9222,fork", "tcp:localhost:1337"]}}],
           "evaluator": {"func": "exact_match", "result": {"type": "enable_do_not_track"},
                         "expected": {"type": "rule", "rules": {"expected": "true"}}}}
    task, dropped = from_osworld(osw)
    assert task.id == "osworld-030eeff7" and task.apps == ["browser"]
    assert [(s.app, s.args) for s in task.setup] == [("browser", [])]
    assert len(task.subgoals) == 1 and task.subgoals[0].check is None and "exact_match" in task.subgoals[0].rubric
    assert len(dropped) == 1 and "socat" in dropped[0]
    with pytest.raises(InvalidArgument):
        from_osworld({"instruction": "x"})
