"""bench/launch_steps.py: launch steps grouped, tabled and drawn from a density JSON's "launch"."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from shoal.backends.container.backend import LAUNCH_STEPS, launch_phases_ms, parse_helper_marks

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "launch_steps.py"


@pytest.fixture(scope="module")
def ls():
    spec = importlib.util.spec_from_file_location("launch_steps_bench", SCRIPT)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["launch_steps_bench"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_helper_marks_parse_and_become_consecutive_intervals():
    marks = parse_helper_marks("exec:1000000,forked:1000500,bad,clone:x,joined:1003500")
    assert marks == [("exec", 1.0), ("forked", 1.0005), ("joined", 1.0035)]  # malformed entries dropped
    assert launch_phases_ms([("start", 0.999)] + marks) == {"exec": 1.0, "forked": 0.5, "joined": 3.0}


def test_every_launch_step_is_in_exactly_one_group(ls):
    grouped = [s for _, members in ls.GROUPS for s in members]
    assert sorted(grouped) == sorted((*LAUNCH_STEPS, "outside"))
    steps = {s: 1.0 for s in LAUNCH_STEPS} | {"outside": 2.0, "from_a_newer_build": 4.0}
    g = ls.grouped(steps)
    assert sum(g) == len(LAUNCH_STEPS) + 2.0 + 4.0  # nothing lost: an unknown step counts under Python
    assert g[0] == 2.0


def test_renders_a_table_and_a_png(ls, tmp_path):
    steps = {s: 0.5 for s in LAUNCH_STEPS}
    slow = dict(steps, joined=300.0, outside=1.0)
    launch = {"sample_every": 50, "slow_creates": 1, "slow_by_worst_step": {"joined": 1},
              "ordinary_by_tenth": [{"n_upto": 100 * k, "samples": 2, "p50_ms": dict(steps, outside=1.0)}
                                    for k in range(1, 11)],
              "slowest": [{"n": 700, "ms": 310.5, "worst_step": "joined", "worst_ms": 300.0, "steps": slow}]}
    res = {"profiles": {"shell": {"sides": {"shoal": {"runs": [{"n_held": 1000, "launch": launch},
                                                              {"n_held": 10}]}}}}}
    path = tmp_path / "fill.json"
    path.write_text(json.dumps(res))
    assert ls.main([str(path)]) == 0
    assert (tmp_path / "fill-launch.png").stat().st_size > 5000
    assert "cgroup joins | 0.50 | 0.50" in ls.table(ls.runs_with_launch(res))
    (tmp_path / "none.json").write_text(json.dumps({"profiles": {}}))
    assert ls.main([str(tmp_path / "none.json")]) == 1  # nothing to draw is said, not an empty figure
