"""`shoal.fleet.ray.start_fleet` on a local multi-node Ray cluster (several raylets on this machine):
a shoald pinned to every node that holds the `shoal-host` resource, each with its own root, socket
and port, and a gateway; sandboxes created through the gateway land on both hosts."""
from __future__ import annotations

import os
import tempfile
import uuid
from pathlib import Path

import pytest
from roots import wipe_root

from shoal import Sandbox

pytestmark = pytest.mark.slow


def test_start_fleet_on_a_ray_cluster(postgres, shoal_init_built):
    ray = pytest.importorskip("ray")
    from fleetctl import seed_root
    from ray.cluster_utils import Cluster

    from shoal.fleet.ray import start_fleet

    dsn = postgres.new_database()
    base = Path(tempfile.mkdtemp(prefix="shray-", dir="/tmp"))  # short: sockets live under it
    cluster = Cluster(initialize_head=True, connect=True, head_node_args={"num_cpus": 1})
    fleet = None
    old_ca = os.environ.get("SHOAL_CA_CERT")
    try:
        nodes = [cluster.add_node(num_cpus=1, resources={"shoal-host": 1}) for _ in range(2)]
        cluster.wait_for_nodes()
        fleet = start_fleet(dsn, resource="shoal-host", root_base=str(base), fleet_dir=base / "pki", lease_s=3.0,
                            serve_args=["--max-starting", "8"])
        # one host per node with the resource (none on the head), each pinned there, nothing shared
        assert {h["node_id"] for h in fleet.hosts} == {n.node_id for n in nodes}
        assert len({h["host_id"] for h in fleet.hosts}) == len({h["root"] for h in fleet.hosts}) == 2
        assert len({h["address"] for h in fleet.hosts}) == 2
        for h in fleet.hosts:
            seed_root(Path(h["root"]))  # the operator's `shoal tasks prepare` / a registry pull, per node
        os.environ.update(fleet.env())
        key = fleet.tenant(f"ray-{uuid.uuid4().hex[:6]}")
        sbs = [Sandbox.create("busybox:test", url=fleet.url, api_key=key, memory_mb=64, disk_mb=16) for _ in range(2)]
        try:
            # each node is its own failure domain: the tenant's two sandboxes are spread over both
            assert {sb.id.split("-")[1] for sb in sbs} == {h["host_id"] for h in fleet.hosts}
            for sb in sbs:
                assert sb.commands.run("echo ok").stdout == "ok\n"
        finally:
            for sb in sbs:
                sb.kill()
        from shoal.fleet.directory import Directory
        from shoal.fleet.schema import open_db

        rows = {h["id"]: h for h in Directory(open_db(dsn)).hosts()}
        for h in fleet.hosts:
            assert rows[h["host_id"]]["address"] == h["address"] and rows[h["host_id"]]["state"] == "up"
    finally:
        if fleet is not None:
            fleet.stop()
        if old_ca is None:
            os.environ.pop("SHOAL_CA_CERT", None)
        else:
            os.environ["SHOAL_CA_CERT"] = old_ca
        ray.shutdown()
        cluster.shutdown()
        for d in base.iterdir() if base.exists() else ():
            if d.name.startswith("ray"):
                wipe_root(d)
        import shutil

        shutil.rmtree(base, ignore_errors=True)
    if fleet is not None:
        for h in fleet.hosts:  # the daemons are gone
            with pytest.raises(ProcessLookupError):
                os.kill(h["child_pid"], 0)
