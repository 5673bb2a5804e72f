"""Adapters so existing RL frameworks can drive Shoal tasks (any `rollout.task.Task`; SWE by default).

- `ShoalEnv` / `ShoalSWEEnv`: Gymnasium `reset/step` (an action is one tool call, the observation
  its output; the reward comes with the step that submits, or the last one). It passes Gymnasium's
  own `check_env`: any text is a valid action, and one that is not a tool call (not JSON, no tool
  name) becomes an observation with the error and counts as a step, as policies emit them all the time.
- `ShoalAgentLoop` / `ShoalSWEAgentLoop`: shaped like verl's agent loop (`AgentLoopBase`: built with
  a server manager and a tokenizer, `async run(sampling_params, **row) -> AgentLoopOutput`): token-in
  / token-out, tool calls parsed from Hermes-style `<tool_call>{...}</tool_call>` blocks, tool output
  tokens masked out of the loss (response_mask 0). verl itself is not imported, so this runs without
  it; register the class with verl's agent-loop registry to use it there.

Both keep every sandbox operation in a trajectory log like the rollout workers do, and both are
clients of shoald by default (`url`, `api_key`; no root): `url="local"` runs sandboxes in-process.
"""
from __future__ import annotations

import asyncio
import json
import re
import tempfile
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..backends import open_backend
from ..core.contract import SandboxBackend
from ..core.errors import InvalidArgument
from ..sdk.sandbox import Sandbox
from ..trajlog import LoggedSandbox, TrajectoryLog
from .task import Task, Tools
from .tools import Observation

try:
    import gymnasium as gym
    from gymnasium import spaces
except ImportError as e:  # an extra: the SDK, CLI and daemon do not need it
    raise ImportError("the Gymnasium adapter needs gymnasium: pip install 'shoal[rollout]'") from e

MAX_TEXT = 1 << 20  # characters of an action or observation
# Any text a model writes or a tool prints: every Unicode code point of the BMP except surrogates
# and most C0 controls. Observations replace what is outside it (astral characters, escape codes)
# with U+FFFD, so an observation is always inside the observation space.
CHARSET = "\t\n\r" + "".join(chr(c) for c in range(0x20, 0xD800)) + "".join(chr(c) for c in range(0xE000, 0xFFFE))
_OUTSIDE = re.compile("[^" + re.escape("\t\n\r") + "\u0020-\ud7ff\ue000-\ufffd]")
ACTION_FORMAT = '{"tool": name, "arguments": {...}}'


def _text_space() -> spaces.Text:
    return spaces.Text(max_length=MAX_TEXT, min_length=0, charset=CHARSET)


def in_charset(text: str) -> str:
    """`text` with every character outside CHARSET as U+FFFD, cut to MAX_TEXT characters."""
    return _OUTSIDE.sub("\ufffd", text)[:MAX_TEXT]


def _new_log(path: str | Path | None) -> TrajectoryLog:
    return TrajectoryLog(path or Path(tempfile.mkdtemp(prefix="shoal-gym-")) / "traj.db")


def parse_action(action: Any, tool_names: Sequence[str]) -> tuple[str, str | dict] | str:
    """(tool name, arguments) from an action, or why it is not a tool call (a message for the agent)."""
    if isinstance(action, (str, bytes)):
        try:
            action = json.loads(action)
        except ValueError as e:
            return f"the action is not JSON ({e}); send {ACTION_FORMAT}; tools: {', '.join(tool_names)}"
    if not isinstance(action, dict) or not isinstance(action.get("tool"), str):
        return f"the action is not a tool call; send {ACTION_FORMAT}; tools: {', '.join(tool_names)}"
    args = action.get("arguments")
    if args is not None and not isinstance(args, (dict, str)):
        return f"the arguments of {action['tool']!r} must be a JSON object, got {type(args).__name__}"
    return action["tool"], args or {}


def _backend(url: str | None, api_key: str | None, root: str | None) -> SandboxBackend:
    """shoald at `url` (default: $SHOAL_URL, else the host's socket); url "local": in-process at `root`."""
    return open_backend(url, api_key, root)


