"""What an agent must never read from inside its task sandbox: the trajectory log, the episode
queue, the suite's gold patches and FAIL_TO_PASS lists, Shoal's own database and keys, and other
sandboxes' writable uppers. Each is tried by its host path and through every /proc/N/root."""
from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import pytest

import shoal.tasks.swe as swe_pkg
from shoal import Sandbox
from shoal.rollout.episode import run_episode
from shoal.rollout.policy import make_policy
from shoal.rollout.queue import open_queue
from shoal.tasks.swe.suite import TASK_LIMITS, ensure_task_image
from shoal.trajlog import TrajectoryLog

from .conftest import probe_results

pytestmark = pytest.mark.slow


def test_task_sandbox_cannot_read_logs_queue_answers_or_other_uppers(host, few_tasks, probe_layer, tmp_path, daemon):
    task = few_tasks[0]
    token = f"secret-{uuid.uuid4().hex}"  # in every secret below, so a leak anywhere can be searched for
    # a real episode: the log then holds the oracle's patch, i.e. the answer
    log = TrajectoryLog(tmp_path / "traj.db")
    out = asyncio.run(run_episode(task, make_policy({"kind": "oracle"}, task), log, host, token))
    assert out.resolved and out.patch.strip()
    queue = open_queue(tmp_path / "queue.db")
    queue.submit([task.instance_id], {"kind": "oracle", "tag": token})
    for db in ("queue.db", "traj.db"):  # sqlite in WAL mode: the token is in the db or its log
        assert any(token.encode() in p.read_bytes() for p in tmp_path.glob(f"{db}*") if p.is_file()), db
    suite = Path(swe_pkg.__file__).parent / "suite.jsonl"
    assert task.FAIL_TO_PASS[0] in suite.read_text() and json.dumps(task.patch)[1:40] in suite.read_text()
    settings = host.settings
    ensure_task_image(host, task)
    with Sandbox.create(task.base_image, layers=[task.base_commit, task.image], root=settings.root,
                        **TASK_LIMITS) as other:
        other.files.write("/tmp/other-upper-secret", f"not yours {token}")
        other_upper = host.backend("container").upper_dir(other.id) / "tmp" / "other-upper-secret"
        assert other_upper.read_text() == f"not yours {token}"  # the path is right: the host can read it
        targets = [*tmp_path.glob("traj.db*"), *tmp_path.glob("queue.db*"), suite, settings.db_path, other_upper,
                   settings.sandboxes_dir / other.id / "meta.json", settings.root / "admin.key"]
        assert (settings.root / "admin.key").is_file()  # shoald (the daemon fixture) wrote it
        targets = [str(t) for t in targets if Path(t).is_file()]
        assert len(targets) >= 7
        with Sandbox.create(task.base_image, layers=[task.base_commit, task.image, probe_layer], root=settings.root,
                            **TASK_LIMITS) as sb:
            sb.files.write("/tmp/own", "mine")
            res = probe_results(sb, "read", "/tmp/own", *targets, timeout=60)
            assert res["read:/tmp/own"] == "OK"  # control: the probe does read what it may
            tried = {k: v for k, v in res.items() if k.startswith("read:") and not k.endswith("/tmp/own")}
            for t in targets:
                assert res[f"read:{t}"] in ("ENOENT", "EACCES"), (t, res[f"read:{t}"])
            leaked = {k: v for k, v in tried.items() if v == "OK"}
            assert not leaked, leaked
            assert sum(1 for k in tried if k.startswith("read:/proc/")) >= len(targets)  # via /proc/N/root too
            # nor is any of it anywhere else in the sandbox (a leak at another path than the host's)
            search = ("find / \\( -path /proc -o -path /sys -o -path /dev \\) -prune -o -type f -size -64M -print0 "
                      "| xargs -0 grep -lF -- \"$1\" 2>/dev/null; echo searched")
            r = sb.commands.run(["sh", "-c", search, "sh", token], timeout=300)
            assert r.stdout == "searched\n", r.stdout
