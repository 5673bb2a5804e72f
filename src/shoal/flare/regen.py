"""The agent loop with a diagnoser in it, and breakpoint regeneration.

After each step the probe (if the task has one) records what the sandbox shows, and the diagnoser
judges the step from the prefix. When the risk reaches `threshold` and the budget allows:

1. the episode branches at the step before the flagged one through `rollout.branch.Episode`
   (the loop writes its streams as `run_episode` does, a `<ep>/steps` mark per kept step): a new
   episode `<ep>.r<n>` in the log's tree whose sandbox is in exactly the state after step k-1 (each
   re-applied result compared with the log: `RewindMismatch` if a step does not reproduce);
2. the flagged step's messages are dropped and the diagnosis (evidence and fix) is added to the
   policy's context as a user message;
3. the loop goes on from step k.

Budgets: `tokens` (the policy's prompt + completion tokens, every branch counted, discarded ones
too), `sandbox_s` (the summed lifetime of every sandbox the episode made, probes included) and
`regenerations`. Past a budget no more branching is done; past `tokens` the episode ends and its
current state is graded.

Token counts come from the server's `usage` where it gives one; for scripted policies they are
estimated as characters / 4 of the request's messages and the answer.
"""
from __future__ import annotations

import hashlib
import json
import math
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.contract import SandboxBackend
from ..core.errors import InvalidArgument, ShoalError
from ..rollout.policy import Policy
from ..rollout.task import Task, Verdict
from ..sdk.sandbox import Sandbox
from ..trajlog import DONE, LoggedSandbox, SQLiteLogStore, Stream, TrajectoryLog
from ..trajlog.sandbox import EFFECTFUL, apply
from .diagnoser import Diagnoser
from .policy import feedback_message
from .probe import SWEProbe
from .programmatic import ProgrammaticDiagnoser
from .schema import Action, Prefix, Risk, StepDiagnosis, StepView, Trace

SANDBOX_TTL_S = 1800.0


class RewindMismatch(ShoalError):
    """Re-applying the logged effects gave other results: the step is not reproducible."""


@dataclass
class Budget:
    tokens: int | None = None
    sandbox_s: float | None = None
    regenerations: int = 3


@dataclass
class Resume:
    """Where a branched run starts: the state after a kept step of an earlier run (its messages,
    the logged effects of each step, the steps and their diagnoses, the start facts)."""

    messages: list[dict]
    effects: list[list[tuple[str, dict, dict]]]
    steps: list[StepView]
    diagnoses: list[StepDiagnosis]
    start: dict
    msgs_before: list[int]


@dataclass
class FlareEpisode:
    episode_id: str
    task: str
    resolved: bool
    reward: float
    report: dict
    patch: str
    trace: Trace  # the final path's steps, with probe facts
    diagnoses: list[StepDiagnosis]  # of the final path's steps
    messages: list[dict]
    interventions: list[dict] = field(default_factory=list)  # {step, branch, diagnosis}
    flagged: list[StepDiagnosis] = field(default_factory=list)  # every diagnosis made, discarded steps too
    tokens: int = 0
    policy_calls: int = 0
    sandbox_s: float = 0.0
    probe_runs: int = 0
    wall_s: float = 0.0
    stopped: str = ""  # "", "max_steps", "tokens"
    effects: list[list[tuple[str, dict, dict]]] = field(default_factory=list, repr=False)  # per kept step
    msgs_before: list[int] = field(default_factory=list, repr=False)  # len(messages) before each kept step

    def branch_at(self, k: int) -> Resume:
        """The state after step k (0: the start) of this episode, to continue from."""
        if not 0 <= k <= len(self.trace.steps):
            raise ValueError(f"step {k} is outside 0..{len(self.trace.steps)}")
        n = self.msgs_before[k] if k < len(self.msgs_before) else len(self.messages)
        return Resume(messages=self.messages[:n], effects=self.effects[:k], steps=self.trace.steps[:k],
                      diagnoses=self.diagnoses[:k], start=self.trace.start, msgs_before=self.msgs_before[:k])

    @property
    def regenerations(self) -> int:
        return len(self.interventions)

    def to_dict(self) -> dict:
        return {"episode_id": self.episode_id, "task": self.task, "resolved": self.resolved, "reward": self.reward,
                "patch": self.patch, "steps": len(self.trace.steps), "tokens": self.tokens,
                "policy_calls": self.policy_calls, "sandbox_s": self.sandbox_s, "probe_runs": self.probe_runs,
                "wall_s": self.wall_s, "stopped": self.stopped, "regenerations": self.regenerations,
                "interventions": self.interventions, "diagnoses": [d.model_dump(mode="json") for d in self.diagnoses],
                "flagged": [d.model_dump(mode="json") for d in self.flagged],
                "trace": self.trace.model_dump(mode="json"), "messages": self.messages, "report": self.report}


