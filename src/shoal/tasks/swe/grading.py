"""SWE-bench grading: the eval script, per-test status from the pytest log, resolved / partial.

Rules (SWE-bench `harness/grading.py`): PASSED and XFAIL count as a pass; a FAIL_TO_PASS test that
is missing, FAILED, ERROR or SKIPPED counts as failed; resolved iff every F2P and every P2P test
passes. Like SWE-bench v5, the log is sliced between start/end markers, the pytest exit code is
recorded and cross-checked (a patch that prints fake PASSED lines is not graded as resolved), and
an empty status map without evidence that the suite ran is invalid.

The agent's patch is untrusted: changes to test files and test configuration are dropped before it
is applied (SWE-bench gets the same effect by applying its test_patch last).

`grade` reads a log alone (SWE-bench's way). `grade_run` is what Shoal's grader uses: per-test
statuses come from the trusted runner's HMAC-chained record (trusted.py), and the log is only a
cross-check. It is stricter than SWE-bench: an XFAIL or SKIPPED status counts only where the gold
patch's run gave the same status (`f2p_passed`, `p2p_maintained`).
A Report's `reason` says why a run was not believed, in a machine-readable form:
`patch-not-applied`, `tamper-suspect: <rule>`, `tampered`, `forged-output`, `incomplete`, `timeout`,
`unconfirmed`, `no-tests-ran`, `malformed-patch: <what>` (see docs/swe.md).
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

START, END, EXIT = ">>>>> Start Test Output", ">>>>> End Test Output", ">>>>> Test Exit Code:"
PASS_STATES = ("PASSED", "XFAIL")
_LINE = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED)\s+(\S+::.+?)(?:\s+-\s+(.*))?$")
_COUNT = re.compile(r"(\d+) (passed|failed|errors?)\b")
_SUITE_RAN = re.compile(r"^(?:=+ )?(?:.*\b\d+ (?:passed|failed|errors?|skipped|xfailed|xpassed|deselected)\b.*|"
                        r"no tests ran.*) in [\d.]+s", re.MULTILINE)
# files an agent's patch may not touch: tests and what configures them
_PROTECTED = re.compile(r"(^|/)(tests?|testing)/|(^|/)test_[^/]*\.py$|_test\.py$|(^|/)conftest\.py$|"
                        r"(^|/)(\.?pytest\.ini|\.?pytest\.toml|tox\.ini|setup\.cfg|pyproject\.toml)$")
PROTECTED_PATTERN = _PROTECTED.pattern


def eval_script(repo_dir: str, test_cmd: str) -> str:
    """The in-sandbox eval script: run the tests between markers and record pytest's exit code."""
    return (f"cd {repo_dir} && echo '{START}' && "
            f"python3 -m pytest -rA -q -p no:cacheprovider -o addopts= {test_cmd}; "
            f"echo \"{EXIT} $?\"; echo '{END}'")


def summary_counts(log: str) -> dict[str, int] | None:
    """pytest's final "N passed, M failed ... in Xs" line as counts, or None if there is none."""
    lines = [m.group(0) for m in _SUITE_RAN.finditer(log)]
    if not lines:
        return None
    counts = {"passed": 0, "failed": 0, "error": 0}
    for n, what in _COUNT.findall(lines[-1]):
        counts["error" if what.startswith("error") else what] += int(n)
    return counts


def parse_log(log: str) -> tuple[dict[str, str], int | None, bool]:
    """(test id -> status, pytest exit code, whether the suite visibly ran) from the sliced log."""
    m = re.search(re.escape(EXIT) + r"\s*(-?\d+)", log.split(START, 1)[-1])
    exit_code = int(m.group(1)) if m else None
    log = _slice(log)
    status: dict[str, str] = {}
    for line in log.splitlines():
        lm = _LINE.match(line.strip())
        if lm:
            status[lm.group(2)] = lm.group(1)
    return status, exit_code, bool(_SUITE_RAN.search(log))


def _slice(log: str) -> str:
    """The part of the log between the start marker and the exit-code line (or end marker)."""
    if START in log:
        log = log.split(START, 1)[1]
    m = re.search(re.escape(EXIT), log)
    if m:
        log = log[: m.start()]
    return log.split(END, 1)[0]


def failure_messages(log: str) -> dict[str, str]:
    """test id -> the one-line reason pytest -rA gives for FAILED / ERROR tests."""
    out = {}
    for line in log.splitlines():
        lm = _LINE.match(line.strip())
        if lm and lm.group(1) in ("FAILED", "ERROR") and lm.group(3):
            out[lm.group(2)] = lm.group(3)
    return out


