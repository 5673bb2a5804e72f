"""One episode of an agent on a task (any `rollout.task.Task`), every step through the trajectory log.

Streams per episode: `<ep>/sandbox` (tool calls on the sandbox), `<ep>/llm` (policy calls),
`<ep>/steps` (one mark per agent step: where each stream stood after it, and the step's snapshot when
`snapshot_every` asks for one; what `rollout.branch` branches from) and `<ep>/eval` (the grade).
Running an episode that the log already holds, in part or whole, fast-forwards: logged LLM turns
and tool results come back without calling the model or touching the sandbox, and the loop goes on
live from where the log ends. Where the episode's sandbox is:

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
from ..core.errors import InvalidArgument, SandboxNotFound, UnknownOutcome
from ..envs.sandboxes import attach
from ..sdk.sandbox import Sandbox
from ..trajlog import LoggedSandbox, Stream, TrajectoryLog, restore
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
                 node: str) -> tuple[Sandbox, int, dict]:
    """The episode's sandbox (reattached, or new with the log's effects re-applied), how many effects
    were re-applied, and how the first one was created (what a branch from step 0 recreates)."""
    info = log.info(name)
    meta = (info.meta if info else {}) or {}
    where = backend.address
    if meta.get("sandbox") and meta.get("backend") == where and meta.get("node") == node:
        try:
            sb = attach(backend, meta["sandbox"])
            if sb.is_running():
                return sb, 0, {}
        except SandboxNotFound:
            pass
    sb = task.sandbox(backend, ttl=SANDBOX_TTL_S)
    created = sb.info()  # before any effect: the start state, as a branch from the start recreates it
    restored = 0
    if size:
        restored = restore(log, name, sb).ops
    log.store.update_stream(name, layers=created.layers, meta={"sandbox": sb.id, "backend": where, "node": node})
    start = {"layers": created.layers, "env": created.env, "workdir": created.workdir,
             "memory_mb": created.limits.memory_mb, "disk_mb": created.limits.disk_mb, "cpu": created.limits.cpu,
             "pids": created.limits.pids, "upper": created.limits.upper}
    return sb, restored, start


class _Marker:
    """The step marks of one run: each logged after its step, the snapshot (if any) taken in a thread
    while the policy thinks about the next step, and awaited before that step's tools run. A step
    that made no exec or write keeps the previous step's snapshot (its state is the same)."""

    def __init__(self, marks: Stream, sb: Sandbox, lsb: LoggedSandbox, every: int | None):
        self.marks, self.sb, self.lsb, self.every = marks, sb, lsb, every
        self.pending: asyncio.Future | None = None
        self.last: dict | None = None  # the newest mark with a snapshot, and the effect count it holds
        self.last_effects = -1
        self.wait_s = 0.0

    def start(self, step: int, sandbox_seq: int, llm_seq: int) -> None:
        want = self.every is not None and step % self.every == 0
        effects = self.lsb.effects
        same = self.last if self.last is not None and effects == self.last_effects else None
        self.pending = asyncio.ensure_future(asyncio.to_thread(self._mark, step, sandbox_seq, llm_seq, want, same,
                                                               effects))

    async def wait(self) -> None:
        if self.pending is None:
            return
        t0 = time.perf_counter()
        try:
            await self.pending
        finally:
            self.pending = None
            self.wait_s += time.perf_counter() - t0

    def _mark(self, step: int, sandbox_seq: int, llm_seq: int, want: bool, same: dict | None, effects: int) -> dict:
        """Log where the streams stand after `step` (and a snapshot, if asked). Replayed, not retaken,
        when the episode is resumed: the request names the step and both cursors."""
        def take() -> dict:
            if not want:
                return {"snapshot": None}
            if same is not None:  # nothing ran that could change the file system since that snapshot
                return {**same, "size": 0, "snapshot_s": 0.0, "same_as_step": same.get("step")}
            t0 = time.perf_counter()
            info = self.sb.snapshot()
            return {"snapshot": info.id, "image": info.image, "layer": info.layer, "size": info.size,
                    "snapshot_s": time.perf_counter() - t0, "step": step}

        req = {"step": step, "sandbox_seq": sandbox_seq, "llm_seq": llm_seq}
        try:
            result = self.marks.call("step", req, take).result
        except UnknownOutcome:  # its writer died mid-snapshot: taking it again is harmless
            result = self.marks.settle(take()).result
        if result.get("snapshot"):
            self.last, self.last_effects = result, effects
        return result


