"""The trusted grading runner, host side: its layer, how a run is started, how its record is checked.

The grader layer (`GRADER_IMAGE`, a toolkit image built on `python:3.11`) holds
/opt/shoal-grader/run.py (runner/run.py: the bootstrap and the pytest plugin) and its own copy of
pytest and pluggy (site/) and of pytest's other dependencies (deps/: iniconfig, packaging, which
the tests must import from the project when the project is one of them), byte-compiled, read-only.
Grading sandboxes compose it on top of
the task layers; the agent's sandbox never has it.

A run gets a fresh random key and record path on stdin. The record is a file of JSON lines,
each followed by HMAC-SHA256(key, previous MAC || line); `verify_record` checks the chain, the
sequence numbers and that the run reached its `end` line.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import shlex
import threading
from dataclasses import dataclass, field
from pathlib import Path

from ...envs.builder import Builder
from ...envs.debian import PYTHON_IMAGE
from ...envs.recipe import parse_recipe
from ...host import Host

HERE = Path(__file__).parent
GRADER_IMAGE = "shoal/swe-grader:1"
GRADER_DIR = "/opt/shoal-grader"
RUN = f"/usr/bin/python3 -I -S -B {GRADER_DIR}/run.py"
RECORD_MAGIC = b"shoal-record-v1"
GRADER_RECIPE = f"""
FROM {PYTHON_IMAGE}
LABEL shoal.role=toolkit
COPY runner/run.py {GRADER_DIR}/run.py
RUN --network=none set -e; mkdir -p {GRADER_DIR}/site {GRADER_DIR}/deps; \
    cd /usr/local/lib/python3.11/dist-packages; \
    cp -a pytest _pytest pluggy py.py pytest-*.dist-info pluggy-*.dist-info {GRADER_DIR}/site/; \
    cp -a iniconfig packaging iniconfig-*.dist-info packaging-*.dist-info {GRADER_DIR}/deps/; \
    find {GRADER_DIR} -name __pycache__ -prune -exec rm -rf {{}} +; \
    python3 -I -m compileall -q {GRADER_DIR}; \
    python3 -I -S -c "import sys; sys.path[:0] = ['{GRADER_DIR}/site', '{GRADER_DIR}/deps']; import pytest; \
assert pytest.__file__.startswith('{GRADER_DIR}/'), pytest.__file__"; \
    chmod -R a-w {GRADER_DIR}
