"""Rollout workers as separate processes: kill -9 of a worker mid-command and of the trainer lose no
episode and run no completed command twice; JSONL and Parquet output."""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time

import pytest

from shoal.rollout.runner import Rollout, resolve_table, write_jsonl, write_parquet
from shoal.tasks.swe import SUITE_PATH
from shoal.tasks.swe.suite import save_suite

pytestmark = pytest.mark.slow


@pytest.fixture
def suite_file(tmp_path, few_tasks):
    return save_suite(few_tasks, tmp_path / "suite.jsonl")


def _entries(db, stream):
    try:
        with sqlite3.connect(db) as c:
            return c.execute("SELECT seq, status, request, writer FROM entries WHERE stream=? ORDER BY seq",
                             (stream,)).fetchall()
    except sqlite3.OperationalError:  # the worker has created the file but not the schema yet
        return []


def test_worker_killed_mid_command_resumes_exactly_once(tmp_path, root, few_tasks, suite_file):
    task = few_tasks[0]
    ro = Rollout(tmp_path / "rollout.db")
    script = [["shell", {"command": "echo x >> /work/counter"}],
              ["shell", {"command": "sleep 5; echo slept >> /work/counter"}],
              ["create_file", {"path": "/tmp/fix.patch", "content": task.patch}],
              ["shell", {"command": "git apply /tmp/fix.patch"}],
              ["shell", {"command": "cat /work/counter"}]]
    (eid,) = ro.submit([task], {"kind": "script", "actions": script})
    w1 = ro.start_workers(1, url="local", root=root, suite=suite_file, extra=["--lease", "2"], log_dir=tmp_path)[0]
    stream = f"{eid}/sandbox"
    deadline = time.time() + 60
    while time.time() < deadline:
        e = _entries(ro.log_path, stream) if ro.log_path.exists() else []
        if len(e) >= 2 and e[1][1] == "PENDING":
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the worker never got to the sleep: {(tmp_path / 'worker-0.log').read_text()[-2000:]}")
    os.kill(w1.pid, signal.SIGKILL)
    w1.wait()
    ro.start_workers(1, url="local", root=root, suite=suite_file, extra=["--lease", "2"], log_dir=tmp_path)
    counts = ro.wait(progress=False, timeout=120)
    assert counts["done"] == 1 and counts["failed"] == 0
    (rec,) = ro.records()
    assert rec["resolved"] and rec["unknown_ops"] == 1 and rec["extra"]["attempt"] == 2
    # the echo ran once, in the first worker; the new worker got its result from the log
    entries = _entries(ro.log_path, stream)
    assert entries[0][1] == "DONE" and entries[0][3] != entries[2][3]
    assert entries[1][1] == "UNKNOWN"  # in flight at the kill: never re-run blindly
    cat = next(a for a in rec["actions"] if a["arguments"] and "cat /work/counter" in a["arguments"])
    assert cat["observation"].split()[0] == "x" and cat["observation"].count("x\n") == 1
    assert rec["replayed"]["sandbox"] >= 1 and rec["replayed"]["llm"] >= 2


_TRAINER = textwrap.dedent("""
    import sys, time
    from shoal.tasks.swe import load_suite
    from shoal.rollout.runner import Rollout
    db, root, suite = sys.argv[1:4]
    tasks = load_suite(suite)
    ro = Rollout(db)
    ro.submit(tasks, {"kind": "oracle"})
    ro.submit(tasks, {"kind": "null"})
    ro.start_workers(2, url="local", root=root, suite=suite)
    print("started", flush=True)
    time.sleep(600)
""")


def test_trainer_killed_and_reconnected_finds_its_episodes(tmp_path, root, few_tasks, suite_file):
    db = tmp_path / "rollout.db"
    (tmp_path / "trainer.py").write_text(_TRAINER)
    trainer = subprocess.Popen([sys.executable, str(tmp_path / "trainer.py"), str(db), str(root), str(suite_file)],
                               stdout=subprocess.PIPE, text=True)
    assert trainer.stdout.readline().strip() == "started"
    trainer.kill()
    trainer.wait()
    ro = Rollout(db)  # a new trainer process would do just this
    counts = ro.wait(progress=False, timeout=180)
    assert counts["done"] == 2 * len(few_tasks) and counts["failed"] == 0
    recs = ro.records()
    table = {r["policy"]: r for r in resolve_table(recs)}
    assert table["oracle"]["resolve_rate"] == 1.0 and table["null"]["resolve_rate"] == 0.0
    j = write_jsonl(recs, tmp_path / "out/episodes.jsonl")
    assert [json.loads(x)["episode_id"] for x in j.read_text().splitlines()] == [r["episode_id"] for r in recs]
    import pyarrow.parquet as pq

    t = pq.read_table(write_parquet(recs, tmp_path / "out/episodes.parquet"))
    assert t.num_rows == len(recs) and {"reward", "messages", "response_token_ids", "bug_type"} <= set(t.column_names)
    assert sorted(t.column("reward").to_pylist()) == sorted(r["reward"] for r in recs)


def test_bundled_suite_path_is_packaged():
    assert SUITE_PATH.exists() and SUITE_PATH.name == "suite.jsonl"


_GRADER = textwrap.dedent("""
    import sys
    from shoal import Host
    from shoal.tasks.swe.suite import evaluate, load_suite
    root, suite = sys.argv[1:3]
    task = load_suite(suite)[0]
    print("grading", flush=True)
    evaluate(Host.get(root), task, task.patch)
""")


def test_grading_sandbox_of_a_killed_grader_has_a_ttl(tmp_path, root, host, few_tasks, suite_file):
    before = {i.id for i in host.backend().list()}
    (tmp_path / "grader.py").write_text(_GRADER)
    p = subprocess.Popen([sys.executable, str(tmp_path / "grader.py"), str(root), str(suite_file)],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "grading"
    deadline = time.time() + 60
    new = []
    while not new and time.time() < deadline:
        new = [i for i in host.backend().list() if i.id not in before]
        time.sleep(0.02)
    p.kill()
    p.wait()
    assert new, "the grader never created its sandbox"
    assert all(i.ttl is not None and i.ttl <= 900 for i in new), [(i.id, i.ttl) for i in new]  # bounded life
    for i in new:
        host.kill(i.id)
