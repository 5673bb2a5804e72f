"""The diagnosis schema, the programmatic diagnoser's rules and the training exports, on
hand-built prefixes (no sandbox): each rule is made to fire, and to stay quiet."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from shoal.flare.exports import (
    agent_loop_token_rewards,
    episode_return,
    flare_reward_fn,
    process_score,
    record_token_rewards,
    step_rewards,
    write_sft_jsonl,
)
from shoal.flare.programmatic import ProgrammaticDiagnoser
from shoal.flare.schema import TAXONOMY, Action, ErrorClass, Prefix, Risk, StepDiagnosis, StepView, Trace

START = {"git_ok": True, "changed": {}, "protected_changed": [], "deleted": [], "diff_sha": "0",
         "tests_ran": True, "f2p_failed": ["tests/test_a.py::test_bug"], "p2p_failed": [], "p2p_total": 4,
         "implicated": ["pkg/core.py"]}


def facts(**kw):
    return {**START, "tests_ran": True, **kw}


def step(k, *actions, **fk):
    return StepView(step=k, actions=[Action(tool=t, arguments=a, observation=o, error=e) for t, a, o, e in actions],
                    facts=facts(**fk) if fk or True else {})


def diagnose(*steps):
    return ProgrammaticDiagnoser().diagnose_now(Prefix(task="t", start=START, steps=tuple(steps)))


def test_schema_types_and_order():
    assert Risk.critical > Risk.high >= Risk.high > Risk.none and Risk.parse("medium").score == 0.5
    assert set(TAXONOMY) == set(ErrorClass)
    with pytest.raises(ValidationError):
        StepDiagnosis(step=1, risk="severe", error_class="none")
    with pytest.raises(ValidationError):
        StepDiagnosis(step=0, risk="low", error_class="none")
    with pytest.raises(ValidationError):  # a prefix is steps 1..k, dense
        Prefix(task="t", steps=(StepView(step=2),))
    with pytest.raises(Exception, match="outside"):
        Trace(task="t", steps=[StepView(step=1)]).prefix(2)


def test_each_rule_fires_and_stays_quiet():
    ok = step(1, ("view_file", {"path": "pkg/core.py"}, "1\tx", False))
    assert diagnose(ok).risk == Risk.none
    tamper = step(2, ("shell", {"command": "echo >> tests/test_a.py"}, "[exit code 0]", False),
                  changed={"tests/test_a.py": "M"}, protected_changed=["tests/test_a.py"], diff_sha="1")
    d = diagnose(ok, tamper)
    assert (d.risk, d.error_class) == (Risk.critical, ErrorClass.test_tampering) and "tests/test_a.py" in d.evidence
    assert d.step == 2 and d.fix
    # a fix in the right file, tests passing: nothing; submitting then: nothing
    fixed = step(2, ("edit_file", {"path": "pkg/core.py", "old_str": "a", "new_str": "b"}, "edited", False),
                 changed={"pkg/core.py": "M"}, f2p_failed=[], diff_sha="2")
    assert diagnose(ok, fixed).risk == Risk.none
    assert diagnose(ok, fixed, step(3, ("submit", {}, "submitted", False), changed={"pkg/core.py": "M"},
                                    f2p_failed=[], tests_ran=False)).risk == Risk.none
    # submit while the failing test still fails / with no change at all
    d = diagnose(ok, step(2, ("submit", {}, "submitted", False)))
    assert (d.risk, d.error_class) == (Risk.critical, ErrorClass.premature_submit)
    # a regression: a passing test fails after the edit
    broke = step(2, ("edit_file", {"path": "pkg/core.py", "old_str": "a", "new_str": "b"}, "edited", False),
                 changed={"pkg/core.py": "M"}, p2p_failed=["tests/test_a.py::test_ok"], diff_sha="3")
    d = diagnose(ok, broke)
    assert (d.risk, d.error_class) == (Risk.high, ErrorClass.destructive_edit)
    d = diagnose(ok, step(2, ("shell", {"command": "sed -i 20,$d pkg/core.py"}, "", False),
                          changed={"pkg/core.py": "M"}, p2p_failed=["a", "b", "c"], diff_sha="4"))
    assert d.risk == Risk.critical  # most of the passing tests broke
    # the wrong file: the failure points to pkg/core.py
    d = diagnose(ok, step(2, ("edit_file", {"path": "pkg/other.py", "old_str": "a", "new_str": "b"}, "edited", False),
                          changed={"pkg/other.py": "M"}, diff_sha="5"))
    assert (d.risk, d.error_class) == (Risk.medium, ErrorClass.wrong_file)
    d = diagnose(ok, step(2, ("edit_file", {"path": "pkg/core.py", "old_str": "a", "new_str": "b"}, "edited", False),
                          changed={"pkg/core.py": "M"}, diff_sha="6"))
    assert (d.risk, d.error_class) == (Risk.low, ErrorClass.wrong_hypothesis)
    # environment misuse, loops (2nd time medium, 3rd high), tool misuse
    d = diagnose(ok, step(2, ("shell", {"command": "pip install -U pytest"}, "", False), tests_ran=False))
    assert d.error_class == ErrorClass.environment_misuse and d.risk == Risk.medium
    again = step(2, ("view_file", {"path": "pkg/core.py"}, "1\tx", False), tests_ran=False)
    assert diagnose(ok, again).error_class == ErrorClass.loop and diagnose(ok, again).risk == Risk.medium
    third = step(3, ("view_file", {"path": "pkg/core.py"}, "1\tx", False), tests_ran=False)
    assert diagnose(ok, again, third).risk == Risk.high
    d = diagnose(ok, step(2, ("edit_file", {"path": "pkg/core.py", "old_str": "zz", "new_str": "b"},
                              "error: old_str occurs 0 times", True), tests_ran=False))
    assert (d.risk, d.error_class) == (Risk.low, ErrorClass.tool_misuse)


def test_a_diagnosis_depends_on_the_prefix_only():
    """Step k's diagnosis is the same whatever happens after k: the diagnoser is handed a Prefix,
    and a Prefix of two different futures is the same object."""
    s1 = step(1, ("view_file", {"path": "pkg/core.py"}, "1\tx", False))
    s2 = step(2, ("shell", {"command": "echo >> tests/test_a.py"}, "", False), protected_changed=["tests/test_a.py"])
    good_future = Trace(task="t", start=START, steps=[s1, s2, step(3, ("submit", {}, "submitted", False),
                                                                    f2p_failed=[])], resolved=True)
    bad_future = Trace(task="t", start=START, steps=[s1, s2, step(3, ("shell", {"command": "rm -rf .git"}, "", False),
                                                                   git_ok=False)], resolved=False)
    assert good_future.prefix(2) == bad_future.prefix(2)
    assert "resolved" not in Prefix.model_fields  # the outcome is not part of what a diagnoser sees
    dg = ProgrammaticDiagnoser()
    assert [dg.diagnose_now(good_future.prefix(k)) for k in (1, 2)] == \
           [dg.diagnose_now(bad_future.prefix(k)) for k in (1, 2)]


def _diags(*risks):
    return [StepDiagnosis(step=i + 1, risk=r, error_class="none" if r == "none" else "loop-no-progress")
            for i, r in enumerate(risks)]


def test_dense_reward_is_gated_by_the_outcome():
    d = _diags("none", "critical", "low")
    assert step_rewards(d, 1.0) == pytest.approx([0.1, -0.1, 0.05])
    assert step_rewards(d, 0.0) == [0.0, 0.0, 0.0]  # G-RA: a failed episode earns no step reward
    assert step_rewards(d, 0.0, gate="penalties") == pytest.approx([0.0, -0.1, 0.0])
    assert episode_return(d, 1.0) == pytest.approx(1.05) and episode_return(d, 0.0) == 0.0
    assert process_score(d) == pytest.approx((1 + 0 + 0.75) / 3)
    with pytest.raises(Exception, match="gate"):
        step_rewards(d, 1.0, gate="sometimes")


def test_token_rewards_align_with_the_records_token_ids():
    d = _diags("none", "high")
    rec = {"reward": 1.0, "turns": [{"token_ids": [5, 6, 7]}, {"token_ids": [8, 9]}]}
    per = record_token_rewards(rec, d)
    assert [len(x) for x in per] == [3, 2]
    assert per == [[0, 0, pytest.approx(0.1)], [0, pytest.approx(1.0 - 0.05)]]
    with pytest.raises(Exception, match="token_ids"):
        record_token_rewards({"reward": 1.0, "turns": [{}, {}]}, d)
    with pytest.raises(Exception, match="diagnoses"):
        record_token_rewards(rec, d[:1])
    out = SimpleNamespace(response_ids=[1, 2, 3, 4, 5, 6, 7], response_mask=[1, 1, 0, 0, 1, 1, 0], reward_score=1.0)
    flat = agent_loop_token_rewards(out, d)
    assert len(flat) == 7 and flat[1] == pytest.approx(0.1) and flat[5] == pytest.approx(0.95)
    assert flat[2:4] == [0.0, 0.0] and flat[6] == 0.0  # tool output tokens get nothing
    fn = flare_reward_fn(lambda o: d)
    r = fn(out)
    assert r["reward_score"] == pytest.approx(1.05) and r["token_level_rewards"] == flat


def test_sft_filter_ranks_by_process_score(tmp_path):
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c0", "type": "function", "function": {"name": "submit", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c0", "content": "submitted"}]
    clean = {"episode_id": "a", "resolved": True, "messages": msgs}
    risky = {"episode_id": "b", "resolved": True, "messages": msgs}
    failed = {"episode_id": "c", "resolved": False, "messages": msgs}
    items = [(risky, _diags("none", "high")), (failed, _diags("none")), (clean, _diags("none", "none"))]
    n = write_sft_jsonl(items, tmp_path / "sft.jsonl")
    rows = [json.loads(x) for x in (tmp_path / "sft.jsonl").read_text().splitlines()]
    assert n == 2 and len(rows) == 2  # the failed episode is dropped
    assert rows[0]["messages"][2]["tool_calls"][0]["function"]["arguments"] == {}  # objects, as chat templates want
    assert rows[0]["messages"][2]["content"] == "" and rows[0]["tools"][0]["type"] == "function"
    assert write_sft_jsonl(items, tmp_path / "top.jsonl", min_score=0.9) == 1


def test_diagnose_is_async_behind_one_interface():
    dg = ProgrammaticDiagnoser()
    p = Prefix(task="t", start=START, steps=(step(1, ("submit", {}, "submitted", False)),))
    assert asyncio.run(dg.diagnose(p)) == dg.diagnose_now(p)


def test_cli_taxonomy_and_export_sft(tmp_path):
    from typer.testing import CliRunner

    from shoal.cli import app

    r = CliRunner().invoke(app, ["flare", "taxonomy", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["risk"][-1] == "critical"
    msgs = [{"role": "user", "content": "u"}]
    eps = tmp_path / "eps.jsonl"
    eps.write_text(json.dumps({"resolved": True, "messages": msgs,
                               "diagnoses": [d.model_dump(mode="json") for d in _diags("none")]}) + "\n")
    r = CliRunner().invoke(app, ["flare", "export-sft", str(eps), str(tmp_path / "sft.jsonl")])
    assert r.exit_code == 0 and "1 of 1" in r.stdout
    eps.write_text('{"resolved": true}\n')
    r = CliRunner().invoke(app, ["flare", "export-sft", str(eps), str(tmp_path / "sft.jsonl")])
    assert r.exit_code != 0 and "not a diagnosed episode" in r.output


def test_trace_from_an_episode_record():
    rec = {"instance_id": "t1", "steps": 2, "resolved": False,
           "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "the bug"},
                        {"role": "assistant", "content": "look"}, {"role": "tool", "content": "x"},
                        {"role": "assistant", "content": "done"}, {"role": "tool", "content": "submitted"}],
           "actions": [{"step": 1, "tool": "view_file", "arguments": '{"path": "a.py"}', "observation": "x",
                        "error": False, "unknown": False},
                       {"step": 2, "tool": "submit", "arguments": "not json", "observation": "submitted",
                        "error": False, "unknown": False}]}
    tr = Trace.from_record(rec)
    assert [s.thought for s in tr.steps] == ["look", "done"] and tr.problem == "the bug" and tr.resolved is False
    assert tr.steps[0].actions[0].arguments == {"path": "a.py"}
    assert tr.steps[1].actions[0].arguments == {"__unparsed__": "not json"} and tr.steps[1].submitted
    d = ProgrammaticDiagnoser().diagnose_now(tr.prefix(2))  # no probe facts: the action rules only
    assert d.risk == Risk.none


def test_the_same_call_after_the_state_changed_is_not_a_loop():
    apply_ = ("shell", {"command": "git apply /tmp/fix.patch"}, "[exit code 0]", False)
    s1 = step(1, apply_, changed={"pkg/core.py": "M"}, f2p_failed=[], diff_sha="fixed")
    s2 = step(2, ("shell", {"command": "git checkout -- ."}, "", False), tests_ran=True, diff_sha="0")
    s3 = step(3, apply_, changed={"pkg/core.py": "M"}, f2p_failed=[], diff_sha="fixed")
    assert diagnose(s1, s2, s3).error_class != ErrorClass.loop  # re-applied after a reset: progress
    s3_again = step(3, apply_, diff_sha="fixed", f2p_failed=[], changed={"pkg/core.py": "M"})
    assert diagnose(s1, step(2, apply_, diff_sha="fixed", f2p_failed=[], changed={"pkg/core.py": "M"}),
                    s3_again).risk == Risk.medium  # twice since the state last changed (step 1 changed it)
