"""Desktop tasks through rollout's agent loop on real desktop sandboxes: a worker killed mid-step
resumes the episode from the trajectory log (screenshots as blobs) without re-running a completed
step; a vision policy over the scripted OpenAI-compatible server (which checks every PNG it gets);
click accuracy from the accessibility tree at click time and typing errors; judge agreement end
to end over synthetic labels."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import time

import httpx
import pytest

from shoal.core.errors import LLMUnavailable
from shoal.rollout.episode import run_episode
from shoal.rollout.policy import make_policy
from shoal.rollout.runner import Rollout
from shoal.rollout.scripted_server import spawn
from shoal.tasks.desktop import agreement
from shoal.tasks.desktop.policies import ScriptedDesktopPolicy, oracle_steps
from shoal.tasks.desktop.runner import DesktopTools, load_desktop_tasks, score_record
from shoal.tasks.desktop.task import open_task_sandbox
from shoal.trajlog import LoggedSandbox, TrajectoryLog
from shoal.trajlog.blobs import blobs_for

pytestmark = pytest.mark.slow


def _task(tid="editor-append-and-save"):
    return next(t for t in load_desktop_tasks() if t.id == tid)


@pytest.fixture(scope="module")
def server():
    proc, url = spawn()
    yield url
    proc.kill()
    proc.wait()


def _entries(db, stream):
    try:
        with sqlite3.connect(db) as c:
            return c.execute("SELECT seq, kind, status, request, writer FROM entries WHERE stream=? ORDER BY seq",
                             (stream,)).fetchall()
    except sqlite3.OperationalError:
        return []


def test_worker_killed_mid_step_resumes_from_the_log(tmp_path, root, desktop_images):
    task = _task()
    ro = Rollout(tmp_path / "rollout.db")
    # a 6 s wait after the first save: the worker is killed while that step is in flight
    spec = {"kind": "oracle", "name": "oracle+pause", "detours": {"4": [{"action": "wait", "seconds": 6}]}}
    (eid,) = ro.submit([task], spec)
    extra = ["--kind", "desktop", "--lease", "2"]
    w1 = ro.start_workers(1, url="local", root=root, extra=extra, log_dir=tmp_path)[0]
    stream = f"{eid}/sandbox"
    deadline = time.time() + 120
    while time.time() < deadline:
        es = _entries(ro.log_path, stream) if ro.log_path.exists() else []
        if any(k == "desktop_step" and st == "PENDING" and '"wait"' in rq for _, k, st, rq, _ in es):
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the worker never got to the wait: {(tmp_path / 'worker-0.log').read_text()[-3000:]}")
    os.kill(w1.pid, signal.SIGKILL)
    w1.wait()
    ro.start_workers(1, url="local", root=root, extra=extra, log_dir=tmp_path)
    counts = ro.wait(progress=False, timeout=180)
    assert counts["done"] == 1 and counts["failed"] == 0, (tmp_path / "worker-1.log").read_text()[-3000:]
    (rec,) = ro.records()
    rep = rec["report"]
    assert rec["extra"]["attempt"] == 2 and rep["complete"] and rep["fraction"] == 1.0
    assert rep["unknown"] == 1  # the wait in flight at the kill: never re-run, the agent is told
    assert rec["replayed"]["sandbox"] >= 8 and rec["replayed"]["llm"] >= 5  # fast-forwarded, not redone
    es = _entries(ro.log_path, stream)
    steps = [e for e in es if e[1] == "desktop_step"]
    assert [e[2] for e in steps].count("UNKNOWN") == 1 and len(steps) == len(task.task.oracle) + 1
    assert len({e[4] for e in es}) == 2  # two writers: the killed worker's entries were not written again
    typed = [e for e in steps if "buy milk" in e[3]]
    assert len(typed) == 1  # the text typed before the kill was typed once
    # every step's screenshot is a blob beside the log, named by digest in the record
    answer = json.loads(rec["patch"])
    blobs = blobs_for(TrajectoryLog(ro.log_path))
    pngs = [blobs.get(r["shot"]) for r in answer["records"]]
    assert len(pngs) == answer["steps"] and all(p[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)


def test_vision_policy_over_the_scripted_server(tmp_path, host, desktop_images, server):
    task = _task()
    log = TrajectoryLog(tmp_path / "traj.db")
    before = httpx.get(f"{server}/admin/stats").json().get("desktop_pngs", 0)
    pol = make_policy({"kind": "vision", "url": server, "model": "desktop-oracle:detour"}, task)
    rec = asyncio.run(run_episode(task, pol, log, host, "vis-1", max_steps=60))
    rep = rec.report
    assert rep["complete"] and rep["steps"] == 3 * len(task.task.oracle)
    assert rep["drift"]["longest"] >= 2  # the detours advance nothing
    # every model call carried a real PNG (the server checks signature, CRCs and image data size)
    pngs = httpx.get(f"{server}/admin/stats").json()["desktop_pngs"] - before
    assert pngs == pol.attempts == rep["steps"] + 1  # each step, plus the closing DONE
    # the logged requests name screenshots by digest; the bytes are not in the log
    llm = log.history("vis-1/llm")
    assert all("base64" not in json.dumps(e.request) for e in llm)
    assert any("shoal-blob:sha256:" in json.dumps(e.request) for e in llm)


def test_click_accuracy_and_typing_errors_in_a_real_desktop(tmp_path, host, desktop_images):
    task = _task()
    log = TrajectoryLog(tmp_path / "traj.db")
    sb = open_task_sandbox(host, task.task)
    try:
        tools = DesktopTools(task.task, LoggedSandbox(sb, log.stream("c/sandbox")), blobs_for(log))
        tools.run("computer", {"action": task.task.oracle[0]})  # mousepad on notes.txt
        tree = sb.desktop.accessibility_tree(depth=30, max_nodes=5000).model_dump()

        def find(node, role, name):
            if node["role"] == role and node["name"] == name and node["bounds"]:
                return node["bounds"]
            return next((b for ch in node["children"] if (b := find(ch, role, name))), None)

        bx, by, bw, bh = find(tree, "menu", "File")
        target = {"role": "menu", "name": "File"}
        tools.run("computer", {"code": f"pyautogui.click({bx + bw // 2}, {by + bh // 2})", "target": target})
        tools.run("computer", {"code": "pyautogui.press('escape')"})
        # the File menu's centre moved by 400 px: a miss, 400 - bw/2 px from the menu's bounds
        tools.run("computer", {"code": f"pyautogui.click({bx + bw // 2 + 400}, {by + bh // 2}) "
                                       f"# target: menu \"File\""})
        tools.run("computer", {"code": "pyautogui.hotkey('ctrl', 'end')"})
        tools.run("computer", {"action": {"action": "type", "text": "cal mom\n"}, "intended": "call mom\n"})
        rep = score_record(task.task, tools.record())
    finally:
        sb.kill()
    clicks = [r["click"] for r in tools.record()["records"] if r["click"]]
    assert clicks[0]["hit"] and clicks[0]["under"]["name"] == "File"
    assert not clicks[1]["hit"] and clicks[1]["target_found"]
    assert clicks[1]["distance"] == pytest.approx(400 - (bw - 1 - bw // 2), abs=1)
    assert rep["clicks"] == {"clicks": 2, "hits": 1, "accuracy": 0.5, "target_missing": 0}
    assert rep["typing"] == {"steps": 1, "steps_with_errors": 1, "edits": 1, "chars": 9, "rate": 1 / 9}


def test_judge_agreement_end_to_end(tmp_path, host, desktop_images, server):
    plans = [agreement.Plan("editor-append-and-save", "typo-cut", detours={1: agreement.DETOUR[:2]},
                            typos={5: "cal mom\n"}, cut=2)]
    judges = {"programmatic": agreement.programmatic,
              "chat": agreement.chat_judge(server, "desktop-judge")}
    res = agreement.run(host, tmp_path / "traj.db", plans, judges, n_boot=200)
    (ep,) = res["episodes"]
    # labels by construction: open, typed, saved advance; the typo spoils 'second', so 'quit' cannot follow
    assert ep["labels"] == [True, True, True, False, False]
    assert ep["judges"]["programmatic"] == ep["labels"]
    assert ep["runner"]["typing"]["edits"] == 1
    prog = res["agreement"]["programmatic"]
    assert prog["one_minus_mae"] == 100.0 and prog["kappa"] == 1.0 and prog["one_minus_mae_ci"] == (100.0, 100.0)
    chat = res["agreement"]["chat"]
    assert chat["subgoals"] == 5 and 0 <= chat["subgoal_agreement"] <= 1


class _FailsOnce(ScriptedDesktopPolicy):
    """The oracle, whose model goes away before step 4 the first time (the episode stops there)."""

    def __init__(self, steps):
        super().__init__(steps, name="oracle")
        self.fail = True

    def act(self, step, messages):
        if step == 4 and self.fail:
            raise LLMUnavailable("gone for the test")
        return super().act(step, messages)


def test_lost_sandbox_gets_the_logged_steps_again(tmp_path, host, desktop_images):
    task = _task()
    log = TrajectoryLog(tmp_path / "traj.db")
    pol = _FailsOnce(oracle_steps(task.task))
    with pytest.raises(LLMUnavailable):
        asyncio.run(run_episode(task, pol, log, host, "lost-1", keep_sandbox=True))
    first = log.info("lost-1/sandbox").meta["sandbox"]
    host.kill(first)  # the sandbox is lost (as with its host): the episode goes on in a new one
    pol.fail = False
    rec = asyncio.run(run_episode(task, pol, log, host, "lost-1"))
    assert rec.sandbox != first and rec.replayed["sandbox"] >= 4 * 3
    # 'second' and 'quit' need the editor open on notes.txt with 'buy milk' typed: the four logged
    # steps were re-applied to the new sandbox before the episode went on
    assert rec.report["complete"], rec.report["subgoals"]
