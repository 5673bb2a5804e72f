"""The fleet for tests/fleet: 3 hosts in network namespaces, 2 gateways, the session's PostgreSQL
(fleetctl.py). Started once for the package; torn down even when a test fails."""
from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="package")
def fleet(postgres, shoal_init_built):
    from fleetctl import build_fleet

    f = build_fleet(postgres)
    old = os.environ.get("SHOAL_CA_CERT")
    os.environ["SHOAL_CA_CERT"] = str(f.fleet_dir / "ca.pem")  # the SDK trusts the gateways' certificate
    try:
        yield f
    finally:
        if old is None:
            os.environ.pop("SHOAL_CA_CERT", None)
        else:
            os.environ["SHOAL_CA_CERT"] = old
        f.close()


@pytest.fixture
def gw(fleet):
    """The fleet with both gateways answering (a test may have killed one)."""
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
