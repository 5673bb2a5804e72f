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

Everything the loop's decisions depend on goes through the trajectory log, per episode of the
tree: the tool calls (`<ep>/sandbox`), the policy calls (`<ep>/llm`), and the probe's facts and
the diagnoses (`<ep>/flare`). So a run killed at any point resumes: `FlareLoop` with the same log
and episode id fast-forwards every logged call (no policy call, judge call or tool call runs
again), follows the same regenerations into the same branches, and goes on live where the log
ends, in the last branch's sandbox (reattached if it is still running, else recreated and its
logged effects re-applied).
"""
from __future__ import annotations

import functools
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
from ..core.errors import InvalidArgument, SandboxNotFound, ShoalError, UnknownOutcome
from ..envs.sandboxes import attach
from ..rollout.policy import Policy
from ..rollout.task import Task, Verdict
from ..sdk.sandbox import Sandbox
from ..trajlog import DONE, LoggedSandbox, SQLiteLogStore, Stream, TrajectoryLog, restore
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
    replayed: dict = field(default_factory=dict)  # calls served from the log on this run (a resume), per kind
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
                "replayed": self.replayed,
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


class _LazyLogged(LoggedSandbox):
    """A LoggedSandbox whose sandbox is found only when a call has to run live: a resumed episode's
    logged calls are served from the log, so an episode of the tree that the log holds to its end
    never needs one (its sandbox was closed when the loop branched away from it)."""

    def __init__(self, stream: Stream, find: Any):
        self._sb: Sandbox | None = None
        self._find = find
        super().__init__(None, stream)

    @property
    def sandbox(self) -> Sandbox | None:
        if self._sb is None and self._find is not None:
            find, self._find = self._find, None
            self._sb = find()
            self.stream.set_sandbox(self._sb.id)
        return self._sb

    @sandbox.setter
    def sandbox(self, sb: Sandbox | None) -> None:
        self._sb = sb


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
        self.llm: Stream | None = None
        self.flare: Stream | None = None
        self.replayed = {"llm": 0, "sandbox": 0, "flare": 0}

    def open(self, episode: str, meta: dict) -> bool:
        """A fresh sandbox of the task and the episode's streams, laid out as `run_episode` lays them
        out (`<ep>/sandbox`, `<ep>/llm`, `<ep>/steps` with one mark per kept step and the start state
        in its meta), so `rollout.branch.Episode` can branch it and `shoal traj tree` shows it. An
        episode the log holds already (a resumed run) gets no new sandbox: its calls replay, and its
        own sandbox is found if a call has to run live. True if it was resumed."""
        lp = self.loop
        if lp.log.info(f"{episode}/sandbox") is not None:
            self._streams(episode, lazy=True)
            return True
        self.sb = lp.task.sandbox(lp.backend, ttl=SANDBOX_TTL_S)
        self.born = time.monotonic()
        created = self.sb.info()
        self._streams(episode, meta={**meta, "sandbox": self.sb.id, "backend": lp.backend.address})
        start = {"layers": created.layers, "env": created.env, "workdir": created.workdir,
                 "memory_mb": created.limits.memory_mb, "disk_mb": created.limits.disk_mb,
                 "cpu": created.limits.cpu, "pids": created.limits.pids, "upper": created.limits.upper}
        lp.log.store.update_stream(f"{episode}/steps", meta={"start": start, "snapshot_every": None})
        return False

    def _streams(self, episode: str, meta: dict | None = None, lazy: bool = False) -> None:
        lp = self.loop
        self._count()
        self.episode = episode
        self.stream_name = f"{episode}/sandbox"
        stream = lp.log.stream(self.stream_name, episode=episode, sandbox=self.sb.id if self.sb else None, meta=meta)
        self.llm = lp.log.stream(f"{episode}/llm", episode=episode)
        self.flare = lp.log.stream(f"{episode}/flare", episode=episode)
        self.marks = lp.log.stream(f"{episode}/steps", episode=episode)
        self.lsb = _LazyLogged(stream, self._found) if lazy else LoggedSandbox(self.sb, stream)
        self.tools = lp.task.tools(self.lsb)

    def totals(self) -> dict:
        """Calls served from the log on this run, per kind (all episodes of the tree so far)."""
        now: dict[str, Stream | None] = {"llm": self.llm, "flare": self.flare,
                                         "sandbox": self.lsb.stream if self.lsb else None}
        out = dict(self.replayed)
        for k, st in now.items():
            if st is not None:
                out[k] += st.replayed
        return out

    def _count(self) -> None:
        """Add the closing episode's replayed calls to the run's totals."""
        for kind, st in (("llm", self.llm), ("flare", self.flare), ("sandbox", self.lsb.stream if self.lsb else None)):
            if st is not None:
                self.replayed[kind] += st.replayed
        self.llm = self.flare = None
        self.lsb = None

    def _found(self) -> Sandbox:
        """A resumed episode's sandbox, when a call must run live: still running on this backend
        (the killed run left it), or a new one with the episode's logged effects re-applied."""
        lp = self.loop
        info = lp.log.info(self.stream_name)
        meta = (info.meta if info else {}) or {}
        sb: Sandbox | None = None
        if meta.get("sandbox") and meta.get("backend") == lp.backend.address:
            try:
                sb = attach(lp.backend, meta["sandbox"])
                if not sb.is_running():
                    sb = None
            except SandboxNotFound:
                sb = None
        if sb is None:
            sb = lp.task.sandbox(lp.backend, ttl=SANDBOX_TTL_S)
            restore(lp.log, self.stream_name, sb)
            lp.log.store.update_stream(self.stream_name, meta={"sandbox": sb.id, "backend": lp.backend.address})
        self.sb = sb
        self.born = time.monotonic()
        return sb

    def mark(self, step: int) -> None:
        """The mark `rollout.branch` reads: where the streams stood after this kept step."""
        assert self.lsb is not None and self.marks is not None and self.llm is not None
        self.marks.call("step", {"step": step, "sandbox_seq": self.lsb.stream.cursor, "llm_seq": self.llm.cursor},
                        lambda: {"snapshot": None})

    def branch(self, parent: str, step: int, new_id: str, kept: list[StepView]) -> None:
        """The state after `step` of episode `parent`, through `rollout.branch.Episode.branch`
        (fast-forward from the start, every result compared with the log); then the kept steps'
        calls are replayed through the branch's copied streams (served from the log, nothing runs)
        so that new calls land after them. A branch the log holds already (a resumed run) is
        followed, not made again."""
        from ..core.errors import BranchNotExact
        from ..rollout.branch import Episode

        lp = self.loop
        child_ep = Episode(lp.log, new_id, lp.backend)
        if child_ep.exists():
            self._streams(new_id, lazy=True)
        else:
            try:
                child = Episode(lp.log, parent, lp.backend).branch(step=step, strategy="fastforward",
                                                                   episode_id=new_id)
            except BranchNotExact as e:
                raise RewindMismatch(str(e)) from None
            self.sb = child.sandbox()
            if self.sb is None:
                raise RewindMismatch(f"branch {new_id!r} of {parent!r} has no live sandbox")
            self.born = time.monotonic()
            self._streams(new_id)
        assert self.llm is not None
        marks = child_ep.marks()
        copied = lp.log.history(f"{new_id}/llm")
        for view in kept:
            upto = marks[view.step - 1].llm_seq if view.step <= len(marks) else self.llm.cursor
            while self.llm.cursor < upto:  # the kept steps' policy calls, served from the copied stream
                entry = copied[self.llm.cursor]
                self.llm.call(entry.kind, entry.request, _never)
            for a in view.actions:
                self.tools.run(a.tool, a.arguments)
            self.mark(view.step)

    def need(self) -> Sandbox:
        if self.sb is None and isinstance(self.lsb, _LazyLogged):
            self.sb = self.lsb.sandbox
        if self.sb is None:
            raise RuntimeError("no live sandbox")
        return self.sb

    def seq(self) -> int:
        assert self.lsb is not None
        return self.lsb.stream.cursor

    def effects_since(self, seq: int) -> list[tuple[str, dict, dict]]:
        return [(e.kind, e.request, e.result or {}) for e in self.loop.log.history(self.stream_name)
                if e.seq >= seq and e.status == DONE and e.kind in EFFECTFUL]

    async def policy(self, req: dict) -> dict:
        """One policy call through `<ep>/llm` (served from the log when it holds it)."""
        import functools

        assert self.llm is not None
        try:
            return (await self.llm.acall("llm", req, functools.partial(self.loop.policy.complete, req),
                                         idempotent=True)).result
        except UnknownOutcome:  # in flight when the run was killed: a model call has no effect, ask again
            return self.llm.settle(await self.loop.policy.complete(req)).result

    def logged(self, kind: str, req: dict, run: Any) -> dict:
        """A probe run through `<ep>/flare`: what the sandbox showed is logged, so a resumed run sees
        the same facts without touching the sandbox (which is in a later state by then)."""
        assert self.flare is not None
        try:
            return self.flare.call(kind, req, run).result
        except UnknownOutcome:  # the probe only reads: run it again
            return self.flare.settle(run()).result

    async def diagnosis(self, k: int, dg: Diagnoser, prefix: Prefix) -> StepDiagnosis:
        async def run() -> dict:
            return (await dg.diagnose(prefix)).model_dump(mode="json")

        assert self.flare is not None
        try:
            out = (await self.flare.acall("diagnose", {"step": k}, run, idempotent=True)).result
        except UnknownOutcome:
            out = self.flare.settle(await run()).result
        return StepDiagnosis.model_validate(out)

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
        """Kill the episode's sandbox. A resumed episode whose sandbox was never needed may still
        have one running (the killed run left it): that one is killed too."""
        if self.sb is None and isinstance(self.lsb, _LazyLogged) and self.lsb._find is not None:
            self.lsb._find = None
            info = self.loop.log.info(self.stream_name)
            meta = (info.meta if info else {}) or {}
            if meta.get("sandbox") and meta.get("backend") == self.loop.backend.address:
                try:
                    attach(self.loop.backend, meta["sandbox"]).kill()
                except SandboxNotFound:
                    pass
            return 0.0
        if self.sb is None:
            return 0.0
        self.sb.kill()
        self.sb = None
        return time.monotonic() - self.born


