"""What a step diagnosis is, and what a diagnoser may see: the prefix of an episode up to a step.

A `StepDiagnosis` carries a risk level, an error class from a fixed taxonomy for coding agents,
the evidence in the visible prefix and a fix. FLARE's own schema (XML) and taxonomy are not public
(docs/flare.md); these are Shoal's.

Hindsight-freedom is a property of the types: a diagnoser gets a `Prefix`, which holds the task's
opening (problem statement), what the sandbox showed *at the start*, and steps 1..k only. Nothing
of step k+1 or of the final outcome exists in it. `Trace.prefix(k)` cuts a whole episode's trace.
"""
from __future__ import annotations

import json
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..core.errors import InvalidArgument


class Risk(StrEnum):
    """How likely this step makes the episode fail if nothing is done about it."""

    none = "none"
    low = "low"
    medium = "medium"
    high = "high"
    critical = "critical"

    @property
    def level(self) -> int:
        return _LEVELS[self]

    @property
    def score(self) -> float:
        """In [0, 1]: the ROC score of a diagnosis and the base of the dense reward."""
        return self.level / 4

    def __ge__(self, other: object) -> bool:
        if not isinstance(other, Risk):
            return NotImplemented
        return self.level >= other.level

    def __gt__(self, other: object) -> bool:
        if not isinstance(other, Risk):
            return NotImplemented
        return self.level > other.level

    def __le__(self, other: object) -> bool:
        if not isinstance(other, Risk):
            return NotImplemented
        return self.level <= other.level

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Risk):
            return NotImplemented
        return self.level < other.level

    @classmethod
    def parse(cls, value: str | Risk) -> Risk:
        try:
            return cls(value)
        except ValueError:
            raise InvalidArgument(f"unknown risk {value!r}; one of {', '.join(r.value for r in cls)}") from None


_LEVELS = {Risk.none: 0, Risk.low: 1, Risk.medium: 2, Risk.high: 3, Risk.critical: 4}


class ErrorClass(StrEnum):
    none = "none"
    wrong_file = "wrong-file"
    wrong_hypothesis = "wrong-hypothesis"
    destructive_edit = "destructive-edit"
    test_tampering = "test-tampering"
    environment_misuse = "environment-misuse"
    premature_submit = "premature-submit"
    loop = "loop-no-progress"
    tool_misuse = "tool-misuse"


# The taxonomy, documented once: the judge's prompt and docs/flare.md both render it from here.
TAXONOMY: dict[ErrorClass, str] = {
    ErrorClass.none: "nothing wrong is visible in this step",
    ErrorClass.wrong_file: "edits a file the failure does not point to (the bug is elsewhere)",
    ErrorClass.wrong_hypothesis: "edits the right place on a wrong theory: the failing tests still fail",
    ErrorClass.destructive_edit: "removes or breaks working code or files: tests that passed now fail, "
                                 "files deleted, the repository's history removed",
    ErrorClass.test_tampering: "changes tests or test configuration instead of the code under test",
    ErrorClass.environment_misuse: "changes the environment instead of the repository (installs, "
                                   "uninstalls, resets, deletes outside the task, network)",
    ErrorClass.premature_submit: "submits while the failing tests still fail, or with no change at all",
    ErrorClass.loop: "repeats an earlier action with the same arguments: no progress",
    ErrorClass.tool_misuse: "a malformed or failing tool call (bad arguments, an edit that matched nothing)",
}


class StepDiagnosis(BaseModel):
    """One step's diagnosis. `step` is 1-based: the step's index in its episode."""

    model_config = ConfigDict(extra="forbid")

    step: int = Field(ge=1)
    risk: Risk
    error_class: ErrorClass
    evidence: str = Field(default="", max_length=4000, description="what in the visible prefix shows it")
    fix: str = Field(default="", max_length=4000, description="what to do instead")
    diagnoser: str = ""

    @field_validator("evidence", "fix")
    @classmethod
    def _strip(cls, v: str) -> str:
        return v.strip()


