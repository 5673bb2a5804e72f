"""The front over the gVisor backend (`--sandbox-backend gvisor`, runsc --platform=ptrace): a subset of
the SDK's calls: commands as `user` and `root`, env and cwd, background with stdin, files, get_host
through the gVisor port relay; and a PTY, which gVisor does not do (docs/e2b.md)."""
from __future__ import annotations

import os
import shutil

import httpx
import pytest
from e2b import PtySize, Sandbox

from .conftest import start_front
from .test_ports import _get, _serve

pytestmark = pytest.mark.skipif(not shutil.which("runsc"), reason="runsc (gVisor) is not installed")


@pytest.fixture(scope="module")
def gv_front(root, e2b_image):
    env = {**os.environ, "SHOAL_URL": "local", "SHOAL_ROOT": str(root)}
    d = start_front(root, env, "--template", f"base={e2b_image}", "--sandbox-backend", "gvisor")
    yield d
    d["proc"].terminate()
    d["proc"].wait(20)


def test_sdk_over_gvisor(gv_front):
    opts = {"api_url": gv_front["url"], "sandbox_url": gv_front["url"], "api_key": gv_front["key"]}
    s = Sandbox.create("base", timeout=120, **opts)
    try:
        assert s.sandbox_id.startswith("gv-")
        r = s.commands.run("echo $HOME; id -u; pwd; echo e >&2; echo $GREETING", envs={"GREETING": "hi"})
        assert (r.stdout, r.stderr) == ("/home/user\n1000\n/home/user\nhi\n", "e\n")
        assert s.commands.run("id -u", user="root").stdout == "0\n"
        assert s.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
        with pytest.raises(Exception) as e:
            s.commands.run("exit 3")
        assert getattr(e.value, "exit_code", None) == 3
        cat = s.commands.run("cat", background=True, stdin=True)
        s.commands.send_stdin(cat.pid, "in\n")
        s.commands.close_stdin(cat.pid)
        assert cat.wait().stdout == "in\n"
        s.files.write("f.txt", "over gvisor")
        assert s.files.read("f.txt") == "over gvisor" and s.files.get_info("f.txt").owner == "user"
        _serve(s, 8080)
        hdr = {"Host": s.get_host(8080), "E2B-Traffic-Access-Token": s.traffic_access_token}
        r = _get(gv_front["url"] + "/index.html", hdr)
        assert (r.status_code, r.text) == (200, "served from the sandbox\n")
        r = httpx.get(gv_front["url"] + "/", headers={**hdr, "Host": s.get_host(8099)}, timeout=30)
        assert r.status_code == 502
        with pytest.raises(Exception) as e:  # no PTY on gVisor: the SDK's error for `unimplemented`
            s.pty.create(PtySize(rows=10, cols=20))
        assert "pty" in str(e.value).lower() or "unimplemented" in str(e.value).lower()
    finally:
        assert s.kill() is True