@dataclass
class Report:
    resolved: bool
    status: str  # RESOLVED_FULL | RESOLVED_PARTIAL | RESOLVED_NO
    f2p_passed: int
    f2p_total: int
    p2p_passed: int
    p2p_total: int
    exit_code: int | None
    patch_exists: bool = True
    patch_applied: bool = True
    invalid: str = ""  # why the log could not be graded, if it could not
    dropped_files: list[str] = field(default_factory=list)  # protected files the patch tried to change
    tests_status: dict[str, list[str]] = field(default_factory=dict)
    reason: str = ""  # machine-readable: "" or tampered, tamper-suspect: <rule>, forged-output, ...
    flags: list[str] = field(default_factory=list)  # static screen findings, "<rule>: <path>: <detail>"
    tampered: list[str] = field(default_factory=list)  # what the trusted runner found changed
    confirmation: dict = field(default_factory=dict)  # the independent re-run of the flipped tests

    def reject(self, reason: str, invalid: str) -> Report:
        """Not resolved, for a reason that makes the run untrustworthy."""
        self.resolved, self.status, self.reason, self.invalid = False, "RESOLVED_NO", reason, invalid
        return self

    @property
    def f2p_rate(self) -> float:
        return self.f2p_passed / self.f2p_total if self.f2p_total else 1.0

    @property
    def p2p_rate(self) -> float:
        return self.p2p_passed / self.p2p_total if self.p2p_total else 1.0

    def to_dict(self) -> dict:
        return {**asdict(self), "f2p_rate": self.f2p_rate, "p2p_rate": self.p2p_rate}


def grade(log: str, fail_to_pass: list[str], pass_to_pass: list[str], *, patch_applied: bool = True,
          patch_exists: bool = True) -> Report:
    status, exit_code, ran = parse_log(log)
    f2p_ok = [t for t in fail_to_pass if status.get(t) in PASS_STATES]
    # a P2P test that is SKIPPED still counts as maintained (SWE-bench)
    p2p_ok = [t for t in pass_to_pass if status.get(t) in PASS_STATES + ("SKIPPED",)]
    invalid = ""
    if not patch_applied:
        invalid = "patch did not apply"
    elif not status and not ran:
        invalid = "no test status and no evidence the suite ran"
    elif exit_code is None:
        invalid = "no pytest exit code in the log"
    elif exit_code == 0 and any(s in ("FAILED", "ERROR") for s in status.values()):
        invalid = "pytest exited 0 but the log lists failures: forged output"
    elif exit_code != 0 and status and all(s in PASS_STATES + ("SKIPPED", "XPASS") for s in status.values()):
        invalid = f"pytest exited {exit_code} but the log lists only passes: forged or broken output"
    else:
        counts = summary_counts(_slice(log))
        listed = {k: sum(1 for s in status.values() if s == k.upper()) for k in ("passed", "failed", "error")}
        if counts is None:
            invalid = "no pytest summary line: the suite did not finish"
        elif counts != listed:
            invalid = f"pytest's summary {counts} does not match the listed results {listed}: forged output"
    full_f2p = len(f2p_ok) == len(fail_to_pass)
    full_p2p = len(p2p_ok) == len(pass_to_pass)
    if invalid:
        verdict = "RESOLVED_NO"
    elif full_f2p and full_p2p:
        verdict = "RESOLVED_FULL"
    elif f2p_ok and full_p2p:
        verdict = "RESOLVED_PARTIAL"
    else:
        verdict = "RESOLVED_NO"
    return Report(resolved=verdict == "RESOLVED_FULL", status=verdict, f2p_passed=len(f2p_ok),
                  f2p_total=len(fail_to_pass), p2p_passed=len(p2p_ok), p2p_total=len(pass_to_pass),
                  exit_code=exit_code, patch_exists=patch_exists, patch_applied=patch_applied, invalid=invalid,
                  tests_status={"FAIL_TO_PASS_failed": [t for t in fail_to_pass if t not in f2p_ok],
                                "PASS_TO_PASS_failed": [t for t in pass_to_pass if t not in p2p_ok]})


def log_id(nodeid: str) -> str:
    """A test id as `parse_log` reads it back from a -rA line (ids with a newline or " - " in a
    parameter are cut there; the suite's F2P / P2P lists hold them cut the same way)."""
    m = _LINE.match(f"PASSED {nodeid.splitlines()[0] if nodeid else nodeid}".strip())
    return m.group(2) if m else nodeid


_WORST = {"pass": 0, "skip": 1, "fail": 2}