async def run_episode(task: Task, policy: Policy, log: TrajectoryLog, backend: SandboxBackend, episode_id: str, *,
                      max_steps: int = 30, writer: str | None = None, node: str | None = None,
                      keep_sandbox: bool = False, snapshot_every: int | None = None) -> EpisodeRecord:
    """Run (or resume, or fast-forward) one episode. `snapshot_every=j`: a pack_diff snapshot of the
    sandbox after every j-th step, taken while the policy thinks about the next one (branching from
    those steps is then one sandbox create; from the others, a fast-forward from the nearest)."""
    if snapshot_every is not None and (isinstance(snapshot_every, bool) or not isinstance(snapshot_every, int)
                                       or snapshot_every < 1):
        raise InvalidArgument(f"snapshot_every is a whole number of steps >= 1 (or None), got {snapshot_every!r}")
    node = node or socket.gethostname()
    t_start = time.perf_counter()
    # no image: the stream gets the sandbox's full layer stack once it exists (what replay recreates)
    sb_stream = log.stream(f"{episode_id}/sandbox", episode=episode_id, writer=writer,
                           meta={"instance_id": task.id, "task_image": task.image})
    llm = log.stream(f"{episode_id}/llm", episode=episode_id, writer=writer)
    ev = log.stream(f"{episode_id}/eval", episode=episode_id, writer=writer)
    marks = log.stream(f"{episode_id}/steps", episode=episode_id, writer=writer)
    sb, restored, start = await asyncio.to_thread(_sandbox_for, backend, log, task, sb_stream.name, sb_stream.size,
                                                  node)
    if start and not marks.size:  # a new episode: how its sandbox began, for branches from the start
        log.store.update_stream(marks.name, meta={"start": start, "snapshot_every": snapshot_every})
    lsb = LoggedSandbox(sb, sb_stream)
    tools = task.tools(lsb)
    setup_s = time.perf_counter() - t_start

    messages: list[dict] = task.prompt()
    actions: list[dict] = []
    turns: list[dict] = []
    llm_s = tools_s = 0.0
    submitted, unknown = False, 0
    step = 0
    marker = _Marker(marks, sb, lsb, snapshot_every)
    for step in range(1, max_steps + 1):
        req = policy.request(messages, tools.specs)
        t0 = time.perf_counter()
        try:
            out = (await llm.acall("llm", req, functools.partial(policy.complete, req), idempotent=True)).result
        except UnknownOutcome:  # a model call has no side effect: ask again, log that answer
            out = llm.settle(await policy.complete(req)).result
        llm_s += time.perf_counter() - t0
        await marker.wait()  # the snapshot must hold the state before this step's tools touch it
        turns.append({k: v for k, v in out.items() if k not in ("content", "tool_calls")})
        msg: dict = {"role": "assistant", "content": out.get("content", "")}
        if out.get("tool_calls"):
            msg["tool_calls"] = out["tool_calls"]
        messages.append(msg)
        if not out.get("tool_calls"):
            messages.append({"role": "user", "content": "Use a tool call. Call `submit` when you are done."})
            marker.start(step, sb_stream.cursor, llm.cursor)
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
        marker.start(step, sb_stream.cursor, llm.cursor)
        if submitted:
            break
    await marker.wait()
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
                 "grade_s": grade_s, "mark_wait_s": marker.wait_s},
        sandbox=sb.id, layers=layers, node=node,
        replayed={"sandbox": sb_stream.replayed, "llm": llm.replayed, "eval": ev.replayed},
        executed={"sandbox": sb_stream.executed, "llm": llm.executed, "eval": ev.executed},
        restored_ops=restored, unknown_ops=unknown)