def estimate_tokens(request: dict, out: dict) -> int:
    usage = out.get("usage") or {}
    if usage.get("prompt_tokens") is not None and usage.get("completion_tokens") is not None:
        return int(usage["prompt_tokens"]) + int(usage["completion_tokens"])
    prompt = json.dumps(request.get("messages", []))
    answer = (out.get("content") or "") + json.dumps(out.get("tool_calls") or [])
    return math.ceil(len(prompt) / 4) + math.ceil(len(answer) / 4)


class GradeCache:
    """Grades by (task, answer digest): the same patch of the same task is graded once."""

    def __init__(self) -> None:
        self.verdicts: dict[tuple[str, str], Verdict] = {}
        self.graded = 0

    def grade(self, task: Task, backend: SandboxBackend, answer: str) -> Verdict:
        key = (task.id, hashlib.sha256(answer.encode()).hexdigest())
        if key not in self.verdicts:
            self.graded += 1
            self.verdicts[key] = task.grade(backend, answer)
        return self.verdicts[key]


class _Live:
    """The current branch: its sandbox, logged view, tools, and the lifetimes of every sandbox."""

    def __init__(self, loop: FlareLoop):
        self.loop = loop
        self.sb: Sandbox | None = None
        self.lsb: LoggedSandbox | None = None
        self.tools: Any = None
        self.born = 0.0
        self.stream_name = ""
        self.episode = ""
        self.marks: Stream | None = None

    def open(self, episode: str, meta: dict) -> None:
        """A fresh sandbox of the task and the episode's streams, laid out as `run_episode` lays them
        out (`<ep>/sandbox`, `<ep>/llm`, `<ep>/steps` with one mark per kept step and the start state
        in its meta), so `rollout.branch.Episode` can branch it and `shoal traj tree` shows it."""
        lp = self.loop
        self.sb = lp.task.sandbox(lp.backend, ttl=SANDBOX_TTL_S)
        self.born = time.monotonic()
        created = self.sb.info()
        self._streams(episode, meta={**meta, "sandbox": self.sb.id, "backend": lp.backend.address})
        start = {"layers": created.layers, "env": created.env, "workdir": created.workdir,
                 "memory_mb": created.limits.memory_mb, "disk_mb": created.limits.disk_mb,
                 "cpu": created.limits.cpu, "pids": created.limits.pids, "upper": created.limits.upper}
        lp.log.store.update_stream(f"{episode}/steps", meta={"start": start, "snapshot_every": None})

    def _streams(self, episode: str, meta: dict | None = None) -> None:
        lp = self.loop
        assert self.sb is not None
        self.episode = episode
        self.stream_name = f"{episode}/sandbox"
        stream = lp.log.stream(self.stream_name, episode=episode, sandbox=self.sb.id, meta=meta)
        lp.log.stream(f"{episode}/llm", episode=episode)  # the policy's calls are not logged here; branches copy it
        self.marks = lp.log.stream(f"{episode}/steps", episode=episode)
        self.lsb = LoggedSandbox(self.sb, stream)
        self.tools = lp.task.tools(self.lsb)

    def mark(self, step: int) -> None:
        """The mark `rollout.branch` reads: where the sandbox stream stood after this kept step."""
        assert self.lsb is not None and self.marks is not None
        self.marks.call("step", {"step": step, "sandbox_seq": self.lsb.stream.cursor, "llm_seq": 0},
                        lambda: {"snapshot": None})

    def branch(self, parent: str, step: int, new_id: str, kept: list[StepView]) -> None:
        """The state after `step` of episode `parent`, through `rollout.branch.Episode.branch`
        (fast-forward from the start, every result compared with the log); then the kept steps'
        calls are replayed through the branch's copied streams (served from the log, nothing runs)
        so that new calls land after them."""
        from ..core.errors import BranchNotExact
        from ..rollout.branch import Episode

        lp = self.loop
        try:
            child = Episode(lp.log, parent, lp.backend).branch(step=step, strategy="fastforward", episode_id=new_id)
        except BranchNotExact as e:
            raise RewindMismatch(str(e)) from None
        self.sb = child.sandbox()
        if self.sb is None:
            raise RewindMismatch(f"branch {new_id!r} of {parent!r} has no live sandbox")
        self.born = time.monotonic()
        self._streams(new_id)
        for view in kept:
            for a in view.actions:
                self.tools.run(a.tool, a.arguments)
            self.mark(view.step)

    def need(self) -> Sandbox:
        if self.sb is None:
            raise RuntimeError("no live sandbox")
        return self.sb

    def seq(self) -> int:
        assert self.lsb is not None
        return self.lsb.stream.cursor

    def effects_since(self, seq: int) -> list[tuple[str, dict, dict]]:
        return [(e.kind, e.request, e.result or {}) for e in self.loop.log.history(self.stream_name)
                if e.seq >= seq and e.status == DONE and e.kind in EFFECTFUL]

    def reapply(self, effects: list[list[tuple[str, dict, dict]]]) -> None:
        """Steps' logged effects, in order, into this (fresh) sandbox; each result must be the logged
        one, or the state would not be the one the log describes (a nondeterministic step)."""
        for step_no, step_effects in enumerate(effects, 1):
            for kind, req, logged in step_effects:
                now = apply(self.need(), kind, req)
                if kind == "exec" and any(now.get(f) != logged.get(f) for f in ("exit_code", "stdout", "stderr")):
                    raise RewindMismatch(f"step {step_no}: `{req.get('cmd')}` gave another result when re-applied "
                                         f"(exit {logged.get('exit_code')} -> {now.get('exit_code')}); "
                                         "the branch would not be in the logged state")

    def close(self) -> float:
        if self.sb is None:
            return 0.0
        self.sb.kill()
        self.sb = None
        return time.monotonic() - self.born