def record_statuses(record) -> tuple[dict[str, str], set[str], dict[str, str]]:
    """(log id -> status, log ids that several tests share, log id -> a real node id) from a record.
    Where tests share a log id the worst status counts."""
    out: dict[str, str] = {}
    shared: set[str] = set()
    raw: dict[str, str] = {}
    for nodeid, st in record.status.items():
        k = log_id(nodeid)
        if k in out:
            shared.add(k)
            if _WORST[_category(st)] <= _WORST[_category(out[k])]:
                continue
        out[k] = st
        raw.setdefault(k, nodeid)
    return out, shared, raw


def _category(status: str | None) -> str:
    return "pass" if status in PASS_STATES else "skip" if status == "SKIPPED" else "fail"


def f2p_passed(status: str | None, expected: str | None) -> bool:
    """A FAIL_TO_PASS test passes when it PASSED; XFAIL counts only where the gold patch's run
    gave XFAIL too (code under test can call pytest.xfail(): red team B1/B2)."""
    return status == "PASSED" or (status == "XFAIL" and expected == "XFAIL")


def p2p_maintained(status: str | None, expected: str | None) -> bool:
    """A PASS_TO_PASS test is maintained when it PASSED, or kept the very status it had in the gold
    patch's run (XFAIL or SKIPPED there). Unlike SWE-bench, which ignores a SKIPPED P2P test, a test
    that passed with the gold patch and is skipped or xfailed now is not maintained: the patch's
    code can skip or xfail the tests it breaks."""
    return status == "PASSED" or (status is not None and status == expected and status in PASS_STATES + ("SKIPPED",))


def grade_run(log: str, record, fail_to_pass: list[str], pass_to_pass: list[str], *, patch_applied: bool = True,
              patch_exists: bool = True, changed: tuple[str, ...] | list[str] = (), repo_dir: str = "/work/repo",
              timed_out: bool = False, expected: dict[str, str] | None = None) -> Report:
    """Grade a trusted run: statuses from the verified `record` (trusted.RunRecord), the log as a
    cross-check. `changed`: the repository paths the patch changed (config files among them that
    pytest read mean the configuration was injected). `expected`: log id -> status in the gold
    patch's run (without it only PASSED counts)."""
    if not patch_applied:
        return grade("", fail_to_pass, pass_to_pass, patch_applied=False).reject("patch-not-applied",
                                                                                   "patch did not apply")
    log_rep = grade(log, fail_to_pass, pass_to_pass, patch_exists=patch_exists)
    status, shared, _ = record_statuses(record)
    expected = expected or {}
    f2p_ok = [t for t in fail_to_pass if f2p_passed(status.get(t), expected.get(t))]
    p2p_ok = [t for t in pass_to_pass if p2p_maintained(status.get(t), expected.get(t))]
    full_f2p, full_p2p = len(f2p_ok) == len(fail_to_pass), len(p2p_ok) == len(pass_to_pass)
    verdict = ("RESOLVED_FULL" if full_f2p and full_p2p else "RESOLVED_PARTIAL" if f2p_ok and full_p2p
               else "RESOLVED_NO")
    rep = Report(resolved=verdict == "RESOLVED_FULL", status=verdict, f2p_passed=len(f2p_ok),
                 f2p_total=len(fail_to_pass), p2p_passed=len(p2p_ok), p2p_total=len(pass_to_pass),
                 exit_code=record.exit_code, patch_exists=patch_exists, patch_applied=True,
                 tests_status={"FAIL_TO_PASS_failed": [t for t in fail_to_pass if t not in f2p_ok],
                               "PASS_TO_PASS_failed": [t for t in pass_to_pass if t not in p2p_ok]})
    injected = sorted({p for p in [(record.config or {}).get("inipath"), *record.conftests]
                       if p and p.startswith(repo_dir.rstrip("/") + "/") and p[len(repo_dir) + 1:] in set(changed)})
    log_status, log_exit, _ = parse_log(log)
    disagree = [t for t in fail_to_pass + pass_to_pass
                if t not in shared and _category(status.get(t)) != _category(log_status.get(t))]
    if record.problem:
        return rep.reject("tampered", record.problem)
    if record.tampered:
        rep.tampered = list(record.tampered)
        return rep.reject("tampered", "the runner found its machinery changed: " + "; ".join(record.tampered[:5]))
    if injected:
        rep.tampered = [f"pytest read configuration the patch wrote: {p}" for p in injected]
        return rep.reject("tampered", rep.tampered[0])
    if record.end is None or record.exit is None:  # the runner writes `exit` after its last checks
        if timed_out:
            return rep.reject("timeout", "the test run timed out")
        return rep.reject("incomplete", "the run ended before pytest finished its session (exit, crash or kill)")
    if log_rep.invalid:
        return rep.reject("forged-output", log_rep.invalid)
    if log_exit != record.exit_code:
        return rep.reject("forged-output", f"the log says pytest exited {log_exit}, the runner saw {record.exit_code}")
    if disagree:
        t = disagree[0]
        return rep.reject("forged-output", f"the log and the runner's record disagree on {len(disagree)} test(s), "
                                           f"e.g. {t}: log {log_status.get(t)}, record {status.get(t)}")
    if not status and fail_to_pass:
        return rep.reject("no-tests-ran", "the runner recorded no test")
    return rep


