"""The bundled task suite, checked against the real workspaces: every task is valid (unpatched: not
resolved; gold patch: resolved), the task state does not give the fix away, SWE-bench round trip."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from shoal.core.errors import InvalidArgument
from shoal.tasks.swe import BUG_TYPES, SWETask, load_suite, task_sandbox, validate

from .gold import gold_reports

pytestmark = pytest.mark.slow


def test_suite_shape():
    tasks = load_suite()
    assert len(tasks) >= 50 and len({t.repo for t in tasks}) >= 8
    assert len({t.instance_id for t in tasks}) == len(tasks)
    for t in tasks:
        assert t.FAIL_TO_PASS and not set(t.FAIL_TO_PASS) & set(t.PASS_TO_PASS)
        assert t.labels.bug_type in BUG_TYPES and t.labels.symbol and t.labels.component
        assert t.patch.startswith("diff --git") and t.bug_patch.startswith("diff --git")
        again = SWETask.from_swebench(t.to_swebench(), bug_patch=t.bug_patch, test_cmd=t.test_cmd,
                                      labels=t.labels.model_dump())
        assert again == t
        assert isinstance(json.loads(t.to_swebench()["FAIL_TO_PASS"]), list)


def test_bad_suite_file_names_the_line(tmp_path):
    p = tmp_path / "s.jsonl"
    p.write_text(load_suite()[0].model_dump_json() + "\n{\"instance_id\": 1}\n")
    with pytest.raises(InvalidArgument, match=r"s.jsonl:2"):
        load_suite(p)
    with pytest.raises(InvalidArgument, match="no task suite"):
        load_suite(tmp_path / "missing.jsonl")


def test_every_bundled_task_is_valid(host, swe_tasks):
    # gold patches through the full grader (screen, trusted runner, confirmation), once per session
    gold, _ = gold_reports(host, swe_tasks)
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda t: validate(host, t, gold=gold[t.instance_id]), swe_tasks))
    bad = [r for r in results if not r["valid"]]
    assert not bad, bad[:3]
    assert {r["unpatched"] for r in results} == {"RESOLVED_NO"}


def test_task_state_does_not_give_the_fix_away(host, swe_tasks):
    task = swe_tasks[0]
    with task_sandbox(host, task) as sb:
        r = sb.commands.run("git log --oneline | wc -l; git status --short | wc -l; git diff HEAD | wc -l",
                            cwd=task.repo_dir)
        assert r.stdout.split() == ["1", "0", "0"]
        # the buggy line is there and the gold patch would apply
        sb.files.write("/tmp/gold.patch", task.patch)
        assert sb.commands.run("git apply --check /tmp/gold.patch", cwd=task.repo_dir).exit_code == 0
