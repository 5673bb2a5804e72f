"""The LLM judge over a real OpenAI-compatible server (the project's scripted server, model
"judge"): JSON-schema requests, answers parsed and validated, retries on invalid output, outages,
and a request for step k that is the same whatever came after k."""
from __future__ import annotations

import asyncio
import socket

import pytest

from shoal.core.errors import InvalidArgument, LLMUnavailable
from shoal.flare.judge import JudgeOutputInvalid, LLMJudge, parse_answer, render
from shoal.flare.programmatic import ProgrammaticDiagnoser
from shoal.flare.schema import Action, ErrorClass, Prefix, Risk, StepView, Trace
from shoal.rollout import scripted_server

from .test_diagnosis import START, step


@pytest.fixture(scope="module")
def url():
    proc, base = scripted_server.spawn()
    yield base
    proc.terminate()
    proc.wait()


def _trace(future: StepView) -> Trace:
    s1 = step(1, ("view_file", {"path": "pkg/core.py"}, "1\tx", False))
    s2 = step(2, ("shell", {"command": "echo >> tests/test_a.py"}, "[exit code 0]", False),
              protected_changed=["tests/test_a.py"], changed={"tests/test_a.py": "M"}, diff_sha="1")
    return Trace(task="t", problem="fix the bug", start=START, steps=[s1, s2, future])


def _judge(url, model="judge", **kw):
    return LLMJudge(url, model, backoff_s=0.01, **kw)


def test_judge_over_http_agrees_with_the_rules_it_is_scripted_with(url):
    trace = _trace(step(3, ("submit", {}, "submitted", False), changed={"tests/test_a.py": "M"}, diff_sha="1"))
    judge = _judge(url)

    async def go():
        try:
            return [await judge.diagnose(trace.prefix(k)) for k in (1, 2, 3)]
        finally:
            await judge.aclose()

    got = asyncio.run(go())
    want = [ProgrammaticDiagnoser().diagnose_now(trace.prefix(k)) for k in (1, 2, 3)]
    assert [(d.step, d.risk, d.error_class) for d in got] == [(d.step, d.risk, d.error_class) for d in want]
    assert got[1].error_class == ErrorClass.test_tampering and got[1].diagnoser == "judge:judge"
    assert judge.invalid == 0 and judge.calls == 3 and judge.tokens > 0
    body = judge.request(trace.prefix(2))
    assert body["response_format"]["json_schema"]["schema"]["properties"]["risk"]["enum"][-1] == "critical"
    assert "test-tampering: changes tests" in body["messages"][0]["content"]  # the taxonomy is in the prompt


def test_invalid_answers_are_retried_then_refused(url):
    p = _trace(step(3, ("submit", {}, "submitted", False))).prefix(2)

    async def go(model, retries):
        j = _judge(url, model, retries=retries)
        try:
            return await j.diagnose(p), j
        finally:
            await j.aclose()

    d, j = asyncio.run(go("judge-bad:2", 2))  # no JSON, then an unknown risk, then valid
    assert d.risk == Risk.critical and j.invalid == 2 and j.calls == 3
    with pytest.raises(JudgeOutputInvalid, match="3 tries"):
        asyncio.run(go("judge-bad:3", 2))


def test_step_k_is_judged_from_its_prefix_only(url):
    a = _trace(step(3, ("submit", {}, "submitted", False), f2p_failed=[]))
    b = _trace(step(3, ("shell", {"command": "rm -rf .git"}, "", False), git_ok=False))
    j = _judge(url)
    assert j.request(a.prefix(2)) == j.request(b.prefix(2))
    assert j.request(a.prefix(3)) != j.request(b.prefix(3))
    assert "rm -rf" not in render(b.prefix(2), j.template)
    asyncio.run(j.aclose())


def test_parse_answer_and_bad_endpoints():
    ok = parse_answer('Here: {"risk": "high", "error_class": "wrong-file", "evidence": "e", "fix": "f"}', 4, "x")
    assert (ok.step, ok.risk, ok.error_class) == (4, Risk.high, ErrorClass.wrong_file)
    for bad, why in (("none", "no JSON"), ('{"risk": "high"}', "schema"), ('[1]', "JSON"),
                     ('{"risk": "low", "error_class": "none", "evidence": "", "fix": "", "x": 1}', "unexpected")):
        with pytest.raises(InvalidArgument, match=why):
            parse_answer(bad, 1, "x")
    with pytest.raises(InvalidArgument):
        LLMJudge("ftp://x", "m")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once the socket is closed
    j = LLMJudge(f"http://127.0.0.1:{port}", "m", http_retries=1, backoff_s=0.01)
    p = Prefix(task="t", steps=(StepView(step=1, actions=[Action(tool="submit")]),))
    with pytest.raises(LLMUnavailable, match="2 times"):
        asyncio.run(j.diagnose(p))
