"""The bundled SWE task suite: load it, turn a task into layers, grade a patch in a fresh sandbox.

A task's sandbox is `base image + workspace layers + task layer`. The task layer is built once per
host from the task's `bug_patch` (content-addressed, so rebuilding gives the same digest) and holds
only the changed source file plus a fresh one-commit git history.

Building needs the host's layer store (`Host`, root): `prepare` does it, and so does any function
here when handed a `Host`. Over any other backend (shoald, the default for rollouts) sandboxes start
from the images the operator prepared, and a missing one is an ImageNotFound that says so.
"""
from __future__ import annotations

import hashlib
import os
import re
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ...core.contract import ExecRequest, SandboxBackend
from ...core.errors import BuildError, ImageNotFound, InvalidArgument, ShoalError
from ...envs.builder import DEFAULT_EXCLUDE
from ...envs.sandboxes import create_request, open_sandbox
from ...envs.workspaces import CATALOG, WorkspaceSpec
from ...host import Host
from ...sdk.sandbox import Sandbox
from .grading import (
    END,
    EXIT,
    PROTECTED_PATTERN,
    START,
    Report,
    f2p_passed,
    filter_patch,
    grade,
    grade_run,
    malformed_patch,
    record_statuses,
)
from .screen import screen_changes, screen_patch
from .task import SWETask
from .trusted import (
    GRADER_IMAGE,
    RUN,
    RunConfig,
    RunRecord,
    ensure_grader_image,
    pytest_config,
    trusted_eval_script,
    verify_record,
)

SUITE_PATH = Path(__file__).with_name("suite.jsonl")
TASK_LIMITS = {"memory_mb": 1024, "disk_mb": 512}
_GIT = "git -c user.email=task@shoal -c user.name=shoal"


def load_suite(path: str | os.PathLike | None = None) -> list[SWETask]:
    p = Path(path) if path else SUITE_PATH
    if not p.exists():
        raise InvalidArgument(f"no task suite at {p}; generate one with `python -m shoal.tasks.swe.generate`")
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
    info = host.create(create_request(task.base_image, [task.base_commit], ttl=900, **TASK_LIMITS))
    try:
        host.write_file(info.id, "/tmp/bug.patch", task.bug_patch.encode())
        script = (f"cd {task.repo_dir} && git apply /tmp/bug.patch && rm -rf .git /tmp/bug.patch && git init -q && "
                  f"git add -A && {_GIT} commit -qm 'task state' && git gc -q --prune=now")
        r = host.exec(info.id, ExecRequest(argv=["/bin/sh", "-c", script], timeout=300))
        if r.exit_code != 0:
            raise BuildError(f"task {task.instance_id}: could not apply its bug patch: {(r.stdout + r.stderr)[-800:]}")
        layer = host.capture_layer(info.id, source=f"swe task {task.instance_id}", exclude=list(DEFAULT_EXCLUDE))
    finally:
        host.kill(info.id)
    host.store.create_image(task.image, [layer.digest], config={"role": "task", "workdir": task.repo_dir,
                                                               "built_on": task.base_commit})
    return task.image


def prepare_task(host: Host, task: SWETask) -> None:
    """Every image the task's sandboxes and its grader start from, built here if missing."""
    ensure_task_image(host, task)
    ensure_grader_image(host)


def prepare_suite(host: Host, tasks: list[SWETask],
                  on_step: Callable[[str, int, int], None] | None = None) -> None:
    """The operator's step before rollouts through shoald: the Python base, the workspaces the tasks
    use, then each task's layer and the grader layer, all in `host`'s store (cached: a no-op when
    done). on_step(what, i, n) reports progress over the n = workspaces + tasks steps."""
    from ...envs.debian import ensure_python_base
    from ...envs.workspaces import build_workspace

    specs = [s for s in CATALOG if any(t.repo == s.name and t.version == s.version for t in tasks)]
    n, i = len(specs) + len(tasks), 0
    if on_step:
        on_step("python base", 0, n)
    ensure_python_base(host)
    for spec in specs:
        if on_step:
            on_step(f"workspace {spec.image}", i, n)
        build_workspace(host, spec)
        i += 1
    for task in tasks:
        if on_step:
            on_step(f"task {task.instance_id}", i, n)
        task.prepare(host)
        i += 1


