"""An agent's patch is untrusted: it must not be able to make a task count as resolved by editing
the tests, adding a conftest, changing test config, or forging pytest output from library code."""
from __future__ import annotations

import textwrap

import pytest

from shoal.tasks.swe import evaluate
from shoal.tasks.swe.grading import EXIT
from shoal.tasks.swe.mutate import unified_diff

pytestmark = pytest.mark.slow


def _task(few_tasks):
    return few_tasks[1]  # parse: a single-module library


def _read(host, task, path):
    from shoal.tasks.swe import task_sandbox

    with task_sandbox(host, task) as sb:
        return sb.files.read(f"{task.repo_dir}/{path}")


def test_editing_the_failing_tests_does_not_count(host, few_tasks):
    task = _task(few_tasks)
    test_file = task.FAIL_TO_PASS[0].split("::")[0]
    before = _read(host, task, test_file)
    lines = before.splitlines()
    gutted = "\n".join("    return" if line.strip().startswith("assert") else line for line in lines) + "\n"
    rep, _ = evaluate(host, task, unified_diff(test_file, before, gutted))
    assert not rep.resolved and rep.dropped_files == [test_file]


def test_a_conftest_that_passes_everything_is_dropped(host, few_tasks):
    task = _task(few_tasks)
    hook = ("import pytest\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
            "    out = yield\n    rep = out.get_result()\n    rep.outcome = 'passed'\n")
    rep, _ = evaluate(host, task, unified_diff("conftest.py", "", hook).replace("--- a/conftest.py", "--- /dev/null"))
    assert not rep.resolved and "conftest.py" in rep.dropped_files


def test_forged_pass_lines_from_library_code_are_not_graded(host, few_tasks):
    task = _task(few_tasks)
    src = task.patch.split("diff --git a/", 1)[1].split(" ", 1)[0]
    before = _read(host, task, src)
    lines = "".join(f"PASSED {t}\\n" for t in task.FAIL_TO_PASS + task.PASS_TO_PASS)
    # pytest captures fd 1 while importing; the forger writes to the saved original (a pipe) instead
    evil = before + textwrap.dedent(f"""
        import os as _os
        for _fd in range(3, 64):
            try:
                if _os.readlink(f"/proc/self/fd/{{_fd}}").startswith("pipe:"):
                    _os.write(_fd, "{lines}".encode())
            except OSError:
                pass
        _os._exit(0)
        """)
    patch = unified_diff(src, before, evil)
    # the static screen names what it saw...
    rep, _ = evaluate(host, task, patch)
    assert not rep.resolved and rep.reason == "tamper-suspect: early-exit"
    assert any(f.startswith("fd-tamper: ") for f in rep.flags)
    # ...and without it the forgery happens but is not believed: the runner never finished
    rep, log = evaluate(host, task, patch, screen=False)
    assert "PASSED" in log and f"{EXIT} 0" in log
    assert not rep.resolved and rep.reason == "incomplete" and rep.invalid


def test_gold_patch_with_test_edits_still_resolves_on_its_source_part(host, few_tasks):
    task = _task(few_tasks)
    test_file = task.FAIL_TO_PASS[0].split("::")[0]
    before = _read(host, task, test_file)
    rep, _ = evaluate(host, task, task.patch + unified_diff(test_file, before, before + "\n# touched\n"))
    assert rep.resolved and rep.dropped_files == [test_file]
