"""The judge and the LLM policy against a real model: a tiny GPT-2 trained here (no download), served
by the project's OpenAI-compatible server (`--model`, rollout.local_chat). It checks the real path
(JSON-schema output enforced by the server, retries when the model writes no valid JSON, token
ids from the model's own tokenizer); what such a model is worth is measured in bench/flare.py
(`--part local-model`), not asserted here."""
from __future__ import annotations

import asyncio
import json

import pytest

from shoal.flare.exports import record_token_rewards
from shoal.flare.judge import JudgeOutputInvalid, LLMJudge
from shoal.flare.programmatic import ProgrammaticDiagnoser
from shoal.flare.schema import Action, ErrorClass, Prefix, Risk, StepView, Trace
from shoal.rollout import scripted_server
from shoal.rollout.episode import run_episode
from shoal.rollout.policy import ChatEndpointPolicy
from shoal.trajlog import TrajectoryLog

pytestmark = pytest.mark.slow

PREFIX = Prefix(task="t", problem="fix the bug in pkg/core.py", steps=(
    StepView(step=1, actions=[Action(tool="shell", arguments={"command": "rm -rf .git"}, observation="")]),))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from shoal.annotate.demo_models import make_bpe_model

    return make_bpe_model(tmp_path_factory.mktemp("lm") / "tiny-gpt2", steps=20)  # its skill is not tested


@pytest.fixture(scope="module")
def server(model):
    proc, url = scripted_server.spawn("--model", str(model), timeout=300)
    yield url
    proc.terminate()
    proc.wait()


def test_constrained_output_is_the_models_own_choice(model):
    """An enum property takes the option the model scores highest; a string property is what it
    generates, cut at a quote or newline; the result is always valid JSON of the schema."""
    from shoal.annotate.model import LocalModel
    from shoal.rollout.local_chat import _constrained

    lm = LocalModel.load(model)
    tok = lm.tokenizer
    prompt = tok.encode("The agent reads the file")
    opts = ["the tests pass", "沙箱在四毫秒内启动"]
    out = json.loads(_constrained(lm, prompt, {"type": "object", "properties": {
        "a": {"enum": opts}, "b": {"type": "string"}}, "required": ["a", "b"]}, 0.0, None))
    head = tok.encode('The agent reads the file{"a": ')
    scores = [sum(t.logprob for t in lm.score(head, tok.encode(json.dumps(o)), k=0)) for o in opts]
    assert out["a"] == opts[scores.index(max(scores))] and isinstance(out["b"], str) and '"' not in out["b"]
    with pytest.raises(Exception, match="flat JSON objects"):
        _constrained(lm, prompt, {"type": "array"}, 0.0, None)


def test_the_judge_over_a_real_model(server, model):
    name = model.name
    judge = LLMJudge(server, name, backoff_s=0.01, max_tokens=64)
    plain = LLMJudge(server, name, backoff_s=0.01, json_schema=False, retries=1, max_tokens=32)

    async def go():
        try:
            d = await judge.diagnose(PREFIX)
            with pytest.raises(JudgeOutputInvalid, match="2 tries"):
                await plain.diagnose(PREFIX)
            return d
        finally:
            await judge.aclose()
            await plain.aclose()

    d = asyncio.run(go())
    # the server enforced the schema: a valid diagnosis on the first request, decided by the model
    assert d.step == 1 and d.diagnoser == f"judge:{name}" and isinstance(d.risk, Risk)
    assert isinstance(d.error_class, ErrorClass) and judge.invalid == 0 and judge.calls == 1
    # without the schema the tiny model writes no JSON: the answer is sent back and retried, then refused
    assert plain.invalid == 2 and plain.calls == 2


def test_the_policy_over_a_real_model(server, model, few_tasks, host, tmp_path):
    task = min(few_tasks, key=lambda t: len(t.FAIL_TO_PASS))
    log = TrajectoryLog(tmp_path / "traj.db")
    policy = ChatEndpointPolicy(server, model.name, max_tokens=24)
    rec = asyncio.run(run_episode(task, policy, log, host, "lm", max_steps=2))
    assert not rec.resolved and len(rec.turns) == 2 and len(log.history("lm/llm")) == 2
    from shoal.annotate.tokens import HFTokenizer

    tok = HFTokenizer.load(model)
    for turn, msg in zip(rec.turns, [m for m in rec.messages if m["role"] == "assistant"]):
        ids = turn["token_ids"]
        assert ids and all(0 <= i < tok.vocab_size for i in ids)  # the model's own vocabulary
        assert msg["content"] == b"".join(tok.token_bytes(i) for i in ids if i != tok.eos_id).decode("utf-8", "replace")
        assert turn["usage"]["prompt_tokens_cut"] > 0  # the prompt did not fit the 128-token context
        assert len(turn["logprobs"]) == len(ids) and all(lp <= 0 for lp in turn["logprobs"])
    tr = Trace.from_record(rec)
    diags = [ProgrammaticDiagnoser().diagnose_now(tr.prefix(k)) for k in range(1, len(tr.steps) + 1)]
    per = record_token_rewards(rec, diags)
    assert [len(x) for x in per] == [len(t["token_ids"]) for t in rec.turns]