def _tool_names(tools: Tools) -> list[str]:
    return [t.get("function", {}).get("name", "") for t in tools.specs]


class ShoalEnv(gym.Env):
    """One task per episode, picked by the seeded RNG (or `options={"task": id}`).

    action: a tool call, `{"tool": name, "arguments": {...}}`, as a dict or a JSON string.
    observation: the task's opening user message on reset, then each tool call's output."""

    metadata = {"render_modes": []}

    def __init__(self, tasks: Sequence[Task], *, url: str | None = None, api_key: str | None = None,
                 root: str | None = None, max_steps: int = 30, log_path: str | Path | None = None):
        self.tasks = list(tasks)
        if not self.tasks:
            raise InvalidArgument(f"{type(self).__name__} needs at least one task")
        if max_steps < 1:
            raise InvalidArgument(f"max_steps must be >= 1, got {max_steps}")
        self.backend, self.max_steps = _backend(url, api_key, root), max_steps
        self.log = _new_log(log_path)
        self.observation_space, self.action_space = _text_space(), _text_space()
        self.task: Task | None = None
        self._sb: Sandbox | None = None
        self._tools: Tools | None = None
        self._steps = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        super().reset(seed=seed)
        self.close()
        opts = options or {}
        want = opts.get("task", opts.get("instance_id"))
        if want:
            matches = [t for t in self.tasks if t.id == want]
            if not matches:
                raise InvalidArgument(f"no task {want!r} in this environment")
            self.task = matches[0]
        else:
            self.task = self.tasks[int(self.np_random.integers(len(self.tasks)))]
        task = self.task
        sb = self._sb = task.sandbox(self.backend)
        ep = f"gym-{uuid.uuid4().hex[:10]}"
        stream = self.log.stream(f"{ep}/sandbox", episode=ep, sandbox=sb.id, layers=sb.info().layers)
        tools = self._tools = task.tools(LoggedSandbox(sb, stream))
        self._steps = 0
        prompt = task.prompt()
        system = next((m["content"] for m in prompt if m["role"] == "system"), "")
        user = next((m["content"] for m in reversed(prompt) if m["role"] == "user"), "")
        return in_charset(user), {"task": task.id, "instance_id": task.id, "episode": ep, "sandbox": sb.id,
                                  "tools": tools.specs, "system": system, "messages": prompt}

    def step(self, action: str | dict) -> tuple[str, float, bool, bool, dict]:
        tools, task = self._tools, self.task
        if tools is None or task is None:
            raise InvalidArgument("call reset() before step()")
        self._steps += 1
        call = parse_action(action, _tool_names(tools))
        obs = Observation(f"error: {call}", error=True) if isinstance(call, str) else tools.run(*call)
        truncated = not obs.submitted and self._steps >= self.max_steps
        info: dict[str, Any] = {"error": obs.error}
        reward = 0.0
        if obs.submitted or truncated:
            verdict = task.grade(self.backend, task.answer(tools))
            reward = float(verdict.reward)
            info["report"] = verdict.report
            info["resolved"] = verdict.resolved
        return in_charset(obs.text), reward, obs.submitted, truncated, info

    def close(self) -> None:
        if self._sb is not None:
            self._sb.kill()
            self._sb = self._tools = None


class ShoalSWEEnv(ShoalEnv):
    """`ShoalEnv` over SWE tasks: the bundled suite unless `tasks` are given."""

    def __init__(self, tasks: Sequence[Task] | None = None, **kw: Any):
        if tasks is None:
            from ..tasks.swe import load_suite

            tasks = load_suite()
        super().__init__(tasks, **kw)


