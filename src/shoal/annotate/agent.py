"""The environment in the loop when annotating a Shoal episode at step k (docs/annotate.md).

An episode item is one assistant step of an episode in the trajectory log. When the annotator has
corrected the step's tool call, `EpisodeEnv.execute` runs it for real:

1. the state before the step comes back through `rollout.branch.Episode.branch` (the episode's log
   up to step k-1, a sandbox in the state after it); a first step starts from a fresh sandbox of the
   task, its start state;
2. the corrected tool calls run on that sandbox through the task's own tools, logged in the branch's
   `<ep>/sandbox` stream, and a step mark with a snapshot closes the step, so a later correction
   further down branches from this branch exactly as from any episode;
3. the sandbox is killed; the tool outputs go back to the page, which lets the model continue
   after them.

In the annotation tree the tool outputs are tokens written by the environment (source "o"): never
the model's, never an annotator's, and never trained on.
"""
from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..core.errors import InvalidArgument, ShoalError

if TYPE_CHECKING:
    from ..core.contract import SandboxBackend
    from ..rollout.task import Task
    from ..trajlog import TrajectoryLog

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
RESP_OPEN, RESP_CLOSE = "<tool_response>", "</tool_response>"
BRANCH_TTL_S = 600.0  # a branch's sandbox lives for one tool step; a crashed app's ones expire
_CALL = re.compile(re.escape(TOOL_OPEN) + r"(.*?)" + re.escape(TOOL_CLOSE), re.S)


def render_observation(text: str) -> str:
    """A tool's output as the text the model reads after its call."""
    return f"\n{RESP_OPEN}\n{text}\n{RESP_CLOSE}\n"


def pending_calls(text: str) -> list[tuple[str, str]]:
    """The tool calls written since the last tool output (name, JSON arguments), in order. A call
    that is not `{"name": ..., "arguments": ...}` JSON is an InvalidArgument that says which."""
    tail = text.rsplit(RESP_CLOSE, 1)[-1]
    out = []
    for raw in _CALL.findall(tail):
        try:
            call = json.loads(raw)
            name, args = call["name"], call.get("arguments") or {}
            if not isinstance(name, str):
                raise TypeError("name")
        except (ValueError, KeyError, TypeError):
            raise InvalidArgument(f"the tool call {raw.strip()[:120]!r} is not JSON with a 'name' and "
                                  "'arguments'; correct it so that it is") from None
        out.append((name, args if isinstance(args, str) else json.dumps(args)))
    return out


def ends_with_call(text: str) -> bool:
    """The response so far ends with a complete tool call that has no output yet."""
    tail = text.rsplit(RESP_CLOSE, 1)[-1].rstrip()
    return tail.endswith(TOOL_CLOSE) and TOOL_OPEN in tail


@dataclass
class StepRun:
    """One corrected step run in a branch."""
    episode: str  # the branch's episode id in the trajectory log
    parent: str  # the episode it branched from
    parent_step: int  # its steps 1..parent_step are the branch's (0: the task's start state)
    step: int  # this step's number in the branch
    strategy: str  # snapshot | fastforward (rollout.branch), or start
    sandbox: str
    observations: list[dict]  # {"tool", "arguments", "text", "error"}
    snapshot: str | None
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class EpisodeEnv:
    """Runs corrected tool calls of episode items in branches of their episodes, on `backend`.
    `task_for(item)` gives the episode's task (its tools and start sandbox)."""

    def __init__(self, log: TrajectoryLog, backend: SandboxBackend, task_for: Callable[[dict], Task],
                 ttl: float = BRANCH_TTL_S):
        self.log, self.backend, self.task_for, self.ttl = log, backend, task_for, ttl

    def execute(self, item: dict, base: tuple[str, int], calls: list[tuple[str, str]]) -> StepRun:
        """Branch episode base[0] after its step base[1], run `calls` there as the next step."""
        from ..rollout.branch import Episode
        from ..trajlog import LoggedSandbox

        if not calls:
            raise InvalidArgument("there is no tool call to run: the response has none since the last tool output")
        t0 = time.perf_counter()
        parent, parent_step = base
        task = self.task_for(item)
        new_id = f"{parent}.a{parent_step + 1}.{secrets.token_hex(3)}"
        if parent_step >= 1:
            child = Episode(self.log, parent, self.backend).branch(parent_step, episode_id=new_id, ttl=self.ttl)
            assert child.info is not None
            strategy = child.info.strategy
            sb = child.sandbox()
            if sb is None:
                raise ShoalError(f"the branch {new_id!r} of {parent!r} has no live sandbox")
        else:  # the first step: the state before it is the task's start
            strategy = "start"
            sb = task.sandbox(self.backend, ttl=self.ttl)
            created = sb.info()
            self.log.stream(f"{new_id}/sandbox", episode=new_id,
                            meta={"instance_id": task.id, "annotated_from": parent, "sandbox": sb.id,
                                  "backend": self.backend.address})
            self.log.stream(f"{new_id}/llm", episode=new_id)
            self.log.stream(f"{new_id}/steps", episode=new_id)
            self.log.store.update_stream(f"{new_id}/steps", meta={"start": {
                "layers": created.layers, "env": created.env, "workdir": created.workdir,
                "memory_mb": created.limits.memory_mb, "disk_mb": created.limits.disk_mb,
                "cpu": created.limits.cpu, "pids": created.limits.pids, "upper": created.limits.upper}})
        try:
            stream = self.log.stream(f"{new_id}/sandbox", episode=new_id, sandbox=sb.id)
            stream.cursor = stream.size  # the copied steps stay as they are: this step goes on after them
            llm = self.log.stream(f"{new_id}/llm", episode=new_id)
            marks = self.log.stream(f"{new_id}/steps", episode=new_id)
            marks.cursor = marks.size
            tools = task.tools(LoggedSandbox(sb, stream))
            obs = []
            for name, args in calls:
                o = tools.run(name, args)
                obs.append({"tool": name, "arguments": args, "text": o.text, "error": o.error})
                if o.submitted:
                    break
            snap = sb.snapshot()  # the state after this step, exactly, for corrections further down
            step = parent_step + 1
            marks.call("step", {"step": step, "sandbox_seq": stream.cursor, "llm_seq": llm.size},
                       lambda: {"snapshot": snap.id, "image": snap.image, "size": snap.size, "step": step})
        finally:
            sb.kill()
        return StepRun(episode=new_id, parent=parent, parent_step=parent_step, step=step, strategy=strategy,
                       sandbox=sb.id, observations=obs, snapshot=snap.id, seconds=time.perf_counter() - t0)