class FlareLoop:
    def __init__(self, task: Task, policy: Policy, backend: SandboxBackend, *, diagnoser: Diagnoser | None = None,
                 threshold: Risk | str | None = Risk.high, budget: Budget | None = None, max_steps: int = 12,
                 probe: bool = True, log: TrajectoryLog | None = None, episode_id: str | None = None,
                 grades: GradeCache | None = None, resume: Resume | None = None):
        self.task, self.policy, self.backend = task, policy, backend
        self.diagnoser = diagnoser or ProgrammaticDiagnoser()
        self.threshold = Risk.parse(threshold) if threshold is not None else None
        self.budget = budget or Budget()
        self.max_steps = max_steps
        from ..tasks.swe.task import SWETask

        self.probe = SWEProbe(task) if probe and isinstance(task, SWETask) else None
        self.log = log or TrajectoryLog(SQLiteLogStore(Path(tempfile.mkdtemp(prefix="shoal-flare-")) / "traj.db"))
        self.episode_id = episode_id or f"flare-{uuid.uuid4().hex[:10]}"
        self.grades = grades or GradeCache()
        if resume is not None and self.threshold is not None:
            raise InvalidArgument("a resumed run (resume=) continues without regeneration: pass threshold=None")
        self.resume = resume

    async def run(self) -> FlareEpisode:
        import asyncio

        live = _Live(self)
        try:
            return await self._run(live)
        finally:  # an error (a policy outage, a rewind that does not reproduce) leaves no sandbox behind
            await asyncio.to_thread(live.close)

    async def _run(self, live: _Live) -> FlareEpisode:
        import asyncio

        t0 = time.monotonic()
        task = self.task
        await asyncio.to_thread(live.open, self.episode_id, {"instance_id": task.id})
        sandbox_s = 0.0
        probe_runs0 = self.probe.runs if self.probe else 0
        problem = next((m["content"] for m in task.prompt() if m["role"] == "user"), "")
        messages: list[dict] = task.prompt()
        steps: list[StepView] = []
        diags: list[StepDiagnosis] = []
        effects: list[list[tuple[str, dict, dict]]] = []  # per kept step: its logged effects
        msgs_before: list[int] = []  # len(messages) before each kept step
        if self.resume is not None:
            res = self.resume
            await asyncio.to_thread(live.reapply, res.effects)
            start, messages, steps, diags = res.start, list(res.messages), list(res.steps), list(res.diagnoses)
            effects = [list(e) for e in res.effects]
            msgs_before = list(res.msgs_before)
        else:
            start = await asyncio.to_thread(self.probe.start, live.need()) if self.probe else {}
        interventions: list[dict] = []
        flagged: list[StepDiagnosis] = []
        tokens = calls = 0
        stopped = ""
        submitted = False
        while not submitted:
            if len(steps) >= self.max_steps:
                stopped = "max_steps"
                break
            if self.budget.tokens is not None and tokens >= self.budget.tokens:
                stopped = "tokens"
                break
            k = len(steps) + 1
            n_msgs, seq0 = len(messages), live.seq()
            req = self.policy.request(messages, live.tools.specs)
            out = await self.policy.complete(req)
            calls += 1
            tokens += estimate_tokens(req, out)
            msg: dict = {"role": "assistant", "content": out.get("content", "")}
            if out.get("tool_calls"):
                msg["tool_calls"] = out["tool_calls"]
            messages.append(msg)
            actions: list[Action] = []
            if not out.get("tool_calls"):
                messages.append({"role": "user", "content": "Use a tool call. Call `submit` when you are done."})
            for call in out.get("tool_calls") or []:
                fn = call.get("function", {})
                obs = await asyncio.to_thread(live.tools.run, fn.get("name", ""), fn.get("arguments", "{}"))
                messages.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": obs.text})
                actions.append(Action(tool=fn.get("name", ""), arguments=fn.get("arguments", "{}"),
                                      observation=obs.text, error=obs.error))
                if obs.submitted:
                    submitted = True
                    break
            prev = steps[-1].facts if steps else start
            facts = await asyncio.to_thread(self.probe.after, live.need(), prev) if self.probe else {}
            view = StepView(step=k, thought=msg["content"] or "", actions=actions, facts=facts)
            prefix = Prefix(task=task.id, problem=problem, start=start, steps=(*steps, view))
            diag = await self.diagnoser.diagnose(prefix)
            flagged.append(diag)
            spent = sandbox_s + (time.monotonic() - live.born)
            if (self.threshold is not None and diag.risk >= self.threshold
                    and len(interventions) < self.budget.regenerations
                    and (self.budget.tokens is None or tokens < self.budget.tokens)
                    and (self.budget.sandbox_s is None or spent < self.budget.sandbox_s)):
                # breakpoint: back to the state after step k-1, the diagnosis in context
                branch = f"{self.episode_id}.r{len(interventions) + 1}"
                parent = live.episode
                sandbox_s += await asyncio.to_thread(live.close)
                if k > 1:  # a branch of the current episode in the log's tree
                    await asyncio.to_thread(live.branch, parent, k - 1, branch, steps)
                else:  # back to the start: a fresh episode (a branch is made after a step, 1 or later)
                    await asyncio.to_thread(live.open, branch, {"instance_id": task.id, "regenerated_from": parent})
                interventions.append({"step": k, "branch": branch, "diagnosis": diag.model_dump(mode="json")})
                del messages[n_msgs:]
                messages.append(feedback_message(diag))
                submitted = False
                continue
            effects.append(live.effects_since(seq0))
            msgs_before.append(n_msgs)
            steps.append(view)
            diags.append(diag)
            await asyncio.to_thread(live.mark, k)
        answer = await asyncio.to_thread(task.answer, live.tools)
        sandbox_s += await asyncio.to_thread(live.close)
        verdict = await asyncio.to_thread(self.grades.grade, task, self.backend, answer)
        trace = Trace(task=task.id, problem=problem, start=start, steps=steps, resolved=verdict.resolved)
        return FlareEpisode(
            episode_id=self.episode_id, task=task.id, resolved=verdict.resolved, reward=verdict.reward,
            report=verdict.report, patch=answer, trace=trace, diagnoses=diags, messages=messages,
            interventions=interventions, flagged=flagged, tokens=tokens, policy_calls=calls, sandbox_s=sandbox_s,
            probe_runs=(self.probe.runs - probe_runs0) if self.probe else 0, wall_s=time.monotonic() - t0,
            stopped=stopped, effects=effects, msgs_before=msgs_before)


async def run_flare(task: Task, policy: Policy, backend: SandboxBackend, **kw: Any) -> FlareEpisode:
    """One episode with diagnosis after every step and breakpoint regeneration (`FlareLoop`)."""
    return await FlareLoop(task, policy, backend, **kw).run()
