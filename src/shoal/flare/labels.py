"""Step labels synthesized RADAR-style, and ROC-AUC of a diagnoser against them.

FLARE's RADAR labels a step by what it did to the outcome, using only executions, never a model:

- **failure track**: in a failed episode, the first step after which the outcome was determined.
  Here it is found with branches: for k = 1, 2, ... the episode is branched at the state after
  step k and continued by the same policy with its mistakes switched off (p = 0); the first k from
  which that continuation still fails is the decisive step (label 1); the steps before it are
  label 0; the steps after it are not labelled (the outcome was already settled). An episode that
  fails even when continued from its start is skipped (the policy cannot solve it at all).
- **success track**: into an oracle run (p = 0) that resolves, one mistake is injected at a chosen
  turn and the episode goes on without further mistakes; the injected step is label 1 if the
  episode no longer resolves (unrecoverable), 0 if it recovered; the steps before it are 0.

What "determined" means depends on the continuation policy; FLARE's exact backtracking procedure
is not public (docs/flare.md).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from ..core.contract import SandboxBackend
from ..tasks.swe.task import SWETask
from .diagnoser import Diagnoser
from .policy import FallibleOraclePolicy
from .regen import FlareEpisode, GradeCache, run_flare
from .schema import Trace


@dataclass
class StepLabel:
    track: str  # "failure" | "success"
    task: str
    episode: str
    step: int
    label: int  # 1: this step decided a failure
    kind: str = ""  # the injected mistake (success track) or the policy's tag of the step

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Labelled:
    """A trace and its labelled steps (diagnosers are scored on `trace.prefix(step)`)."""

    trace: Trace
    labels: list[StepLabel]


async def _continue(task: SWETask, ep: FlareEpisode, k: int, backend: SandboxBackend, grades: GradeCache,
                    max_steps: int) -> bool:
    policy = FallibleOraclePolicy(task, p=0.0)
    cont = await run_flare(task, policy, backend, threshold=None, resume=ep.branch_at(k), grades=grades,
                           max_steps=max_steps, probe=False)
    return cont.resolved


async def failure_track(task: SWETask, ep: FlareEpisode, backend: SandboxBackend, grades: GradeCache,
                        max_steps: int = 12) -> Labelled | None:
    if ep.resolved or not ep.trace.steps:
        return None
    if not await _continue(task, ep, 0, backend, grades, max_steps):
        return None
    labels = []
    for k in range(1, len(ep.trace.steps) + 1):
        decided = not await _continue(task, ep, k, backend, grades, max_steps) if k < len(ep.trace.steps) else True
        labels.append(StepLabel("failure", task.id, ep.episode_id, k, int(decided), ep.trace.steps[k - 1].thought))
        if decided:
            break
    return Labelled(ep.trace, labels)


async def success_track(task: SWETask, backend: SandboxBackend, grades: GradeCache, turn: int, kind: str,
                        max_steps: int = 12) -> Labelled | None:
    """Inject `kind` at answer `turn` (0-based) of an oracle run; label by recovery."""
    policy = FallibleOraclePolicy(task, p=0.0, inject={turn: kind})
    ep = await run_flare(task, policy, backend, threshold=None, grades=grades, max_steps=max_steps)
    k = turn + 1
    if len(ep.trace.steps) < k or not ep.trace.steps[k - 1].thought.startswith("error:"):
        return None  # the mistake could not be made there (e.g. nothing to repeat)
    labels = [StepLabel("success", task.id, ep.episode_id, i, 0, ep.trace.steps[i - 1].thought) for i in range(1, k)]
    labels.append(StepLabel("success", task.id, ep.episode_id, k, int(not ep.resolved), kind))
    return Labelled(ep.trace, labels)


def roc_auc(scores: Sequence[float], labels: Sequence[int]) -> float | None:
    """ROC-AUC (the Mann-Whitney U statistic, ties counted half); None without both classes."""
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    if not pos or not neg:
        return None
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


async def score(diagnoser: Diagnoser, data: Sequence[Labelled]) -> tuple[list[float], list[int]]:
    """The diagnoser's risk score on every labelled step, from that step's prefix."""
    scores, ys = [], []
    for item in data:
        for lab in item.labels:
            d = await diagnoser.diagnose(item.trace.prefix(lab.step))
            scores.append(d.risk.score)
            ys.append(lab.label)
    return scores, ys
