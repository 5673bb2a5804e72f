"""What the rollout loop needs from a task: the `Task` protocol.

The loop (`episode.run_episode`, the worker, the Gymnasium and verl adapters) knows nothing about
SWE: it asks the task for a sandbox, the opening messages and the tools, lets the policy act through
those tools, then asks the task for the answer and a grade. `shoal.tasks.swe.SWETask` implements it;
a new kind of task (desktop tasks, say) implements the same methods and plugs into the same loop.

Two sides, two privileges:
- `prepare` is the operator's step, on the host whose store the sandboxes start from: it makes the
  task's images (pulls, builds). It needs that host's layer store, so it runs as root, once
  (`shoal tasks prepare`), or lazily when a rollout runs in-process.
- `sandbox` and `grade` take any `SandboxBackend`: the loop's default is shoald, so a trainer and
  its rollout workers need no root; they start sandboxes from images the operator prepared.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ..core.contract import SandboxBackend
    from ..host import Host
    from ..layers.store import ImageSource
    from ..sdk.sandbox import Sandbox
    from ..trajlog import LoggedSandbox
    from .tools import Observation


@dataclass
class Verdict:
    """A graded episode: the reward the trainer sees and the task's own report (JSON-safe)."""

    reward: float
    resolved: bool
    report: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Verdict:
        return cls(reward=float(d["reward"]), resolved=bool(d["resolved"]), report=dict(d.get("report") or {}))


@runtime_checkable
class Tools(Protocol):
    """The actions an agent has in an episode, run through a logged sandbox."""

    specs: list[dict]  # OpenAI function-calling schemas, for the policy's prompt

    def run(self, name: str, arguments: str | dict) -> Observation:
        """Run one tool call. Never raises for a bad call: an error is an Observation with error=True."""
        ...


@runtime_checkable
class Task(Protocol):
    @property
    def id(self) -> str:
        """Unique within its suite: the queue's task id."""
        ...

    @property
    def image(self) -> str:
        """An image ref of the task: workers prefer episodes whose image their node already holds."""
        ...

    def describe(self) -> dict[str, Any]:
        """What the episode record carries about the task (e.g. {"repo": ..., "labels": {...}})."""
        ...

    def prepare(self, host: Host, source: ImageSource | None = None) -> None:
        """Make every image the task needs (its sandboxes' and its grader's) present on `host`, pulling
        what is missing from `source` and building the rest. The operator's step: needs the host's store."""
        ...

    def sandbox(self, backend: SandboxBackend, **create: Any) -> Sandbox:
        """A fresh sandbox in the task's start state on `backend` (create: ttl=, memory_mb=, ... overrides).
        Over shoald the images must have been prepared on its host (ImageNotFound says which is missing)."""
        ...

    def prompt(self) -> list[dict]:
        """The opening chat messages (system, user)."""
        ...

    def tools(self, sandbox: LoggedSandbox) -> Tools:
        """The agent's tools acting on `sandbox` (every call goes through its trajectory log)."""
        ...

    def answer(self, tools: Tools) -> str:
        """What gets graded, read at the end of the episode (e.g. the repository's diff)."""
        ...

    def grade(self, backend: SandboxBackend, answer: str) -> Verdict:
        """Grade an answer (in a fresh sandbox of its own on `backend`, never the agent's)."""
        ...
