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


def test_one_tenant_cannot_take_every_watch_of_the_daemon(daemon, base_image):
    """The backend's caps are per sandbox (16) and per daemon (32): one tenant's two sandboxes would
    hold them all. A tenant's cap leaves the others theirs."""
    from daemonctl import make_tenants

    from shoal.core.errors import QuotaExceeded
    from shoal.server.routes.watch import MAX_TENANT_WATCHES

    url = daemon["url"]
    keys = make_tenants(url, names=("watch-hog", "watch-other"))
    a, b = HttpBackend(url, keys["watch-hog"]), HttpBackend(url, keys["watch-other"])
    held = []
    with created(a, base_image) as one, created(a, base_image) as two, created(b, base_image) as mine:
        try:
            with pytest.raises(QuotaExceeded):
                for i in range(40):
                    held.append(a.watch_dir((one, two)[i % 2].id, "/tmp"))
            assert len(held) == MAX_TENANT_WATCHES
            with b.watch_dir(mine.id, "/tmp"):
                pass
            held.pop().close()
            for _ in range(50):  # the daemon frees the slot when it sees the stream close
                try:
                    held.append(a.watch_dir(one.id, "/tmp"))
                    break
                except QuotaExceeded:
                    import time
                    time.sleep(0.1)
            assert len(held) == MAX_TENANT_WATCHES
        finally:
            for h in held:
                h.close()