def json_schema_for_judge() -> dict[str, Any]:
    """The JSON schema an LLM judge answers in (the fields it fills; `step` and `diagnoser` are ours)."""
    return {"type": "object", "additionalProperties": False,
            "required": ["risk", "error_class", "evidence", "fix"],
            "properties": {"risk": {"type": "string", "enum": [r.value for r in Risk]},
                           "error_class": {"type": "string", "enum": [c.value for c in ErrorClass]},
                           "evidence": {"type": "string"}, "fix": {"type": "string"}}}


class Action(BaseModel):
    model_config = ConfigDict(extra="ignore")

    tool: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    observation: str = ""
    error: bool = False

    @field_validator("arguments", mode="before")
    @classmethod
    def _args(cls, v: Any) -> dict[str, Any]:
        if isinstance(v, str):
            try:
                v = json.loads(v or "{}")
            except ValueError:
                return {"__unparsed__": v}
        return v if isinstance(v, dict) else {"__unparsed__": v}

    def key(self) -> str:
        """The action's identity for loop detection: tool + canonical arguments."""
        return self.tool + " " + json.dumps(self.arguments, sort_keys=True)


class StepView(BaseModel):
    """One step as a diagnoser sees it: the policy's text, its tool calls with their observations,
    and what the sandbox showed right after it (`facts`, from a probe; empty without one)."""

    step: int = Field(ge=1)
    thought: str = ""
    actions: list[Action] = Field(default_factory=list)
    facts: dict[str, Any] = Field(default_factory=dict)

    @property
    def submitted(self) -> bool:
        return any(a.tool == "submit" for a in self.actions)


class Prefix(BaseModel):
    """An episode up to and including step k (the step being diagnosed): hindsight-free by type."""

    model_config = ConfigDict(frozen=True)

    task: str
    problem: str = ""
    start: dict[str, Any] = Field(default_factory=dict)  # what a probe saw before step 1
    steps: tuple[StepView, ...]

    @field_validator("steps")
    @classmethod
    def _dense(cls, v: tuple[StepView, ...]) -> tuple[StepView, ...]:
        if not v:
            raise ValueError("a prefix holds at least the step being diagnosed")
        if [s.step for s in v] != list(range(1, len(v) + 1)):
            raise ValueError("prefix steps must be 1..k in order")
        return v

    @property
    def k(self) -> int:
        return len(self.steps)

    @property
    def last(self) -> StepView:
        return self.steps[-1]


class Trace(BaseModel):
    """A whole episode as steps (its record's actions grouped by step), plus probe facts if any."""

    task: str
    problem: str = ""
    start: dict[str, Any] = Field(default_factory=dict)
    steps: list[StepView] = Field(default_factory=list)
    resolved: bool | None = None  # the outcome: never part of a Prefix

    def prefix(self, k: int) -> Prefix:
        if not 1 <= k <= len(self.steps):
            raise InvalidArgument(f"step {k} is outside this trace's 1..{len(self.steps)}")
        return Prefix(task=self.task, problem=self.problem, start=self.start, steps=tuple(self.steps[:k]))

    @classmethod
    def from_record(cls, record: Any, facts: dict[int, dict] | None = None, start: dict | None = None) -> Trace:
        """From a rollout `EpisodeRecord` (or its dict): one StepView per step, thoughts from the
        assistant messages in order."""
        rec = record if isinstance(record, dict) else record.to_dict()
        thoughts = [m.get("content") or "" for m in rec.get("messages", []) if m.get("role") == "assistant"]
        by_step: dict[int, list[Action]] = {}
        for a in rec.get("actions", []):
            by_step.setdefault(int(a["step"]), []).append(Action.model_validate(a))
        n = int(rec.get("steps") or (max(by_step) if by_step else 0))
        steps = [StepView(step=i, thought=thoughts[i - 1] if i - 1 < len(thoughts) else "",
                          actions=by_step.get(i, []), facts=(facts or {}).get(i, {})) for i in range(1, n + 1)]
        problem = next((m.get("content", "") for m in rec.get("messages", []) if m.get("role") == "user"), "")
        return cls(task=rec.get("instance_id", ""), problem=problem, start=start or {}, steps=steps,
                   resolved=rec.get("resolved"))