def _open(backend: SandboxBackend, task: SWETask, layers: list[str], **kw) -> Sandbox:
    try:
        return open_sandbox(backend, task.base_image, layers, **{**TASK_LIMITS, **kw})
    except ImageNotFound as e:
        raise ImageNotFound(f"task {task.instance_id}: {e}; the operator prepares a suite's images on the "
                            f"sandbox host once, as root: `shoal tasks prepare`") from None


def task_sandbox(backend: SandboxBackend, task: SWETask, **kw) -> Sandbox:
    if isinstance(backend, Host):  # in-process: build what is missing, on first use
        ensure_task_image(backend, task)
    return _open(backend, task, [task.base_commit, task.image], **kw)


def grader_sandbox(backend: SandboxBackend, task: SWETask, **kw) -> Sandbox:
    """A fresh sandbox of the task with the trusted grader layer on top (never the agent's)."""
    grader = GRADER_IMAGE
    if isinstance(backend, Host):
        ensure_task_image(backend, task)
        grader = ensure_grader_image(backend)
    return _open(backend, task, [task.base_commit, task.image, grader], **kw)


# flipped tests re-run one by one per evaluation: None = every one (a secret random sample beyond a cap)
CONFIRM_MAX: int | None = None
RECORD_MAX = 16 << 20


@dataclass
class Change:
    """One path a patch changed, as git (not our parser) saw it after applying it."""
    path: str
    status: str  # git's: A added, D deleted, M modified, T type changed (e.g. file -> symlink)
    old_mode: str
    new_mode: str
    binary: bool = False


@dataclass
class Applied:
    ok: bool
    err: str = ""
    changes: list[Change] = field(default_factory=list)  # after protected paths were restored
    restored: list[str] = field(default_factory=list)  # protected paths put back as in HEAD
    malformed: str = ""  # why git's view could not be trusted


# restored / deleted after `git apply`: the protected paths, and compiled files (pytest's assertion
# rewriter loads a cached test module from __pycache__ when its header matches the source)
_PROTECTED_RX = re.compile(PROTECTED_PATTERN + r"|(^|/)__pycache__/|\.py[cod]$")
_GITP = ["git", "-c", "core.quotepath=off", "--literal-pathspecs"]


def _git(sb: Sandbox, task: SWETask, *args: str, stdin: bytes | None = None):
    return sb.commands.run([*_GITP, *args], cwd=task.repo_dir, stdin=stdin, timeout=60)


def _numstat(out: str) -> tuple[list[str], set[str]]:
    """(paths, binary paths) from `git apply --numstat -z` (a rename or copy gives both names)."""
    paths: list[str] = []
    binary: set[str] = set()
    fields = out.split("\0")
    i = 0
    while i < len(fields):
        if not fields[i]:
            i += 1
            continue
        added, _, name = fields[i].split("\t", 2)
        names = [name] if name else fields[i + 1:i + 3]
        i += 1 if name else 3
        paths += names
        if added == "-":
            binary.update(names)
    return paths, binary


def _raw(out: str) -> list[Change]:
    """`git diff --raw -z --no-renames` as Changes."""
    fields, out_ = out.split("\0"), []
    for meta, path in zip(fields[::2], fields[1::2]):
        if meta.startswith(":"):
            old_mode, new_mode, _, _, status = meta[1:].split()[:5]
            out_.append(Change(path, status[0], old_mode, new_mode))
    return out_


def _nul(paths: list[str]) -> bytes:
    return b"".join(p.encode() + b"\0" for p in paths)


