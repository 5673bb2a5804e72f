"""shoald's port tunnel (`connect_port` through the http backend) is the sandbox's tenant's alone."""
from __future__ import annotations

import time

import pytest

from shoal.backends.http import HttpBackend
from shoal.core.contract import StartRequest
from shoal.core.errors import SandboxError, SandboxNotFound, Unauthorized

from .conftest import created


def test_a_tenant_reaches_only_its_own_sandboxes_ports(daemon, base_image):
    from daemonctl import make_tenants

    # tenants of its own: the session's root (and its tenants) outlives each module's daemon, and
    # test_api's module makes tenant-a and tenant-b
    url = daemon["url"]
    keys = make_tenants(url, names=("ports-a", "ports-b"))
    a, b = HttpBackend(url, keys["ports-a"]), HttpBackend(url, keys["ports-b"])
    with created(a, base_image) as info:
        server = a.start(info.id, StartRequest(argv=["nc", "-ll", "-p", "7000", "-e", "echo", "secret"]))
        deadline = time.monotonic() + 10
        while True:
            try:
                s = a.connect_port(info.id, 7000)
                break
            except SandboxError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        with s:
            s.settimeout(10)
            assert s.recv(100) == b"secret\n"
        with pytest.raises(SandboxNotFound):  # 404, as every other route: existence not confirmed
            b.connect_port(info.id, 7000)
        with pytest.raises(Unauthorized):
            HttpBackend(url, "sk-wrong").connect_port(info.id, 7000)
        with pytest.raises(SandboxNotFound):
            a.connect_port("sb-000000000000", 7000)
        server.close()