def _never() -> dict:
    raise RuntimeError("a copied log entry was expected here")


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

    def _probe_start(self, live: _Live) -> dict:
        assert self.probe is not None
        return self.probe.start(live.need())

    def _probe_after(self, live: _Live, prev: dict) -> dict:
        assert self.probe is not None
        return self.probe.after(live.need(), prev)

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
            start = await asyncio.to_thread(live.logged, "start", {}, functools.partial(self._probe_start, live)) \
                if self.probe else {}
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
            out = await live.policy(req)
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
            facts = await asyncio.to_thread(live.logged, "probe", {"step": k, "sandbox_seq": live.seq()},
                                            functools.partial(self._probe_after, live, prev)) if self.probe else {}
            view = StepView(step=k, thought=msg["content"] or "", actions=actions, facts=facts)
            prefix = Prefix(task=task.id, problem=problem, start=start, steps=(*steps, view))
            diag = await live.diagnosis(k, self.diagnoser, prefix)
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
            stopped=stopped, effects=effects, msgs_before=msgs_before, replayed=live.totals())


async def run_flare(task: Task, policy: Policy, backend: SandboxBackend, **kw: Any) -> FlareEpisode:
    """One episode with diagnosis after every step and breakpoint regeneration (`FlareLoop`)."""
    return await FlareLoop(task, policy, backend, **kw).run()
