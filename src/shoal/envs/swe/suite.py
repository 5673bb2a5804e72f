"""The bundled SWE task suite: load it, turn a task into layers, grade a patch in a fresh sandbox.

A task's sandbox is `base image + workspace layers + task layer`. The task layer is built once per
host from the task's `bug_patch` (content-addressed, so rebuilding gives the same digest) and holds
only the changed source file plus a fresh one-commit git history.
"""
from __future__ import annotations

import os
from pathlib import Path

from ...errors import BuildError, ImageNotFound, InvalidArgument
from ...host import Host
from ...sdk.sandbox import Sandbox
from ..builder import DEFAULT_EXCLUDE
from ..workspaces import CATALOG, WorkspaceSpec
from .grading import Report, eval_script, filter_patch, grade
from .task import SWETask

SUITE_PATH = Path(__file__).with_name("suite.jsonl")
TASK_LIMITS = {"memory_mb": 1024, "disk_mb": 512}
_GIT = "git -c user.email=task@shoal -c user.name=shoal"


def load_suite(path: str | os.PathLike | None = None) -> list[SWETask]:
    p = Path(path) if path else SUITE_PATH
    if not p.exists():
        raise InvalidArgument(f"no task suite at {p}; generate one with `python -m shoal.envs.swe.generate`")
    tasks = []
    for i, line in enumerate(p.read_text().splitlines(), 1):
        if line.strip():
            try:
                tasks.append(SWETask.model_validate_json(line))
            except ValueError as e:
                raise InvalidArgument(f"{p}:{i}: not a valid task: {e}") from None
    return tasks


def save_suite(tasks: list[SWETask], path: str | os.PathLike | None = None) -> Path:
    p = Path(path) if path else SUITE_PATH
    tmp = p.with_suffix(".tmp")
    tmp.write_text("".join(t.model_dump_json() + "\n" for t in sorted(tasks, key=lambda t: t.instance_id)))
    os.replace(tmp, p)
    return p


def spec_for(task: SWETask) -> WorkspaceSpec:
    for s in CATALOG:
        if s.name == task.repo and s.version == task.version:
            return s
    raise InvalidArgument(f"task {task.instance_id}: workspace {task.repo}=={task.version} is not in the catalog")


def ensure_task_image(host: Host, task: SWETask) -> str:
    """Build (once) the task layer: the bug applied, git history restarted at the buggy state."""
    try:
        host.store.get_image(task.image)
        return task.image
    except ImageNotFound:
        pass
    sb = Sandbox.create(task.base_image, layers=[task.base_commit], root=host.settings.root, ttl=900, **TASK_LIMITS)
    try:
        sb.files.write("/tmp/bug.patch", task.bug_patch)
        r = sb.commands.run(f"cd {task.repo_dir} && git apply /tmp/bug.patch && rm -rf .git /tmp/bug.patch && "
                            f"git init -q && git add -A && {_GIT} commit -qm 'task state' && git gc -q --prune=now",
                            timeout=300)
        if r.exit_code != 0:
            raise BuildError(f"task {task.instance_id}: could not apply its bug patch: {(r.stdout + r.stderr)[-800:]}")
        host.runtime.pause(sb.id)  # nothing may change while the upper is captured
        layer = host.store.build_from_dir(host.runtime.upper_dir(sb.id), source=f"swe task {task.instance_id}",
                                          exclude=DEFAULT_EXCLUDE)
    finally:
        sb.kill()
    host.store.create_image(task.image, [layer.digest], config={"role": "task", "workdir": task.repo_dir,
                                                               "built_on": task.base_commit})
    return task.image


def task_sandbox(host: Host, task: SWETask, **kw) -> Sandbox:
    ensure_task_image(host, task)
    return Sandbox.create(task.base_image, layers=[task.base_commit, task.image], root=host.settings.root,
                          **{**TASK_LIMITS, **kw})


def evaluate(host: Host, task: SWETask, patch: str | None, timeout: float = 60) -> tuple[Report, str]:
    """Grade a patch the SWE-bench way, in a fresh sandbox of the task (the agent's sandbox may have
    been tampered with). Returns (report, test log)."""
    if not patch or not patch.strip():
        patch_text, dropped = "", []
    else:
        patch_text, dropped = filter_patch(patch)
    # a TTL: if the grading process dies (a worker killed mid-grade), the sandbox does not outlive it
    with task_sandbox(host, task, ttl=timeout + 120) as sb:
        applied = True
        if patch_text:
            sb.files.write("/tmp/model.patch", patch_text)
            r = sb.commands.run(f"cd {task.repo_dir} && git apply --whitespace=nowarn /tmp/model.patch", timeout=60)
            applied = r.exit_code == 0
        if not applied:
            rep = grade("", task.FAIL_TO_PASS, task.PASS_TO_PASS, patch_applied=False)
            rep.dropped_files = dropped
            return rep, r.stderr
        r = sb.commands.run(eval_script(task.repo_dir, task.test_cmd), timeout=timeout)
        log = r.stdout + r.stderr
    rep = grade(log, task.FAIL_TO_PASS, task.PASS_TO_PASS, patch_exists=bool(patch_text))
    rep.dropped_files = dropped
    return rep, log


def validate(host: Host, task: SWETask, unpatched_runs: int = 1) -> dict:
    """A task is valid when every FAIL_TO_PASS test fails in the unpatched state (in each of
    `unpatched_runs` runs: flaky tasks are caught) and the gold patch resolves it."""
    befores = [evaluate(host, task, None)[0] for _ in range(unpatched_runs)]
    before = max(befores, key=lambda r: r.f2p_passed)
    after, log = evaluate(host, task, task.patch)
    ok = not before.resolved and before.f2p_passed == 0 and after.resolved
    return {"instance_id": task.instance_id, "valid": ok, "unpatched": before.status, "gold": after.status,
            "gold_invalid": after.invalid, "log_tail": "" if ok else log[-1500:]}


def summary(tasks: list[SWETask]) -> dict:
    by_repo: dict[str, int] = {}
    by_type: dict[str, int] = {}
    for t in tasks:
        by_repo[t.repo] = by_repo.get(t.repo, 0) + 1
        by_type[t.labels.bug_type] = by_type.get(t.labels.bug_type, 0) + 1
    return {"tasks": len(tasks), "repos": len(by_repo), "by_repo": by_repo, "by_bug_type": by_type}


