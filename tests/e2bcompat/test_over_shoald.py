"""The same front over a real shoald (the http backend): nothing in it reaches past the contract."""
from __future__ import annotations

import os
import time

import pytest
from e2b import Sandbox

from .conftest import start_front


@pytest.fixture(scope="module")
def over_shoald(daemon, root, e2b_image):
    env = {**os.environ, "SHOAL_ROOT": str(root)}
    env.pop("SHOAL_URL", None)
    d = start_front(root, env, "--url", daemon["url"], "--shoal-key", daemon["admin_key"],
                    "--template", f"base={e2b_image}")
    yield d
    d["proc"].terminate()
    d["proc"].wait(20)


def test_sdk_through_shoald(over_shoald, daemon):
    opts = {"api_url": over_shoald["url"], "sandbox_url": over_shoald["url"], "api_key": over_shoald["key"]}
    s = Sandbox.create("base", timeout=60, **opts)
    try:
        # the front passes its tenant on as the memory-pool key (pooled memory cgroups never mix its tenants)
        from shoal.backends.http import HttpBackend

        admin = HttpBackend(daemon["url"], daemon["admin_key"])
        assert admin.info(s.sandbox_id).limits.memory_pool.startswith("e2b:"), s.sandbox_id
        admin.close()
        r = s.commands.run("echo via shoald; echo e >&2; exit 0")
        assert (r.stdout, r.stderr) == ("via shoald\n", "e\n")
        h = s.commands.run("sleep 0.2; echo bg", background=True)
        assert h.wait().stdout == "bg\n"
        cat = s.commands.run("cat", background=True, stdin=True)
        s.commands.send_stdin(cat.pid, "in\n")
        s.commands.close_stdin(cat.pid)
        assert cat.wait().stdout == "in\n"
        s.files.write("f.txt", "over http")
        assert s.files.read("f.txt") == "over http"
        assert {e.name for e in s.files.list(".")} >= {"f.txt"}
        # watching: the front's watcher rides shoald's watch stream (inotify in the daemon's host)
        from e2b import FilesystemEventType as T

        w = s.files.watch_dir(".")
        s.files.rename("f.txt", "g.txt")
        got: list = []
        for _ in range(100):
            got += [(e.type, e.name) for e in w.get_new_events()]
            if (T.CREATE, "g.txt") in got:
                break
            time.sleep(0.05)
        assert got[:2] == [(T.RENAME, "f.txt"), (T.CREATE, "g.txt")], got
        w.stop()
        s.files.rename("g.txt", "f.txt")
        assert s.pause() is True and s.is_running() is False
        assert Sandbox.connect(s.sandbox_id, **opts).commands.run("cat f.txt").stdout == "over http"
    finally:
        assert s.kill() is True
    assert s.is_running() is False
