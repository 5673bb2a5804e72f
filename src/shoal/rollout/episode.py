"""One episode of an agent on a task (any `rollout.task.Task`), every step through the trajectory log.

Streams per episode: `<ep>/sandbox` (tool calls on the sandbox), `<ep>/llm` (policy calls) and
`<ep>/eval` (the grade). Running an episode that the log already holds, in part or whole, fast-
forwards: logged LLM turns and tool results come back without calling the model or touching the
sandbox, and the loop goes on live from where the log ends. Where the episode's sandbox is:

- still alive on the same backend (a worker died, the sandbox did not): it is reattached;
- gone (its node was lost): a new one is created from the same layers and the logged effects are
  re-applied to it (`trajlog.restore`) before going on.

Sandboxes come from any `SandboxBackend`: shoald by default (the worker needs no root), or the
in-process `Host`.
"""
from __future__ import annotations

import asyncio
import functools
import hashlib
import socket
import time
from dataclasses import asdict, dataclass, field

from ..core.contract import SandboxBackend
from ..core.errors import SandboxNotFound, UnknownOutcome
from ..envs.sandboxes import attach
from ..sdk.sandbox import Sandbox
from ..trajlog import LoggedSandbox, TrajectoryLog, restore
from .policy import Policy
from .task import Task, Verdict

SANDBOX_TTL_S = 3600.0  # a sandbox outlives a dead worker long enough to be resumed, not forever


@dataclass
class EpisodeRecord:
    episode_id: str
    instance_id: str
    repo: str
    labels: dict
    policy: str
    reward: float
    resolved: bool
    report: dict
    patch: str  # the graded answer (the task's `answer()`: for SWE, the repository's diff)
    steps: int
    submitted: bool
    messages: list[dict]
    actions: list[dict]
    turns: list[dict]  # per policy call: token ids / logprobs / usage when the server returned them
    timings: dict
    sandbox: str
    layers: list[str]
    node: str
    replayed: dict  # calls served from the log on this run, per stream
    executed: dict  # calls that ran live on this run, per stream
    restored_ops: int = 0  # effects re-applied to a new sandbox because the old one was lost
    unknown_ops: int = 0
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def _sandbox_for(backend: SandboxBackend, log: TrajectoryLog, task: Task, name: str, size: int,
                 node: str) -> tuple[Sandbox, int]:
    info = log.info(name)
    meta = (info.meta if info else {}) or {}
    where = backend.address
    if meta.get("sandbox") and meta.get("backend") == where and meta.get("node") == node:
        try:
            sb = attach(backend, meta["sandbox"])
            if sb.is_running():
                return sb, 0
        except SandboxNotFound:
            pass
    sb = task.sandbox(backend, ttl=SANDBOX_TTL_S)
    restored = 0
    if size:
        restored = restore(log, name, sb).ops
    log.store.update_stream(name, layers=sb.info().layers, meta={"sandbox": sb.id, "backend": where, "node": node})
    return sb, restored


async def run_episode(task: Task, policy: Policy, log: TrajectoryLog, backend: SandboxBackend, episode_id: str, *,
                      max_steps: int = 30, writer: str | None = None, node: str | None = None,
                      keep_sandbox: bool = False) -> EpisodeRecord:
    node = node or socket.gethostname()
    t_start = time.perf_counter()
    # no image: the stream gets the sandbox's full layer stack once it exists (what replay recreates)
    sb_stream = log.stream(f"{episode_id}/sandbox", episode=episode_id, writer=writer,
                           meta={"instance_id": task.id, "task_image": task.image})
    llm = log.stream(f"{episode_id}/llm", episode=episode_id, writer=writer)
    ev = log.stream(f"{episode_id}/eval", episode=episode_id, writer=writer)
    sb, restored = await asyncio.to_thread(_sandbox_for, backend, log, task, sb_stream.name, sb_stream.size, node)
    lsb = LoggedSandbox(sb, sb_stream)
    tools = task.tools(lsb)
    setup_s = time.perf_counter() - t_start

    messages: list[dict] = task.prompt()
    actions: list[dict] = []
    turns: list[dict] = []
    llm_s = tools_s = 0.0
    submitted, unknown = False, 0
    step = 0
    for step in range(1, max_steps + 1):
        req = policy.request(messages, tools.specs)
        t0 = time.perf_counter()
        try:
            out = (await llm.acall("llm", req, functools.partial(policy.complete, req), idempotent=True)).result
        except UnknownOutcome:  # a model call has no side effect: ask again, log that answer
            out = llm.settle(await policy.complete(req)).result
        llm_s += time.perf_counter() - t0
        turns.append({k: v for k, v in out.items() if k not in ("content", "tool_calls")})
        msg: dict = {"role": "assistant", "content": out.get("content", "")}
        if out.get("tool_calls"):
            msg["tool_calls"] = out["tool_calls"]
        messages.append(msg)
        if not out.get("tool_calls"):
            messages.append({"role": "user", "content": "Use a tool call. Call `submit` when you are done."})
            continue
        for call in out["tool_calls"]:
            fn = call.get("function", {})
            t0 = time.perf_counter()
            obs = await asyncio.to_thread(tools.run, fn.get("name", ""), fn.get("arguments", "{}"))
            tools_s += time.perf_counter() - t0
            unknown += obs.unknown
            messages.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": obs.text})
            actions.append({"step": step, "tool": fn.get("name"), "arguments": fn.get("arguments"),
                            "observation": obs.text, "error": obs.error, "unknown": obs.unknown})
            if obs.submitted:
                submitted = True
                break
        if submitted:
            break
    answer = await asyncio.to_thread(task.answer, tools)
    t0 = time.perf_counter()

    def grade() -> dict:
        return task.grade(backend, answer).to_dict()

    grade_req = {"task": task.id, "answer_sha256": hashlib.sha256(answer.encode()).hexdigest()}
    try:
        verdict = Verdict.from_dict((await asyncio.to_thread(ev.call, "grade", grade_req, grade)).result)
    except UnknownOutcome:  # grading runs in its own fresh sandbox: doing it again is harmless
        verdict = Verdict.from_dict(ev.settle(await asyncio.to_thread(grade)).result)
    grade_s = time.perf_counter() - t0
    layers = sb.info().layers
    if not keep_sandbox:
        await asyncio.to_thread(sb.kill)
    about = task.describe()
    return EpisodeRecord(
        episode_id=episode_id, instance_id=task.id, repo=about.get("repo", ""), labels=about.get("labels", {}),
        policy=policy.name, reward=verdict.reward, resolved=verdict.resolved, report=verdict.report,
        patch=answer, steps=step, submitted=submitted, messages=messages, actions=actions, turns=turns,
        timings={"wall_s": time.perf_counter() - t_start, "setup_s": setup_s, "llm_s": llm_s, "tools_s": tools_s,
                 "grade_s": grade_s},
        sandbox=sb.id, layers=layers, node=node,
        replayed={"sandbox": sb_stream.replayed, "llm": llm.replayed, "eval": ev.replayed},
        executed={"sandbox": sb_stream.executed, "llm": llm.executed, "eval": ev.executed},
        restored_ops=restored, unknown_ops=unknown)