# ------------------------------------------------------------------------------------------ verl-shaped
@dataclass
class AgentLoopOutput:
    """Field names as in verl's `AgentLoopOutput`."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]  # 1: generated by the model (trained on), 0: tool output (not)
    num_turns: int
    reward_score: float
    metrics: dict = field(default_factory=dict)
    extra_fields: dict = field(default_factory=dict)


_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


def parse_tool_calls(text: str) -> list[dict]:
    calls = []
    for m in _TOOL_CALL.finditer(text):
        try:
            d = json.loads(m.group(1))
            calls.append({"name": d["name"], "arguments": d.get("arguments") or {}})
        except (ValueError, KeyError, TypeError):
            calls.append({"name": "__invalid__", "arguments": {}})
    return calls


class ShoalAgentLoop:
    """`server_manager.generate(request_id, prompt_ids=..., sampling_params=...)` returns token ids
    (a list, or an object with `.token_ids`), as verl's AsyncLLMServerManager does. A row names its
    task by `task` (or `instance_id`)."""

    def __init__(self, trainer_config: Any, server_manager: Any, tokenizer: Any, *, tasks: Sequence[Task],
                 url: str | None = None, api_key: str | None = None, root: str | None = None, max_turns: int = 20,
                 log_path: str | Path | None = None, **kwargs: Any):
        self.config, self.server, self.tokenizer = trainer_config, server_manager, tokenizer
        self.tasks = {t.id: t for t in tasks}
        self.backend, self.max_turns = _backend(url, api_key, root), max_turns
        self.log = _new_log(log_path)

    def _encode_messages(self, messages: list[dict], tools: Tools, generation_prompt: bool) -> list[int]:
        return list(self.tokenizer.apply_chat_template(messages, tools=tools.specs,
                                                       add_generation_prompt=generation_prompt, tokenize=True))

    async def run(self, sampling_params: dict, **kwargs: Any) -> AgentLoopOutput:
        want = kwargs.get("task", kwargs.get("instance_id", ""))
        task = self.tasks.get(want)
        if task is None:
            raise InvalidArgument(f"row has no known task id: {want!r}")
        request_id = uuid.uuid4().hex
        sb = await asyncio.to_thread(task.sandbox, self.backend)
        stream = self.log.stream(f"verl-{request_id}/sandbox", episode=f"verl-{request_id}", sandbox=sb.id)
        tools = task.tools(LoggedSandbox(sb, stream))
        try:
            prompt_ids = self._encode_messages(task.prompt(), tools, True)
            response_ids: list[int] = []
            mask: list[int] = []
            turns, submitted = 0, False
            while turns < self.max_turns and not submitted:
                turns += 1
                out = await self.server.generate(request_id, prompt_ids=prompt_ids + response_ids,
                                                 sampling_params=sampling_params)
                ids = list(getattr(out, "token_ids", out))
                response_ids += ids
                mask += [1] * len(ids)
                text = self.tokenizer.decode(ids)
                calls = parse_tool_calls(text)
                if not calls:
                    break
                results = []
                for c in calls:
                    obs = await asyncio.to_thread(tools.run, c["name"], c["arguments"])
                    results.append({"role": "tool", "content": obs.text})
                    if obs.submitted:
                        submitted = True
                        break
                obs_ids = self.tokenizer.encode("".join(f"<tool_response>{r['content']}</tool_response>"
                                                        for r in results))
                response_ids += obs_ids
                mask += [0] * len(obs_ids)
            answer = await asyncio.to_thread(task.answer, tools)
            verdict = await asyncio.to_thread(task.grade, self.backend, answer)
        finally:
            await asyncio.to_thread(sb.kill)
        metrics = {"resolved": verdict.resolved, **{k: verdict.report[k] for k in ("f2p_rate",) if k in verdict.report}}
        return AgentLoopOutput(prompt_ids=prompt_ids, response_ids=response_ids, response_mask=mask, num_turns=turns,
                               reward_score=verdict.reward, metrics=metrics,
                               extra_fields={"task": task.id, "instance_id": task.id, "report": verdict.report})


class ShoalSWEAgentLoop(ShoalAgentLoop):
    """`ShoalAgentLoop` over SWE tasks: the bundled suite unless `tasks` are given."""

    def __init__(self, trainer_config: Any, server_manager: Any, tokenizer: Any, *,
                 tasks: Sequence[Task] | None = None, **kwargs: Any):
        if tasks is None:
            from ..tasks.swe import load_suite

            tasks = load_suite()
        super().__init__(trainer_config, server_manager, tokenizer, tasks=tasks, **kwargs)
