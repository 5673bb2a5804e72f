"""Task generator: inject bugs into the real workspaces and keep those that break a passing test.

For each workspace: run its quick test subset once (the baseline), enumerate mutation sites in the
package's source (functions the tests mention first), and try candidates in one sandbox: write the
mutated file, run the tests, restore the file. A candidate becomes a task when at least one test
that passed at baseline now fails (FAIL_TO_PASS) and the suite still runs (not everything fails).
Each task is then validated from its own layers (unpatched: not resolved; gold patch: resolved).

    python -m shoal.tasks.swe.generate --per-repo 6 --out src/shoal/tasks/swe/suite.jsonl
"""
from __future__ import annotations

import hashlib
import json
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from ...envs.debian import PYTHON_IMAGE
from ...envs.sandboxes import open_sandbox
from ...envs.workspaces import CATALOG, WorkspaceSpec
from ...host import Host
from ...sdk.sandbox import Sandbox
from .grading import PASS_STATES, eval_script, failure_messages, parse_log
from .mutate import Mutation, mutations, unified_diff
from .suite import TASK_LIMITS
from .task import Labels, SWETask

_NOT_SOURCE = re.compile(r"(^|/)(tests?|testing|docs?|examples?|benchmarks?)/|(^|/)(test_[^/]*|[^/]*_test|conftest|"
                         r"setup|__main__|_version|version)\.py$|(^|/)_?(compat|_winconsole|_termui_impl)\.py$")


# a pytest plugin that records which repo lines the passing suite executes (sys.settrace; the
# sandbox's Python 3.11 has no sys.monitoring), so mutations go where a test can notice them
_COVERAGE_PLUGIN = """
import json, os, sys, threading
_hits = set()
def _trace(frame, event, arg):
    path = frame.f_code.co_filename
    if not path.startswith("/work/repo/"):
        return None
    _hits.add((path[len("/work/repo/"):], frame.f_lineno))
    return _trace
def pytest_configure(config):
    sys.settrace(_trace)
    threading.settrace(_trace)
def pytest_unconfigure(config):
    sys.settrace(None)
    with open(os.environ["SHOAL_COVERAGE_OUT"], "w") as f:
        json.dump(sorted(_hits), f)
"""
FULL_SUITE_MAX_S = 3.0  # a workspace whose whole suite takes longer uses its quick subset for tasks


@dataclass
class RepoBaseline:
    spec: WorkspaceSpec
    test_cmd: str
    passing: list[str]
    seconds: float  # how long the baseline run took: candidates get a few times that, then count as hangs
    sources: dict[str, str]  # path -> text
    covered: set[tuple[str, int]]  # (path, line) the passing tests execute


def _run(sb: Sandbox, test_cmd: str, timeout: float) -> tuple[dict[str, str], int | None, float, bool]:
    t0 = time.perf_counter()
    r = sb.commands.run(eval_script("/work/repo", test_cmd), timeout=timeout)
    status, code, _ = parse_log(r.stdout)
    return status, code, time.perf_counter() - t0, r.timed_out


def baseline(sb: Sandbox, spec: WorkspaceSpec) -> RepoBaseline:
    test_cmd = spec.tests
    status, code, seconds, timed_out = _run(sb, test_cmd, FULL_SUITE_MAX_S * 3)
    if timed_out or seconds > FULL_SUITE_MAX_S or code != 0:
        test_cmd = spec.quick
        status, code, seconds, _ = _run(sb, test_cmd, 600)
    again, code2, _, _ = _run(sb, test_cmd, 600)  # only tests that pass twice count (no flaky P2P)
    code = code or code2
    passing = sorted(t for t, s in status.items() if s in PASS_STATES and again.get(t) in PASS_STATES)
    if code != 0 or not passing:
        raise RuntimeError(f"{spec.name}: baseline tests do not pass (exit {code})")
    sb.files.write("/tmp/shoal_cov/shoal_cov.py", _COVERAGE_PLUGIN)
    r = sb.commands.run("cd /work/repo && python3 -m pytest -q -p no:cacheprovider -o addopts= -p shoal_cov "
                        f"{test_cmd} > /dev/null", env={"PYTHONPATH": "/tmp/shoal_cov",
                                                         "SHOAL_COVERAGE_OUT": "/tmp/shoal_cov/hits.json"},
                        timeout=1200)
    if r.exit_code != 0 or not sb.files.exists("/tmp/shoal_cov/hits.json"):
        raise RuntimeError(f"{spec.name}: the coverage run failed (exit {r.exit_code}): {r.stderr[-800:]}")
    covered = {(p, n) for p, n in json.loads(sb.files.read("/tmp/shoal_cov/hits.json"))}
    files = sb.commands.run("cd /work/repo && git ls-files '*.py'").stdout.split()
    sources = {f: sb.files.read(f"/work/repo/{f}") for f in files if not _NOT_SOURCE.search(f)}
    return RepoBaseline(spec, test_cmd, passing, seconds, sources, covered)


def candidates(base: RepoBaseline, rng: random.Random) -> list[Mutation]:
    """Mutation sites on lines the tests execute, shuffled, bug types interleaved so a repo's tasks
    are not all one kind."""
    by_type: dict[str, list[Mutation]] = {}
    for path, text in sorted(base.sources.items()):
        for m in mutations(path, text):
            if (path, m.line) in base.covered:
                by_type.setdefault(m.bug_type, []).append(m)
    for ms in by_type.values():
        rng.shuffle(ms)
    mixed: list[Mutation] = []
    while any(by_type.values()):
        for k in sorted(by_type):
            if by_type[k]:
                mixed.append(by_type[k].pop())
    return mixed


