"""The HTTP policy path against a real OpenAI-compatible server (scripted answers): token ids and
logprobs kept, LLM calls logged and fast-forwarded, outages retried, then the episode paused."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from shoal.core.errors import LLMUnavailable
from shoal.rollout import scripted_server
from shoal.rollout.episode import run_episode
from shoal.rollout.policy import ChatEndpointPolicy, make_policy
from shoal.rollout.runner import Rollout
from shoal.tasks.swe.suite import save_suite
from shoal.trajlog import TrajectoryLog

pytestmark = pytest.mark.slow


@pytest.fixture
def server(tmp_path, few_tasks):
    suite = save_suite(few_tasks, tmp_path / "suite.jsonl")
    proc, url = scripted_server.spawn("--suite", str(suite))
    yield url, suite
    proc.terminate()
    proc.wait()


def _stats(url):
    return httpx.get(f"{url}/admin/stats").json()


def test_endpoint_policy_resolves_and_keeps_tokens(server, host, few_tasks, tmp_path):
    url, _ = server
    log = TrajectoryLog(tmp_path / "traj.db")
    task = few_tasks[0]
    pol = ChatEndpointPolicy(url, "oracle", backoff_s=0.05)
    rec = asyncio.run(run_episode(task, pol, log, host, "http-1", keep_sandbox=True))
    assert rec.resolved and rec.policy == "chat:oracle" and rec.executed["llm"] == 3
    assert all(t["token_ids"] and len(t["logprobs"]) == len(t["token_ids"]) for t in rec.turns)
    assert [e.kind for e in log.history("http-1/llm")] == ["llm"] * 3
    before = _stats(url)["requests"]
    # a resumed episode fast-forwards through the model: no request reaches the server
    again = asyncio.run(run_episode(task, ChatEndpointPolicy(url, "oracle"), log, host, "http-1"))
    assert _stats(url)["requests"] == before and again.executed["llm"] == 0 and again.turns == rec.turns


def test_short_outage_is_retried(server, host, few_tasks, tmp_path):
    url, _ = server
    httpx.post(f"{url}/admin/outage", json={"seconds": 0.6})
    pol = ChatEndpointPolicy(url, "null", retries=6, backoff_s=0.1, max_backoff_s=0.4)
    rec = asyncio.run(run_episode(few_tasks[0], pol, TrajectoryLog(tmp_path / "t.db"), host, "retry"))
    assert rec.steps == 1 and pol.attempts > 1 and _stats(url)["failed"] >= 1


def test_long_outage_pauses_the_episode_then_it_resumes(server, root, few_tasks, tmp_path):
    url, suite = server
    pol = ChatEndpointPolicy(url, "null", retries=1, backoff_s=0.05)
    httpx.post(f"{url}/admin/outage", json={"seconds": 3600})
    with pytest.raises(LLMUnavailable, match="failed 2 times"):
        asyncio.run(pol.complete(pol.request([{"role": "user", "content": "x"}])))
    ro = Rollout(tmp_path / "rollout.db")
    ro.submit(few_tasks[:2], {"kind": "chat", "url": url, "model": "oracle", "retries": 1, "backoff_s": 0.05})
    ro.start_workers(1, url="local", root=root, suite=suite, log_dir=tmp_path)
    counts = ro.wait(progress=False, timeout=120)
    assert counts["paused"] == 2 and counts["failed"] == 0 and counts["done"] == 0
    httpx.post(f"{url}/admin/outage", json={"seconds": 0})
    assert ro.queue.resume_paused() == 2
    ro.start_workers(1, url="local", root=root, suite=suite, log_dir=tmp_path)
    counts = ro.wait(progress=False, timeout=120)
    assert counts["done"] == 2 and all(r["resolved"] for r in ro.records())


def test_bad_endpoint_url_is_refused():
    from shoal.core.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="http"):
        make_policy({"kind": "chat", "url": "localhost:8000", "model": "m"})
