"""What the sandbox can tell about an SWE task after a step, for the programmatic diagnoser.

The probe runs in the agent's own sandbox right after a step, so it sees exactly the state the
step left, and nothing later (hindsight-free). It goes around the trajectory log on purpose: it is
an observer, not part of the episode, so a resumed or branched episode is not changed by it. It
writes nothing the answer could pick up: pytest runs with `-p no:cacheprovider` and
`PYTHONDONTWRITEBYTECODE=1`, and git is only read (no `git add`).

Facts (JSON-able, stored in `StepView.facts`):
- `git_ok`, `changed` ({path: porcelain status}), `protected_changed`, `deleted`, `diff_sha`;
- `tests_ran` (whether the diff changed since the last probe, so the tests ran again),
  `f2p_failed` / `p2p_failed` (the task's FAIL_TO_PASS / PASS_TO_PASS tests not passing now);
- at the start only: `implicated`, the repository's non-test files named in the failing tests'
  tracebacks (where the failure points).
"""
from __future__ import annotations

import hashlib
import re
import shlex
from typing import Any

from ..sdk.sandbox import Sandbox
from ..tasks.swe.grading import PASS_STATES, PROTECTED_PATTERN, parse_log
from ..tasks.swe.task import SWETask

_PROTECTED = re.compile(PROTECTED_PATTERN)
_TB_FILE = re.compile(r"^([\w./-]+\.py):\d+: ", re.MULTILINE)
PROBE_TIMEOUT_S = 120.0
_ENV = {"PYTHONDONTWRITEBYTECODE": "1"}
_START: dict[tuple[str, str], dict[str, Any]] = {}


def protected(path: str) -> bool:
    """A test or test-configuration path (the grader drops the patch's changes to these)."""
    return bool(_PROTECTED.search(path.lstrip("./")))


class SWEProbe:
    def __init__(self, task: SWETask, timeout: float = PROBE_TIMEOUT_S):
        self.task, self.timeout = task, timeout
        self.runs = 0  # test runs made (each costs sandbox time)

    def _git(self, sb: Sandbox) -> dict[str, Any]:
        repo = shlex.quote(self.task.repo_dir)
        # the agent owns the repository: an fsmonitor hook could answer for git, and index flags
        # (skip-worktree, assume-unchanged) hide an edited file from status, so those files are listed
        # apart and counted as changed ("H")
        git = "git -c core.fsmonitor=false -c core.untrackedCache=false"
        script = (f"cd {repo} && {git} status --porcelain=v1 -uall && echo '@@HIDDEN' && "
                  f"{{ {git} ls-files -v | grep -E '^(S|[a-z]) ' || true; }} && echo '@@SHA' && "
                  f"{{ {git} diff HEAD --no-color; {git} ls-files -o --exclude-standard -z | xargs -0 -r sha256sum; "
                  f"{git} ls-files -v | sed -n 's/^[Sa-z] //p' | tr '\\n' '\\0' | xargs -0 -r sha256sum; "
                  "} | sha256sum")
        r = sb.commands.run(["bash", "-c", script], timeout=60, env=_ENV)
        if r.exit_code != 0 or "@@SHA" not in r.stdout or "@@HIDDEN" not in r.stdout:
            return {"git_ok": False, "changed": {}, "protected_changed": [], "deleted": [], "diff_sha": ""}
        status, _, rest = r.stdout.partition("@@HIDDEN")
        hidden, _, sha = rest.partition("@@SHA")
        changed: dict[str, str] = {}
        for line in status.splitlines():
            if len(line) > 3:
                path = line[3:].split(" -> ")[-1].strip('"')
                changed[path] = line[:2].strip() or "M"
        for line in hidden.splitlines():
            if len(line) > 2:
                changed.setdefault(line[2:].strip('"'), "H")
        return {"git_ok": True, "changed": changed, "protected_changed": sorted(p for p in changed if protected(p)),
                "deleted": sorted(p for p, s in changed.items() if "D" in s), "diff_sha": sha.split()[0] if sha else ""}

    def _tests(self, sb: Sandbox) -> tuple[dict[str, Any], str]:
        self.runs += 1
        cmd = (f"cd {shlex.quote(self.task.repo_dir)} && python3 -m pytest -rA -q -p no:cacheprovider -o addopts= "
               f"--tb=short {self.task.test_cmd}")
        r = sb.commands.run(["bash", "-c", cmd], timeout=self.timeout, env=_ENV)
        log = r.stdout + r.stderr
        status, _, ran = parse_log(log)
        f2p = [t for t in self.task.FAIL_TO_PASS if status.get(t) not in PASS_STATES]
        p2p = [t for t in self.task.PASS_TO_PASS if status.get(t) not in PASS_STATES + ("SKIPPED",)]
        return {"tests_ran": True, "suite_ran": ran and not r.timed_out, "f2p_failed": f2p, "p2p_failed": p2p,
                "p2p_total": len(self.task.PASS_TO_PASS)}, log

    def start(self, sb: Sandbox) -> dict[str, Any]:
        """Facts before step 1. Every sandbox of a task starts in the same state, so they are
        computed once per task and process."""
        key = (self.task.instance_id, hashlib.sha256(self.task.bug_patch.encode()).hexdigest())
        if key not in _START:
            _START[key] = self._start(sb)
        return dict(_START[key])

    def _start(self, sb: Sandbox) -> dict[str, Any]:
        facts = self._git(sb)
        tests, log = self._tests(sb)
        implicated: list[str] = []
        for p in _TB_FILE.findall(log):
            p = p.removeprefix(self.task.repo_dir.rstrip("/") + "/")
            if not protected(p) and not p.startswith(("/", "..")) and p not in implicated:
                implicated.append(p)
        return {**facts, **tests, "implicated": implicated}

    def after(self, sb: Sandbox, prev: dict[str, Any]) -> dict[str, Any]:
        """Facts after a step; the tests run again only if the repository changed since `prev`."""
        facts = self._git(sb)
        if facts["git_ok"] and facts["diff_sha"] == prev.get("diff_sha") and "f2p_failed" in prev:
            return {**facts, "tests_ran": False, "suite_ran": prev.get("suite_ran", False),
                    "f2p_failed": prev["f2p_failed"], "p2p_failed": prev["p2p_failed"],
                    "p2p_total": prev.get("p2p_total", 0)}
        tests, _ = self._tests(sb)
        return {**facts, **tests}
