"""The task schema: a SWE-bench instance plus what Shoal needs to run it from layers.

Field names follow SWE-bench's `SWEbenchInstance` (repo, instance_id, base_commit, patch,
test_patch, problem_statement, FAIL_TO_PASS, PASS_TO_PASS, ...); `to_swebench()` writes the
instance the way SWE-bench tools read it (F2P / P2P as JSON strings). A Shoal task's "base commit"
is its workspace image; the buggy state is `bug_patch` applied on top, baked into a small task
layer whose git history starts at the buggy state (so `git diff` does not give the answer away).
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field, field_validator

if TYPE_CHECKING:
    from ...core.contract import SandboxBackend
    from ...host import Host
    from ...layers.store import ImageSource
    from ...rollout.task import Tools, Verdict
    from ...rollout.tools import ToolBox
    from ...sdk.sandbox import Sandbox
    from ...trajlog import LoggedSandbox

SYSTEM_PROMPT = """You are a software engineer fixing a bug in a Python repository at /work/repo.
Use the tools: `shell` runs one bash command in the repository (a fresh shell each time), `view_file`,
`edit_file` and `create_file` work on files, `submit` ends the task. The tests must pass afterwards;
do not modify the tests. Your changes to the repository are your answer."""

# the label taxonomy (docs/swe.md): what kind of bug, and where it lives
BUG_TYPES = ("comparison-operator", "boolean-operator", "arithmetic-operator", "off-by-one-constant",
             "negation-removed", "negated-condition")


class Labels(BaseModel):
    bug_type: str = Field(description=f"one of {', '.join(BUG_TYPES)}")
    component: str = Field(description="the module the bug is in, dotted (e.g. toolz.itertoolz)")
    symbol: str = Field(description="the function or Class.method the bug is in")

    @field_validator("bug_type")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in BUG_TYPES:
            raise ValueError(f"unknown bug_type {v!r}; the taxonomy has {', '.join(BUG_TYPES)}")
        return v


class SWETask(BaseModel):
    instance_id: str
    repo: str = Field(description="the workspace project (PyPI name)")
    version: str
    base_commit: str = Field(description="the workspace image the task starts from, e.g. ws/six:1.16.0")
    base_image: str = Field(description="the base (OS + toolchain) image under the workspace")
    problem_statement: str
    patch: str = Field(description="gold patch (unified diff, a/ b/ paths relative to the repo)")
    bug_patch: str = Field(description="the injected bug: applied to the workspace it gives the task state")
    test_patch: str = ""
    FAIL_TO_PASS: list[str]
    PASS_TO_PASS: list[str]
    test_cmd: str = Field(description="pytest arguments run from the repo root (SWE-bench's eval script tail)")
    repo_dir: str = "/work/repo"
    labels: Labels
    created_at: str = ""
    hints_text: str = ""

    @property
    def image(self) -> str:
        """The task layer's image ref in the layer store."""
        return f"swe/{self.instance_id.lower()}:task"

    # ------------------------------------------------------------------ the rollout Task protocol
    # (shoal.rollout.task.Task: the loop runs any task through these; imports are lazy because the
    # suite and the tools import this module)
    @property
    def id(self) -> str:
        return self.instance_id

    def describe(self) -> dict[str, Any]:
        return {"repo": self.repo, "labels": self.labels.model_dump()}

    def prepare(self, host: Host, source: ImageSource | None = None) -> None:
        """Base and workspace images must be here or in `source`; the task layer is pulled from
        `source` if it has it, else built from the bug patch; the grader layer is built if missing."""
        from ...core.errors import ImageNotFound
        from .suite import prepare_task

        for ref in (self.base_image, self.base_commit, self.image):
            try:
                host.store.get_image(ref)
            except ImageNotFound:
                if source is None:
                    if ref == self.image:
                        continue
                    raise
                try:
                    source.pull_into(host.store, ref)
                except ImageNotFound:
                    if ref != self.image:
                        raise
        prepare_task(host, self)

    def sandbox(self, backend: SandboxBackend, **create: Any) -> Sandbox:
        from .suite import task_sandbox

        return task_sandbox(backend, self, **create)

    def prompt(self) -> list[dict]:
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": self.problem_statement}]

    def tools(self, sandbox: LoggedSandbox) -> ToolBox:
        from ...rollout.tools import ToolBox

        return ToolBox(sandbox, self.repo_dir)

    def answer(self, tools: Tools) -> str:
        """The repository's diff (new files included), taken through the log."""
        from ...rollout.tools import ToolBox

        if not isinstance(tools, ToolBox):
            raise TypeError(f"an SWE task's answer is read through its ToolBox, got {type(tools).__name__}")
        return tools.diff()

    def grade(self, backend: SandboxBackend, answer: str) -> Verdict:
        from ...rollout.task import Verdict
        from .suite import evaluate

        rep, _ = evaluate(backend, self, answer)
        return Verdict(reward=1.0 if rep.resolved else 0.0, resolved=rep.resolved, report=rep.to_dict())

    def to_swebench(self) -> dict:
        d = self.model_dump(include={"repo", "instance_id", "base_commit", "patch", "test_patch", "problem_statement",
                                     "hints_text", "created_at", "version"})
        d["FAIL_TO_PASS"] = json.dumps(self.FAIL_TO_PASS)
        d["PASS_TO_PASS"] = json.dumps(self.PASS_TO_PASS)
        d["environment_setup_commit"] = self.base_image
        return d

    @classmethod
    def from_swebench(cls, d: dict, **extra) -> SWETask:
        d = {**d, **extra}
        for k in ("FAIL_TO_PASS", "PASS_TO_PASS"):
            if isinstance(d.get(k), str):
                d[k] = json.loads(d[k])
        d.setdefault("base_image", d.pop("environment_setup_commit", ""))
        return cls.model_validate(d)
