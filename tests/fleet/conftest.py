"""tests/fleet: the session's fleet (the `fleet` fixture of tests/conftest.py, built by fleetctl.py:
3 hosts in network namespaces, 2 gateways, the session's PostgreSQL), shared with the security
suite's fleet kind; torn down at the end of the session even when a test fails."""
from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def gw(fleet):
    """The fleet with all its hosts and both gateways answering (a test may have killed one)."""
    fleet.ensure_hosts()
    fleet.ensure_gateways()
    return fleet


@pytest.fixture
def tenant_key(gw):
    """A fresh tenant per test (default quotas of fleetctl.Fleet.tenant); its key."""
    return gw.tenant(f"t-{uuid.uuid4().hex[:8]}")


@pytest.fixture
def made(gw):
    """Sandboxes a test made through the gateway, killed after it (lost ones are skipped)."""
    sbs: list = []
    yield sbs
    for sb in sbs:
        try:
            sb.kill()
        except Exception:
            pass
