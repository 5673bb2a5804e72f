"""The front through a fleet's gateways (3 hosts, 2 gateways, PostgreSQL: tests/fleet/fleetctl.py): a
core subset of the SDK's calls, with a tenant key of the fleet, so the fleet's quotas apply."""
from __future__ import annotations

import os
import time

import pytest
from e2b import PtySize, Sandbox

from shoal import Host

from .conftest import start_front


@pytest.fixture(scope="module")
def over_fleet(fleet, host, root, e2b_image):
    fleet.ensure_hosts()
    fleet.ensure_gateways()
    layers = host.store.get_image(e2b_image).layers
    for h in fleet.hosts:  # the template's image on every host (the fleet's hosts share no files)
        store = Host.get(h.root).store
        for digest in layers:
            if not store.has_layer(digest):
                store.add_erofs(host.store.image_path(digest), digest, source="test")
        store.create_image(e2b_image, layers)
    key = fleet.tenant("e2b-front", sandboxes=4)
    env = {**os.environ, "SHOAL_ROOT": str(root)}  # SHOAL_CA_CERT (the fleet's CA) comes from the fixture
    env.pop("SHOAL_URL", None)
    d = start_front(root, env, "--url", fleet.url, "--shoal-key", key, "--template", f"base={e2b_image}")
    yield d
    d["proc"].terminate()
    d["proc"].wait(20)


def test_sdk_through_the_fleet_gateway(over_fleet):
    opts = {"api_url": over_fleet["url"], "sandbox_url": over_fleet["url"], "api_key": over_fleet["key"]}
    s = Sandbox.create("base", timeout=60, **opts)
    try:
        assert s.sandbox_id in [i.sandbox_id for i in Sandbox.list(**opts).next_items()]
        r = s.commands.run("echo via fleet; id -u; echo e >&2")
        assert (r.stdout, r.stderr) == ("via fleet\n1000\n", "e\n")
        assert s.commands.run("id -u", user="root").stdout == "0\n"
        cat = s.commands.run("cat", background=True, stdin=True)
        s.commands.send_stdin(cat.pid, "in\n")
        s.commands.close_stdin(cat.pid)
        assert cat.wait().stdout == "in\n"
        info = s.files.write("f.txt", "over the fleet", metadata={"k": "v"})
        assert info.metadata == {"k": "v"}
        e = s.files.get_info("f.txt")
        assert (e.owner, e.metadata) == ("user", {"k": "v"})
        assert s.files.read("f.txt") == "over the fleet"
        # a watcher: the gateway's watch stream, from the sandbox's host
        w = s.files.watch_dir(".")
        s.files.write("w.txt", "x")
        seen: list = []
        for _ in range(100):
            seen += [(e.type.value, e.name) for e in w.get_new_events()]
            if ("write", "w.txt") in seen:
                break
            time.sleep(0.05)
        assert seen[:2] == [("create", "w.txt"), ("write", "w.txt")], seen
        w.stop()
        got = bytearray()
        h = s.pty.create(PtySize(rows=12, cols=34))
        s.pty.resize(h.pid, PtySize(rows=21, cols=43))
        s.pty.send_stdin(h.pid, b"stty size; exit 0\n")
        assert h.wait(on_pty=got.extend).exit_code == 0
        assert b"21 43" in bytes(got)
        assert s.pause() is True and s.is_running() is False
        assert Sandbox.connect(s.sandbox_id, **opts).commands.run("cat f.txt").stdout == "over the fleet"
    finally:
        assert s.kill() is True
    assert s.is_running() is False