def _apply(sb: Sandbox, task: SWETask, patch_text: str) -> Applied:
    """`git apply` the patch, then ask git which paths changed (its own parse of the patch, and the
    index against HEAD, ignored files included), and put every protected path back as it is in
    HEAD: test files, conftest.py and pytest configuration are the task's, whatever the patch
    said (SWE-bench's "test patch applied last"). Nothing of the repository runs here."""
    if not patch_text:
        return Applied(True)
    sb.files.write("/tmp/model.patch", patch_text)
    r = _git(sb, task, "apply", "--numstat", "-z", "/tmp/model.patch")
    if r.exit_code != 0:
        return Applied(False, r.stderr)
    touched, binary = _numstat(r.stdout)
    r = _git(sb, task, "apply", "--whitespace=nowarn", "/tmp/model.patch")
    if r.exit_code != 0:
        return Applied(False, r.stderr)
    if any("\ufffd" in p for p in touched):
        return Applied(True, malformed="a path that is not UTF-8")
    # stage everything git sees changed, and the patch's paths even where .gitignore hides them
    for args, stdin in ((["add", "-A"], None),
                        (["add", "-A", "-f", "--pathspec-from-file=-", "--pathspec-file-nul"], _nul(touched))):
        if touched or stdin is None:
            r = _git(sb, task, *args, stdin=stdin)
            if r.exit_code != 0:
                return Applied(True, malformed=f"git add failed: {r.stderr.strip()[:200]}")
    changes = _raw(_git(sb, task, "diff", "--cached", "--raw", "-z", "--no-renames", "HEAD").stdout)
    prot = [c for c in changes if _PROTECTED_RX.search(c.path)]
    back = [c.path for c in prot if c.old_mode != "000000"]
    new = [c.path for c in prot if c.old_mode == "000000"]
    if back:
        _git(sb, task, "restore", "--source=HEAD", "--staged", "--worktree", "--pathspec-from-file=-",
             "--pathspec-file-nul", stdin=_nul(back))
    if new:
        _git(sb, task, "rm", "-q", "-r", "-f", "--pathspec-from-file=-", "--pathspec-file-nul", stdin=_nul(new))
    # what is left must be exactly the unprotected changes, in the index and in the work tree
    after = _raw(_git(sb, task, "diff", "--cached", "--raw", "-z", "--no-renames", "HEAD").stdout)
    after += _raw(_git(sb, task, "diff", "--raw", "-z", "--no-renames").stdout)
    still = sorted({c.path for c in after if _PROTECTED_RX.search(c.path)})
    if new:
        r = sb.commands.run(["sh", "-c", 'for p; do [ -e "$p" ] || [ -L "$p" ] && echo "$p"; done; true', "-", *new],
                            cwd=task.repo_dir, timeout=30)
        still += [p for p in r.stdout.splitlines() if p]
    if still:
        return Applied(True, malformed=f"a protected path could not be restored: {still[0]}")
    for c in changes:
        c.binary = c.path in binary
    return Applied(True, changes=[c for c in changes if not _PROTECTED_RX.search(c.path)],
                   restored=sorted(c.path for c in prot))


def _sources(sb: Sandbox, task: SWETask, path: str) -> tuple[str | None, str | None]:
    """(original, patched) text of a file; read after `git apply`, before any code of the repo runs."""
    r = sb.commands.run(["git", "show", f"HEAD:{path}"], cwd=task.repo_dir, timeout=30)
    before = r.stdout if r.exit_code == 0 else ""
    try:
        after = sb.files.read(f"{task.repo_dir}/{path}")
    except (ShoalError, OSError):  # deleted by the patch, or not a regular file
        after = None
    return before, after


def _read_record(sb: Sandbox, path: str) -> str:
    try:
        return sb.files.read_bytes(path, max_bytes=RECORD_MAX).decode("utf-8", "replace")
    except (ShoalError, OSError):  # removed, replaced or too big: an unusable record
        return ""


def _run_trusted(sb: Sandbox, task: SWETask, cfg: RunConfig, timeout: float, script: str = RUN):
    r = sb.commands.run(script, cwd=task.repo_dir, stdin=cfg.stdin(), timeout=timeout)
    return r, verify_record(_read_record(sb, cfg.record), cfg.key)


_gold: dict[tuple[str, str, str], dict[str, str]] = {}
_gold_locks: dict[tuple[str, str, str], threading.Lock] = {}
_gold_lock = threading.Lock()


