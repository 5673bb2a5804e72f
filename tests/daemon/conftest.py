"""HTTP-backend helpers for the daemon suites (the `daemon` and `tenants` fixtures are in tests/conftest.py)."""
from __future__ import annotations

import contextlib

import pytest

from shoal.backends.http import HttpBackend
from shoal.core.contract import CreateRequest


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