"""

_ready: dict[str, str] = {}
_lock = threading.Lock()


def ensure_grader_image(host: Host) -> str:
    """Build (once per host; cached by the builder) the grader layer; returns its image ref."""
    src = hashlib.sha256((HERE / "runner" / "run.py").read_bytes() + GRADER_RECIPE.encode()).hexdigest()
    key = f"{host.settings.root}:{src}"
    with _lock:
        if key not in _ready:
            recipe = parse_recipe(GRADER_RECIPE, HERE, name="swe grader")
            _ready[key] = Builder(host).build(recipe, GRADER_IMAGE).image.ref
        return _ready[key]


@dataclass
class RunConfig:
    """One trusted run: what to run and the secrets of its record (never shown to the sandbox's
    other processes: it travels on the runner's stdin only)."""
    repo: str
    protected: str
    mode: str = "pytest"  # pytest | unittest
    args: list[str] = field(default_factory=list)
    nodeid: str = ""
    key: str = field(default_factory=lambda: secrets.token_hex(32))
    record: str = field(default_factory=lambda: f"/tmp/.shoal-record-{secrets.token_hex(8)}")

    def stdin(self) -> bytes:
        return json.dumps({"repo": self.repo, "protected": self.protected, "mode": self.mode, "args": self.args,
                           "nodeid": self.nodeid, "key": self.key, "record": self.record}).encode()


def pytest_config(repo_dir: str, test_cmd: str, protected: str) -> RunConfig:
    return RunConfig(repo=repo_dir, protected=protected, args=["-rA", "-q", *shlex.split(test_cmd)])


@dataclass
class RunRecord:
    """What a verified record says. `problem` is set when the record cannot be believed."""
    problem: str = ""
    status: dict[str, str] = field(default_factory=dict)
    unittest: set[str] = field(default_factory=set)
    config: dict = field(default_factory=dict)
    conftests: list[str] = field(default_factory=list)
    end: dict | None = None
    exit: dict | None = None
    lines: int = 0
    audit: list[str] = field(default_factory=list)  # what the runner's audit hook refused, as it happened
    phases: dict[str, str | None] = field(default_factory=dict)  # nodeid -> status from its phase lines so far

    @property
    def tampered(self) -> list[str]:
        found = [*self.audit, *(self.end or {}).get("tampered", []), *(self.exit or {}).get("tampered", [])]
        return sorted(set(found), key=found.index)

    @property
    def exit_code(self) -> int | None:
        return (self.end or {}).get("exitstatus")


def verify_record(text: str, key: str) -> RunRecord:
    """Check the HMAC chain line by line; a record that breaks it anywhere is not used at all."""
    rec = RunRecord()
    k = bytes.fromhex(key)
    prev = RECORD_MAGIC
    if not text:
        rec.problem = "no record: the runner never started or its record was removed"
        return rec
    for n, raw in enumerate(text.split("\n"), 1):
        if not raw:
            if n != len(text.split("\n")):
                rec.problem = f"record line {n} is empty"
            break
        line, _, mac_hex = raw.rpartition("\t")
        want = hmac.new(k, prev + line.encode(), "sha256").digest()
        if not hmac.compare_digest(want.hex(), mac_hex):
            rec.problem = f"record line {n} fails its MAC: written by something other than the grader's runner"
            return rec
        prev = want
        try:
            d = json.loads(line)
        except ValueError:
            rec.problem = f"record line {n} is not JSON"
            return rec
        if d.get("seq") != n:
            rec.problem = f"record line {n} is out of sequence"
            return rec
        rec.lines = n
        kind = d.get("kind")
        if rec.exit is not None or (rec.end is not None and kind not in ("exit", "tamper")):
            rec.problem = f"record line {n} ({kind}) comes after the run's end"
            return rec
        if kind == "phase":
            rec.phases[d["nodeid"]] = phase_status(d, rec.phases.get(d["nodeid"]))
        elif kind == "test":
            derived = rec.phases.get(d["nodeid"])
            if derived is not None and derived != d["status"]:
                rec.problem = (f"record line {n} says {d['nodeid']} {d['status']}, its phases say {derived}: "
                               "the runner's state was changed")
                return rec
            rec.status[d["nodeid"]] = d["status"]
            if d.get("unittest"):
                rec.unittest.add(d["nodeid"])
        elif kind == "config":
            rec.config = d
        elif kind == "conftest":
            rec.conftests.append(d["path"])
        elif kind == "end":
            rec.end = d
        elif kind == "exit":
            rec.exit = d
        elif kind == "tamper":
            rec.audit.append(str(d.get("what", "")))
    return rec


def phase_status(d: dict, prev: str | None) -> str | None:
    """The status pytest -rA shows, from one setup / call / teardown phase line (run.py's
    `_status`, computed here from the phases as they were written)."""
    when, outcome, xfail = d.get("when"), d.get("outcome"), bool(d.get("xfail"))
    if when == "setup":
        if outcome == "failed":
            return "ERROR"
        if outcome == "skipped":
            return "XFAIL" if xfail else "SKIPPED"
        return prev
    if when == "call":
        if outcome == "passed":
            return "XPASS" if xfail else "PASSED"
        if outcome == "failed":
            return "FAILED"
        return "XFAIL" if xfail else "SKIPPED"
    return "ERROR" if outcome == "failed" else prev


def trusted_eval_script(start: str, end: str, exit_marker: str) -> str:
    """The eval script around the trusted runner: the same markers as SWE-bench's, so the log can
    be cross-checked against the record."""
    return f"echo '{start}'; {RUN}; echo \"{exit_marker} $?\"; echo '{end}'"