def gold_statuses(backend: SandboxBackend, task: SWETask, timeout: float = 60) -> dict[str, str]:
    """Log id -> status of each FAIL_TO_PASS / PASS_TO_PASS test in a trusted run of the task's
    gold patch: the reference an XFAIL or SKIPPED status is held to (grading.f2p_passed,
    p2p_maintained). Computed once per backend address and task in this process, when first needed."""
    key = (backend.address, task.instance_id, hashlib.sha256(task.patch.encode()).hexdigest())
    with _gold_lock:
        lock = _gold_locks.setdefault(key, threading.Lock())
    with lock:
        if key not in _gold:
            with grader_sandbox(backend, task, ttl=timeout + 120) as sb:
                ap = _apply(sb, task, task.patch)
                if not ap.ok or ap.malformed:
                    return {}
                _, record = _run_trusted(sb, task, pytest_config(task.repo_dir, task.test_cmd, PROTECTED_PATTERN),
                                         timeout)
            if record.problem or record.tampered or record.end is None:
                return {}  # not cached: the next grading tries again; meanwhile only PASSED counts
            wanted = set(task.FAIL_TO_PASS) | set(task.PASS_TO_PASS)
            _gold[key] = {t: st for t, st in record_statuses(record)[0].items() if t in wanted}
        return _gold[key]


def _malformed(task: SWETask, why: str, dropped: list[str]) -> Report:
    rep = grade("", task.FAIL_TO_PASS, task.PASS_TO_PASS)
    rep.dropped_files = dropped
    return rep.reject(f"malformed-patch: {why}", f"the patch cannot be read unambiguously: {why}")


def _suspect(task: SWETask, flags, dropped: list[str]) -> Report:
    rep = grade("", task.FAIL_TO_PASS, task.PASS_TO_PASS)
    rep.flags, rep.dropped_files = [str(f) for f in flags], dropped
    return rep.reject(f"tamper-suspect: {flags[0].rule}", f"static screen: {flags[0]}")


def evaluate(backend: SandboxBackend, task: SWETask, patch: str | None, timeout: float = 60, *, screen: bool = True,
             confirm: bool = True, confirm_max: int | None = CONFIRM_MAX) -> tuple[Report, str]:
    """Grade a patch in a fresh sandbox of the task (the agent's sandbox may have been tampered
    with), with the trusted runner; returns (report, test log).

    Layers, in order: malformed headers rejected; the patch filter (tests and test configuration
    dropped), then, after `git apply`, every protected path git says changed restored from HEAD;
    the static screen (over git's list of changed paths and the files read from the sandbox
    before anything runs); the trusted runner
    (`python3 -I -S`, pytest from the grader layer) whose HMAC-chained record gives the statuses,
    cross-checked against the log; then each FAIL_TO_PASS test that flipped is re-run on its own,
    in its own process, in another fresh sandbox (under unittest for TestCase tests), and must pass
    there too.
    `screen=False` / `confirm=False` switch a layer off (to measure the others)."""
    if not patch or not patch.strip():
        patch_text, dropped = "", list[str]()
    else:
        if why := malformed_patch(patch):
            return _malformed(task, why, []), ""
        patch_text, dropped = filter_patch(patch)
    if screen and patch_text and (flags := screen_patch(patch_text, content=False)):
        return _suspect(task, flags, dropped), ""
    # a TTL: if the grading process dies (a worker killed mid-grade), the sandbox does not outlive it
    with grader_sandbox(backend, task, ttl=timeout + 120) as sb:
        ap = _apply(sb, task, patch_text)
        dropped = sorted(set(dropped) | set(ap.restored))
        if not ap.ok:
            rep = grade_run("", RunRecord(), task.FAIL_TO_PASS, task.PASS_TO_PASS, patch_applied=False)
            rep.dropped_files = dropped
            return rep, ap.err
        if ap.malformed:
            return _malformed(task, ap.malformed, dropped), ""
        # the screen reads what git says changed, and the files themselves, before anything runs
        if screen and (flags := screen_changes(ap.changes, lambda p: _sources(sb, task, p))):
            return _suspect(task, flags, dropped), ""
        changed = [c.path for c in ap.changes]
        cfg = pytest_config(task.repo_dir, task.test_cmd, PROTECTED_PATTERN)
        r, record = _run_trusted(sb, task, cfg, timeout, trusted_eval_script(START, END, EXIT))
        log = r.stdout + r.stderr
    # an XFAIL or SKIPPED status counts only where the gold patch's run has it too
    status = record_statuses(record)[0]
    expected = gold_statuses(backend, task, timeout) if any(
        status.get(t) in ("XFAIL", "SKIPPED") for t in task.FAIL_TO_PASS + task.PASS_TO_PASS) else {}
    rep = grade_run(log, record, task.FAIL_TO_PASS, task.PASS_TO_PASS, patch_exists=bool(patch_text),
                    changed=changed, repo_dir=task.repo_dir, timed_out=r.timed_out, expected=expected)
    rep.dropped_files = dropped
    if confirm and rep.status != "RESOLVED_NO" and not rep.reason:
        _confirm(backend, task, patch_text, record, rep, confirm_max, expected)
    return rep, log