_HUNK = re.compile(r"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")
# characters str.splitlines() (and so a naive parser) breaks lines at but git does not
_BAD_CHARS = re.compile("[\r\v\f\x1c\x1d\x1e\x85\u2028\u2029\x00]")
_PATH_HEADERS = ("diff --git ", "--- ", "+++ ", "rename from ", "rename to ", "copy from ", "copy to ")


def _lines(patch: str) -> list[tuple[str, bool]]:
    """(line with its newline, whether it is a header line: outside every hunk body), split at
    "\n" only and counting hunk lines the way `git apply` does."""
    out: list[tuple[str, bool]] = []
    old = new = 0
    for line in patch.split("\n"):
        line += "\n"
        if old > 0 or new > 0:
            out.append((line, False))
            c = line[0] if line != "\n" else " "
            if c == " ":
                old, new = old - 1, new - 1
            elif c == "-":
                old -= 1
            elif c == "+":
                new -= 1
            elif c != "\\":
                old = new = 0  # not a hunk line: the hunk ended early (git would reject the patch)
                out[-1] = (line, True)
            continue
        m = _HUNK.match(line)
        if m:
            old, new = int(m.group(1) or 1), int(m.group(2) or 1)
        out.append((line, not (line.startswith("\\") and out and not out[-1][1])))
    if out:
        out[-1] = (out[-1][0][:-1], out[-1][1])
        if not out[-1][0]:
            out.pop()
    return out


def malformed_patch(patch: str) -> str:
    """Why a patch's header lines are not what git and this parser agree on ("" if they are): a
    quoted (C-escaped) path, or a character a line parser could split at but git does not."""
    for line, header in _lines(patch):
        if not header or _HUNK.match(line):  # a hunk header's context is file text
            continue
        bad = _BAD_CHARS.search(line.rstrip("\n"))
        if bad:
            return f"control character {bad.group(0)!r} in a header line"
        if line.startswith(_PATH_HEADERS) and '"' in line:
            return "quoted path in a header line"
    return ""


def split_patch(patch: str) -> list[tuple[str, str]]:
    """A unified diff as [(path, section)] per file: a section starts at a `diff --git` header or at
    a `--- ` / `+++ ` pair that does not belong to the `diff --git` header before it. Lines are split
    at "\n" only and hunk bodies are skipped by their line counts, as `git apply` reads a patch.
    Not authoritative: the grader takes the paths a patch really touched from git (suite.py)."""
    lines = _lines(patch)
    starts: list[int] = []
    in_git_header = False
    for i, (line, header) in enumerate(lines):
        if not header:
            in_git_header = False
            continue
        if line.startswith("diff --git "):
            starts.append(i)
            in_git_header = True
        elif line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1][0].startswith("+++ "):
            if not in_git_header:
                starts.append(i)
            in_git_header = False  # the pair closes the git header: a second pair is a new section
    if not starts:
        return []
    sections = [[line for line, _ in lines[a:b]] for a, b in zip(starts, starts[1:] + [len(lines)])]
    return [s for s in (_section(sec) for sec in sections) if s[0]]


def _section(lines: list[str]) -> tuple[str, str]:
    path = ""
    for line in lines:
        if line.startswith(("+++ ", "--- ")):
            p = line[4:].rstrip("\n").split("\t")[0]
            if p != "/dev/null":
                path = p[2:] if p[:2] in ("a/", "b/") else p
                if line.startswith("+++ "):
                    break
        elif line.startswith("diff --git "):
            m = re.match(r"diff --git a/(\S+) b/(\S+)", line)
            if m:
                path = m.group(2)
        elif line.startswith("@@"):
            break
    return path, "".join(lines)


def filter_patch(patch: str) -> tuple[str, list[str]]:
    """Drop sections that touch tests or test configuration; returns (kept patch, dropped paths)."""
    kept: list[str] = []
    dropped: list[str] = []
    for path, text in split_patch(patch):
        (dropped if _PROTECTED.search(path) else kept).append(path if _PROTECTED.search(path) else text)
    return "".join(kept), dropped