def _module(path: str) -> str:
    p = path[4:] if path.startswith("src/") else path
    return p[:-3].replace("/", ".").removesuffix(".__init__")


def problem_statement(spec: WorkspaceSpec, f2p: list[str], messages: dict[str, str]) -> str:
    shown = f2p[:5]
    lines = [f"After a recent change to {spec.name}, {len(f2p)} test(s) that used to pass now fail:", ""]
    lines += [f"- `{t}`" + (f": {messages[t][:200]}" if t in messages else "") for t in shown]
    if len(f2p) > len(shown):
        lines.append(f"- ... and {len(f2p) - len(shown)} more")
    lines += ["", "Find the bug in the library code and fix it. Do not edit the tests: all tests that passed "
                  "before the change must still pass."]
    return "\n".join(lines)


def try_mutation(sb: Sandbox, base: RepoBaseline, m: Mutation, max_f2p_fraction: float = 0.5) -> SWETask | None:
    before = base.sources[m.path]
    after = m.apply(before)
    path = f"/work/repo/{m.path}"
    sb.files.write(path, after)
    runs = []
    try:
        for _ in range(3):  # a test whose outcome flips between runs under the bug is in neither F2P nor P2P
            r = sb.commands.run(eval_script("/work/repo", base.test_cmd), timeout=max(10.0, 5 * base.seconds))
            status, code, ran = parse_log(r.stdout)
            if r.timed_out or not ran or code in (None, 0):
                return None
            runs.append((status, r))
            if not any(status.get(t) not in PASS_STATES for t in base.passing):
                return None
    finally:
        sb.files.write(path, before)
    f2p = [t for t in base.passing if all(st.get(t) not in PASS_STATES for st, _ in runs)]
    if not f2p or len(f2p) > max_f2p_fraction * len(base.passing):
        return None
    p2p = [t for t in base.passing if all(st.get(t) in PASS_STATES for st, _ in runs)]
    r = runs[0][1]
    digest = hashlib.sha256(f"{base.spec.name}:{m.key}:{m.new}".encode()).hexdigest()[:8]
    return SWETask(
        instance_id=f"{base.spec.name}__{m.bug_type}-{digest}", repo=base.spec.name, version=base.spec.version,
        base_commit=base.spec.image, base_image=PYTHON_IMAGE,
        problem_statement=problem_statement(base.spec, f2p, failure_messages(r.stdout)),
        patch=unified_diff(m.path, after, before), bug_patch=unified_diff(m.path, before, after),
        FAIL_TO_PASS=f2p, PASS_TO_PASS=p2p, test_cmd=base.test_cmd,
        labels=Labels(bug_type=m.bug_type, component=_module(m.path), symbol=m.symbol))


def generate_repo(host: Host, spec: WorkspaceSpec, n: int, seed: int = 0, max_tries: int = 60,
                  on_try: Callable[[str, bool], None] | None = None) -> list[SWETask]:
    rng = random.Random(f"{seed}:{spec.name}")
    tasks: list[SWETask] = []
    seen_symbols: set[str] = set()
    with open_sandbox(host, PYTHON_IMAGE, [spec.image], **TASK_LIMITS) as sb:
        base = baseline(sb, spec)
        tries = 0
        for m in candidates(base, rng):
            if len(tasks) >= n or tries >= max_tries:
                break
            if m.symbol in seen_symbols:  # one task per function: variety over volume
                continue
            tries += 1
            task = try_mutation(sb, base, m)
            if on_try:
                on_try(spec.name, task is not None)
            if task is not None:
                tasks.append(task)
                seen_symbols.add(m.symbol)
    return tasks


def main() -> None:
    import argparse

    from rich.progress import Progress

    from ...envs.debian import ensure_python_base
    from ...envs.workspaces import build_workspace
    from .suite import SUITE_PATH, save_suite, summary, validate

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-repo", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repos", default="", help="comma-separated workspace names (default: the whole catalog)")
    ap.add_argument("--out", default=str(SUITE_PATH))
    ap.add_argument("--root", default=None, help="Shoal state root (default: $SHOAL_ROOT or the configured one)")
    a = ap.parse_args()
    host = Host.get(a.root)
    ensure_python_base(host)
    specs = [s for s in CATALOG if not a.repos or s.name in a.repos.split(",")]
    tasks: list[SWETask] = []
    with Progress() as bar:
        job = bar.add_task("generating", total=len(specs) * a.per_repo)
        for spec in specs:
            build_workspace(host, spec)
            got = generate_repo(host, spec, a.per_repo, a.seed,
                                on_try=lambda name, ok: bar.update(job, advance=1 if ok else 0,
                                                                   description=f"generating {name}"))
            tasks += got
        vjob = bar.add_task("validating", total=len(tasks))
        valid = []
        for t in tasks:
            v = validate(host, t, unpatched_runs=2)
            if v["valid"]:
                valid.append(t)
            else:
                bar.console.print(f"[red]dropped {t.instance_id}: {v}")
            bar.update(vjob, advance=1)
    path = save_suite(valid, a.out)
    print(json.dumps({**summary(valid), "written": str(path)}, indent=2))


if __name__ == "__main__":
    main()
