"""The training exports on real episodes: per-token rewards aligned with the token ids an
OpenAI-compatible server returned into an episode record, the reward function of the verl-shaped
adapter on a real rollout, and the SFT filter's JSONL loaded by `datasets` and trained on by TRL's
SFTTrainer."""
from __future__ import annotations

import asyncio
import json

import pytest

from shoal.flare.exports import (
    agent_loop_trace,
    episode_return,
    flare_reward_fn,
    record_token_rewards,
    write_sft_jsonl,
)
from shoal.flare.programmatic import ProgrammaticDiagnoser
from shoal.flare.schema import ErrorClass, Risk, Trace
from shoal.rollout import scripted_server
from shoal.rollout.episode import run_episode
from shoal.rollout.policy import ChatEndpointPolicy
from shoal.trajlog import TrajectoryLog

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def task(few_tasks):
    return min(few_tasks, key=lambda t: len(t.FAIL_TO_PASS))


@pytest.fixture(scope="module")
def oracle_record(task, host, tmp_path_factory):
    """A real episode: the oracle over HTTP (the scripted server returns vLLM-style token ids)."""
    proc, url = scripted_server.spawn()
    try:
        log = TrajectoryLog(tmp_path_factory.mktemp("ex") / "traj.db")
        policy = ChatEndpointPolicy(url, "oracle")
        return asyncio.run(run_episode(task, policy, log, host, "ex-oracle"))
    finally:
        proc.terminate()
        proc.wait()


def test_token_rewards_align_with_a_real_records_token_ids(oracle_record):
    rec = oracle_record
    assert rec.resolved and rec.turns and all(t.get("token_ids") for t in rec.turns)
    trace = Trace.from_record(rec)
    diags = [ProgrammaticDiagnoser().diagnose_now(trace.prefix(k)) for k in range(1, len(trace.steps) + 1)]
    per = record_token_rewards(rec, diags)
    assert [len(x) for x in per] == [len(t["token_ids"]) for t in rec.turns]
    # each step's reward on its turn's last token, the outcome on the episode's last token, 0 elsewhere
    assert sum(map(sum, per)) == pytest.approx(episode_return(diags, rec.reward))
    assert all(v == 0.0 for turn in per for v in turn[:-1])
    assert per[-1][-1] == pytest.approx(rec.reward + 0.2 * (0.5 - diags[-1].risk.score))
    with pytest.raises(Exception, match="diagnoses"):
        record_token_rewards(rec, diags[:-1])


class ByteTokenizer:
    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", "replace")

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=False, tokenize=True):
        return self.encode("".join(f"<|{m['role']}|>{m['content']}" for m in messages) + "<|assistant|>")


class Server:
    """Stands in for verl's server manager: repeats a view three times (a loop), then the fix."""

    def __init__(self, task):
        path = task.patch.split("\n", 1)[0].split(" b/")[-1]
        view = {"name": "view_file", "arguments": {"path": path}}
        self.calls = [view, view, view, {"name": "create_file", "arguments": {"path": "/tmp/fix.patch",
                                                                             "content": task.patch}},
                      {"name": "shell", "arguments": {"command": "git apply /tmp/fix.patch"}},
                      {"name": "submit", "arguments": {}}]
        self.n = 0

    async def generate(self, request_id, *, prompt_ids, sampling_params):
        self.n += 1
        return ByteTokenizer().encode(f"<tool_call>{json.dumps(self.calls[self.n - 1])}</tool_call>")


def test_reward_function_of_the_verl_shaped_adapter_on_a_real_rollout(task, root, tmp_path):
    from shoal.rollout.adapters import ShoalSWEAgentLoop

    loop = ShoalSWEAgentLoop(None, Server(task), ByteTokenizer(), tasks=[task], url="local", root=str(root),
                             log_path=tmp_path / "v.db")
    out = asyncio.run(loop.run({}, instance_id=task.instance_id))
    assert out.reward_score == 1.0 and out.num_turns == 6
    trace = agent_loop_trace(out, ByteTokenizer())
    assert [s.actions[0].tool for s in trace.steps] == ["view_file"] * 3 + ["create_file", "shell", "submit"]
    assert "1\t" in trace.steps[0].actions[0].observation  # the tool output read back from its tokens
    r = flare_reward_fn(tokenizer=ByteTokenizer())(out)
    flat = r["token_level_rewards"]
    assert len(flat) == len(out.response_ids)
    assert all(v == 0.0 for v, m in zip(flat, out.response_mask) if not m)  # tool output earns nothing
    m = out.response_mask
    ends = [i for i in range(len(flat)) if m[i] and (i + 1 == len(flat) or not m[i + 1])]
    assert len(ends) == 6 and sum(flat) == pytest.approx(r["reward_score"])
    diags = [ProgrammaticDiagnoser().diagnose_now(trace.prefix(k)) for k in range(1, 7)]
    assert diags[2].error_class == ErrorClass.loop and diags[2].risk == Risk.high  # the third identical view
    assert flat[ends[2]] == pytest.approx(0.2 * (0.5 - 0.75)) and flat[ends[0]] == pytest.approx(0.1)
    assert r["reward_score"] == pytest.approx(episode_return(diags, 1.0))
    with pytest.raises(Exception, match="tokenizer"):
        flare_reward_fn()


def test_sft_jsonl_is_read_by_datasets_and_trained_on_by_trl(oracle_record, tmp_path):
    """The filter's rows are TRL's conversational format with tool calls: `datasets` loads them and
    SFTTrainer (a tiny local GPT-2 and a chat template that renders tools) takes a training step."""
    datasets = pytest.importorskip("datasets")
    trl = pytest.importorskip("trl")
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from shoal.annotate.demo_models import make_bpe_model
    from shoal.annotate.tokens import HFTokenizer

    rec = oracle_record.to_dict()
    trace = Trace.from_record(rec)
    diags = [ProgrammaticDiagnoser().diagnose_now(trace.prefix(k)) for k in range(1, len(trace.steps) + 1)]
    failed = {**rec, "resolved": False}
    path = tmp_path / "sft.jsonl"
    assert write_sft_jsonl([(rec, diags), (failed, diags)], path) == 1
    ds = datasets.load_dataset("json", data_files=str(path), split="train")
    assert ds.num_rows == 1 and ds[0]["messages"][0]["role"] == "system"
    calls = [m["tool_calls"] for m in ds[0]["messages"] if m.get("tool_calls")]
    assert calls and isinstance(calls[0][0]["function"]["arguments"], str | dict)

    tok = HFTokenizer.load(make_bpe_model(tmp_path / "bpe", steps=1)).tok
    tok.pad_token = tok.eos_token
    tok.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
        "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}<tool_call>{{ c['function']['name'] }}"
        "{{ c['function']['arguments'] | tojson }}</tool_call>{% endfor %}{% endif %}{% endfor %}"
        "{% if tools %}<|tools|>{{ tools | length }}{% endif %}")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=4096, n_embd=32, n_layer=1, n_head=2))
    args = trl.SFTConfig(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=1,
                         report_to=[], use_cpu=True, max_length=4096, save_strategy="no", logging_steps=1)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok)
    assert len(trainer.train_dataset[0]["input_ids"]) > 100  # the conversation was rendered and tokenized
    result = trainer.train()
    assert result.global_step == 1 and result.training_loss > 0
