"""Episodes through the agent loop on real task sandboxes: the scripted policies' floors and
ceilings, fast-forward of a finished episode, and restore when its sandbox is gone."""
from __future__ import annotations

import asyncio

import pytest

from shoal.rollout.episode import run_episode
from shoal.rollout.policy import make_policy
from shoal.trajlog import TrajectoryLog

pytestmark = pytest.mark.slow


@pytest.fixture
def log(tmp_path):
    return TrajectoryLog(tmp_path / "traj.db")


def _run(task, kind, log, host, eid, **kw):
    return asyncio.run(run_episode(task, make_policy({"kind": kind}, task), log, host, eid, **kw))


def test_oracle_resolves_null_does_not_random_edits(host, few_tasks, log):
    for i, task in enumerate(few_tasks):
        o = _run(task, "oracle", log, host, f"o{i}")
        assert o.resolved and o.reward == 1.0 and o.submitted and o.report["f2p_rate"] == 1.0
        assert [a["tool"] for a in o.actions] == ["create_file", "shell", "submit"]
        assert o.patch.strip() and o.layers and o.timings["grade_s"] > 0
        n = _run(task, "null", log, host, f"n{i}")
        assert not n.resolved and n.reward == 0.0 and n.patch == "" and n.report["status"] == "RESOLVED_NO"
        r = _run(task, "random", log, host, f"r{i}")  # may even fix an operator bug by luck
        assert r.steps >= 3 and r.report["status"] in ("RESOLVED_FULL", "RESOLVED_PARTIAL", "RESOLVED_NO")
        assert any(a["tool"] == "edit_file" and not a["error"] for a in r.actions) == bool(r.patch)


def test_a_finished_episode_fast_forwards_without_running_anything(host, few_tasks, log):
    task = few_tasks[0]
    first = _run(task, "oracle", log, host, "ff", keep_sandbox=True)
    assert first.executed == {"sandbox": 4, "llm": 3, "eval": 1}
    again = _run(task, "oracle", log, host, "ff")
    assert again.executed == {"sandbox": 0, "llm": 0, "eval": 0}
    assert again.replayed == {"sandbox": 4, "llm": 3, "eval": 1}
    assert again.sandbox == first.sandbox and again.restored_ops == 0  # the live sandbox was reattached
    assert (again.reward, again.patch, again.messages) == (first.reward, first.patch, first.messages)


def test_lost_sandbox_is_rebuilt_from_the_log(host, few_tasks, log):
    task = few_tasks[1]
    first = _run(task, "oracle", log, host, "lost")  # its sandbox is killed at the end
    again = _run(task, "oracle", log, host, "lost")
    # re-applied: create_file's mkdir + write, git apply, the diff's `git add -A`
    assert again.sandbox != first.sandbox and again.restored_ops == 4
    assert again.executed["llm"] == 0 and again.patch == first.patch and again.resolved
    # provenance: the ops ran in the first sandbox; the stream now points at the new one
    assert {e.sandbox for e in log.query(episode="lost", kind="exec")} == {first.sandbox}
    assert log.info("lost/sandbox").meta["sandbox"] == again.sandbox
