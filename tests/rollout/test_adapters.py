"""Gymnasium reset/step and the verl-shaped agent loop, driving real task sandboxes."""
from __future__ import annotations

import asyncio
import json

import pytest
from gymnasium.utils.env_checker import check_env

from shoal.core.errors import InvalidArgument
from shoal.rollout.adapters import ShoalSWEAgentLoop, ShoalSWEEnv, parse_tool_calls

pytestmark = pytest.mark.slow


def test_gym_env_oracle_and_null(root, few_tasks, tmp_path):
    env = ShoalSWEEnv(few_tasks, url="local", root=str(root), log_path=tmp_path / "g.db", max_steps=5)
    task = few_tasks[2]
    obs, info = env.reset(seed=0, options={"instance_id": task.instance_id})
    assert obs == task.problem_statement and info["sandbox"] and env.observation_space.contains(obs)
    o, r, term, trunc, _ = env.step({"tool": "create_file", "arguments": {"path": "/tmp/p", "content": task.patch}})
    assert r == 0.0 and not term and not trunc
    o, r, term, trunc, _ = env.step(json.dumps({"tool": "shell", "arguments": {"command": "git apply /tmp/p"}}))
    assert "exit code 0" in o
    o, r, term, trunc, info = env.step({"tool": "submit"})
    assert (r, term, trunc) == (1.0, True, False) and info["report"]["resolved"]
    env.reset(options={"instance_id": task.instance_id})
    assert env.step({"tool": "submit"})[1:4] == (0.0, True, False)
    env.reset(options={"instance_id": task.instance_id})
    for _ in range(4):
        assert env.step({"tool": "shell", "arguments": {"command": "true"}})[3] is False
    assert env.step({"tool": "shell", "arguments": {"command": "true"}})[3] is True  # truncated at max_steps
    env.reset(options={"instance_id": task.instance_id})
    o, r, term, trunc, info = env.step("not json")  # a malformed tool call is an observation, not an exception
    assert o.startswith("error: the action is not JSON") and "shell, view_file" in o
    assert (r, term, trunc, info["error"]) == (0.0, False, False, True)
    with pytest.raises(InvalidArgument, match="no task"):
        env.reset(options={"instance_id": "nope"})
    env.close()


def test_gym_env_passes_gymnasium_check_env(root, few_tasks, tmp_path):
    env = ShoalSWEEnv(few_tasks[:2], url="local", root=str(root), log_path=tmp_path / "c.db", max_steps=5)
    try:
        check_env(env, skip_render_check=True)  # steps with sampled (random text) actions too
    finally:
        env.close()


class CharTokenizer:
    """A character-level tokenizer with the two methods the loop uses (no downloads)."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=False, tokenize=True):
        text = "".join(f"<|{m['role']}|>{m['content']}" for m in messages) + ("<|assistant|>" if add_generation_prompt
                                                                               else "")
        return self.encode(text)


class OracleServer:
    """Stands in for verl's server manager: emits Hermes-style tool calls as token ids."""

    def __init__(self, patch: str):
        self.calls = [{"name": "create_file", "arguments": {"path": "/tmp/fix.patch", "content": patch}},
                      {"name": "shell", "arguments": {"command": "git apply /tmp/fix.patch"}},
                      {"name": "submit", "arguments": {}}]
        self.prompts: list[int] = []

    async def generate(self, request_id, *, prompt_ids, sampling_params):
        self.prompts.append(len(prompt_ids))
        call = self.calls[len(self.prompts) - 1]
        return CharTokenizer().encode(f"<tool_call>{json.dumps(call)}</tool_call>")


def test_verl_shaped_agent_loop(root, few_tasks, tmp_path):
    task = few_tasks[0]
    server = OracleServer(task.patch)
    loop = ShoalSWEAgentLoop(None, server, CharTokenizer(), tasks=few_tasks, url="local", root=str(root),
                             log_path=tmp_path / "v.db")
    out = asyncio.run(loop.run({"temperature": 1.0}, instance_id=task.instance_id))
    assert out.reward_score == 1.0 and out.num_turns == 3
    assert len(out.response_ids) == len(out.response_mask) and set(out.response_mask) == {0, 1}
    # each generate call saw the whole history so far: prompt + earlier responses and tool outputs
    assert server.prompts[0] == len(out.prompt_ids) and server.prompts[1] > server.prompts[0]
    model_text = CharTokenizer().decode([t for t, m in zip(out.response_ids, out.response_mask) if m])
    assert [c["name"] for c in parse_tool_calls(model_text)] == ["create_file", "shell", "submit"]
    assert "<tool_response>" not in model_text


def test_parse_tool_calls_marks_garbage():
    assert parse_tool_calls('<tool_call>{"name": "shell", "arguments": {"command": "ls"}}</tool_call>') == [
        {"name": "shell", "arguments": {"command": "ls"}}]
    assert parse_tool_calls("<tool_call>{oops}</tool_call>")[0]["name"] == "__invalid__"