def _confirm(backend: SandboxBackend, task: SWETask, patch_text: str, record: RunRecord, rep: Report,
             confirm_max: int | None, expected: dict[str, str], timeout: float = 60) -> None:
    """Independent confirmation: every FAIL_TO_PASS test that flipped to pass runs again alone, in a
    separate process per test, in one fresh sandbox with the patch applied again: under the stdlib
    unittest runner when it is a TestCase test, else the trusted pytest runner on that one test id.
    With a cap (`confirm_max`), the sample is drawn with the grader's secret randomness, so a patch
    cannot know which tests will be re-run."""
    status, _, raw = record_statuses(record)
    flipped = [t for t in task.FAIL_TO_PASS if f2p_passed(status.get(t), expected.get(t))]
    chosen = flipped if confirm_max is None or len(flipped) <= confirm_max else \
        secrets.SystemRandom().sample(flipped, confirm_max)
    failed: list[tuple[str, str]] = []
    runners = {"pytest": 0, "unittest": 0}
    if chosen:
        with grader_sandbox(backend, task, ttl=timeout * len(chosen) + 120) as sb:
            ap = _apply(sb, task, patch_text)
            if not ap.ok or ap.malformed:
                failed = [(t, "patch did not apply" if not ap.ok else str(ap.malformed)) for t in chosen]
            else:
                for t in chosen:
                    nodeid = raw[t]
                    mode = "unittest" if nodeid in record.unittest else "pytest"
                    runners[mode] += 1
                    cfg = RunConfig(repo=task.repo_dir, protected=PROTECTED_PATTERN, mode=mode, nodeid=nodeid,
                                    args=["-q", nodeid])
                    _, rec = _run_trusted(sb, task, cfg, timeout)  # a new process, a new key and record
                    st = rec.status.get(nodeid)
                    why = rec.problem or "; ".join(rec.tampered[:2]) or \
                        ("" if rec.end and rec.exit else "the run did not finish") or \
                        ("" if f2p_passed(st, (gold_statuses(backend, task) if st == "XFAIL" else {}).get(t))
                         else f"status {st or 'missing'}")
                    if why:
                        failed.append((t, why))
    rep.confirmation = {"flipped": len(flipped), "checked": len(chosen), "confirmed": len(chosen) - len(failed),
                        "runners": runners, "failed": [f"{t}: {w}" for t, w in failed]}
    if failed:
        rep.reject("unconfirmed", f"{len(failed)} of {len(chosen)} flipped tests did not pass when re-run alone: "
                                  f"{failed[0][0]}: {failed[0][1]}")


def validate(host: Host, task: SWETask, unpatched_runs: int = 1, gold: Report | None = None) -> dict:
    """A task is valid when every FAIL_TO_PASS test fails in the unpatched state (in each of
    `unpatched_runs` runs: flaky tasks are caught) and the gold patch resolves it. `gold`: the
    gold patch's report when the caller already has it."""
    befores = [evaluate(host, task, None)[0] for _ in range(unpatched_runs)]
    before = max(befores, key=lambda r: r.f2p_passed)
    after, log = (gold, "") if gold is not None else evaluate(host, task, task.patch)
    ok = not before.resolved and before.f2p_passed == 0 and after.resolved
    return {"instance_id": task.instance_id, "valid": ok, "unpatched": before.status, "gold": after.status,
            "gold_invalid": after.invalid, "gold_reason": after.reason, "log_tail": "" if ok else log[-1500:]}


def summary(tasks: list[SWETask]) -> dict:
    by_repo: dict[str, int] = {}
    by_type: dict[str, int] = {}
    for t in tasks:
        by_repo[t.repo] = by_repo.get(t.repo, 0) + 1
        by_type[t.labels.bug_type] = by_type.get(t.labels.bug_type, 0) + 1
    return {"tasks": len(tasks), "repos": len(by_repo), "by_repo": by_repo, "by_bug_type": by_type}


