"""Scale-out on a local multi-node Ray cluster (several raylets on this machine, each node with its
own Shoal root). One node is lost mid-run, sandboxes included: its episodes resume on the other
node from the trajectory log, and no episode is lost or has a completed command counted twice."""
from __future__ import annotations

import sqlite3
import tempfile
import time
from pathlib import Path

import pytest
from roots import wipe_root

from shoal import Host
from shoal.rollout.queue import open_queue
from shoal.rollout.runner import Rollout
from shoal.tasks.swe.suite import save_suite

pytestmark = pytest.mark.slow


def test_claim_prefers_episodes_whose_layers_the_node_has(tmp_path):
    q = open_queue(tmp_path / "q.db")
    q.submit(["a", "b", "c"], {"kind": "null"}, images={"a": "swe/a:task", "b": "swe/b:task", "c": "swe/c:task"})
    assert q.claim("w1", "n1", prefer_images={"swe/c:task"}).task_id == "c"
    assert q.claim("w1", "n1", prefer_images={"swe/zzz:task"}).task_id == "a"  # none local: oldest first


@pytest.fixture
def node_roots():
    roots = [Path(tempfile.mkdtemp(prefix=f"shoal-n{i}-", dir="/tmp")) for i in (1, 2)]
    yield roots
    for r in roots:
        wipe_root(r)


def _running_on(db: Path, node: str) -> list[str]:
    with sqlite3.connect(db) as c:
        return [r[0] for r in c.execute("SELECT id FROM episodes WHERE status='running' AND node=?", (node,))]


def _done_entries(log: Path, eid: str) -> int:
    try:
        with sqlite3.connect(log) as c:
            return c.execute("SELECT COUNT(*) FROM entries WHERE stream=? AND status='DONE'",
                             (f"{eid}/sandbox",)).fetchone()[0]
    except sqlite3.OperationalError:  # not created yet
        return 0


def test_node_loss_mid_run_resumes_elsewhere(tmp_path, root, few_tasks, node_roots):
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    from shoal.rollout.distributed import NodeSpec, start_actors

    suite = save_suite(few_tasks, tmp_path / "suite.jsonl")
    ro = Rollout(tmp_path / "rollout.db")
    script = lambda t: [["shell", {"command": "echo x >> /work/counter"}],  # noqa: E731
                        ["shell", {"command": "sleep 2"}],
                        ["create_file", {"path": "/tmp/fix.patch", "content": t.patch}],
                        ["shell", {"command": "git apply /tmp/fix.patch"}],
                        ["shell", {"command": "cat /work/counter"}]]
    ids = []
    for t in few_tasks:
        ids += ro.submit([t], {"kind": "script", "actions": script(t)}, repeats=2)
    cluster = Cluster(initialize_head=True, connect=True, head_node_args={"num_cpus": 1})
    try:
        nodes = [cluster.add_node(num_cpus=1, resources={f"shoal-node-{i}": 1}) for i in (1, 2)]
        cluster.wait_for_nodes()
        specs = [NodeSpec(f"shoal-node-{i}", url="local", root=str(r)) for i, r in zip((1, 2), node_roots)]
        actors = start_actors(str(ro.db), specs, suite=str(suite), concurrency=2, pull_from=str(root), lease_s=3.0)
        where = ray.get([a.where.remote() for a in actors], timeout=120)
        assert {w["ray_node"] for w in where} == {n.node_id for n in nodes}
        runs = [a.run.remote() for a in actors]
        # wait until node 2 is in the middle of an episode whose first command is done
        deadline, victim = time.time() + 120, None
        while time.time() < deadline and victim is None:
            for eid in _running_on(ro.db, "shoal-node-2"):
                if _done_entries(ro.log_path, eid) >= 1:
                    victim = eid
            time.sleep(0.05)
        assert victim, "node 2 never started an episode"
        cluster.remove_node(nodes[1])  # the raylet and its actor die...
        lost = Host.get(node_roots[1])
        for info in lost.backend().list():  # ...and so do the node's sandboxes, as on a real machine
            lost.kill(info.id)
        assert ray.get(runs[0], timeout=300)["finished"] >= 1
        with pytest.raises(ray.exceptions.RayError):
            ray.get(runs[1], timeout=60)
    finally:
        ray.shutdown()
        cluster.shutdown()
    counts = ro.counts()
    assert counts["done"] == len(ids) and counts["failed"] == 0
    recs = {r["episode_id"]: r for r in ro.records()}
    moved = recs[victim]
    assert moved["node"] == "shoal-node-1" and moved["restored_ops"] >= 1 and moved["resolved"]
    for r in recs.values():
        assert r["resolved"]
        cat = next(a for a in r["actions"] if a["arguments"] and "cat /work/counter" in a["arguments"])
        assert cat["observation"].count("x\n") == 1, (r["episode_id"], cat)
