"""shoald's watch stream (`watch_dir` through the http backend) is the sandbox's tenant's alone."""
from __future__ import annotations

import pytest

from shoal.backends.http import HttpBackend
from shoal.core.contract import ExecRequest
from shoal.core.errors import SandboxNotFound, Unauthorized

from .conftest import created


def test_a_tenant_watches_only_its_own_sandboxes(daemon, base_image):
    from daemonctl import make_tenants

    url = daemon["url"]
    keys = make_tenants(url, names=("watch-a", "watch-b"))
    a, b = HttpBackend(url, keys["watch-a"]), HttpBackend(url, keys["watch-b"])
    with created(a, base_image) as info:
        with a.watch_dir(info.id, "/tmp") as h:
            a.exec(info.id, ExecRequest(argv=["touch", "/tmp/mine"]))
            evs: list = []
            for _ in range(50):
                evs += h.read(0.2)
                if any(e.name == "mine" for e in evs):
                    break
            assert ("create", "mine") in [(e.type, e.name) for e in evs]
        with pytest.raises(SandboxNotFound):  # 404, as every other route: existence not confirmed
            b.watch_dir(info.id, "/tmp")
        with pytest.raises(Unauthorized):
            HttpBackend(url, "sk-wrong").watch_dir(info.id, "/tmp")
