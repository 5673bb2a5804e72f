"""shoald fixtures for the daemon suites: tenants made through the admin routes, and HTTP backends."""
from __future__ import annotations

import contextlib

import pytest
from daemonctl import make_tenants, socket_of, start_daemon

from shoal.backends.http import HttpBackend
from shoal.core.contract import CreateRequest


@pytest.fixture(scope="module")
def daemon(root, base_image):
    """A real shoald per test module on the session's root, on a private socket. Tests that restart
    it put the new process in d["proc"]: that one is stopped at the end (a leaked daemon would keep
    answering on the socket, and the next module's daemon rightly refuses to take it)."""
    sock = socket_of(root)
    d = {"proc": start_daemon(root, "--max-starting", "8"), "sock": sock, "url": f"unix://{sock}", "root": root,
         "admin_key": (root / "admin.key").read_text().strip()}
    yield d
    d["proc"].terminate()
    d["proc"].wait(20)


@pytest.fixture(scope="module")
def tenants(daemon):
    """Two tenants, a and b, with their keys."""
    return make_tenants(daemon["url"])


@pytest.fixture
def admin(daemon):
    """The daemon's admin: root on its socket, without a key."""
    be = HttpBackend(daemon["url"], "")
    yield be
    be.close()


@contextlib.contextmanager
def created(be: HttpBackend, image: str | None = None, **kw):
    """A sandbox through `be`, killed at the end of the block."""
    info = be.create(CreateRequest(image=image, **kw))
    try:
        yield info
    finally:
        try:
            be.kill(info.id)
        except Exception:  # already gone (the test killed it)
            pass
