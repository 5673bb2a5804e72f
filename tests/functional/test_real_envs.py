"""The real environments: a debootstrap'd Debian base, the Python toolchain recipe, and the PyPI
workspaces, each verified by running its own tests inside a sandbox. Needs the package registries
(Debian mirror, PyPI) during the build; the sandboxes that run the tests have no network."""
from __future__ import annotations

import shutil

import pytest

from shoal import Sandbox
from shoal.envs.debian import PYTHON_IMAGE, ensure_python_base
from shoal.envs.workspaces import CATALOG, build_workspace, verify_workspace

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def python_base(host):
    if not shutil.which("debootstrap"):
        pytest.fail("debootstrap is missing: `make test` installs it")
    return ensure_python_base(host)


def test_debian_python_base(host, root, python_base):
    assert python_base.config["role"] == "base"
    with Sandbox.create(PYTHON_IMAGE, root=root) as sb:
        r = sb.commands.run("cat /etc/debian_version; python3 --version; python3 -m pytest --version")
        assert r.exit_code == 0 and r.stdout.startswith("12.") and "Python 3.11" in r.stdout
        assert sb.commands.run("ls /sys/class/net").stdout.split() == ["lo"]
    again = ensure_python_base(host)  # cached: same layers, nothing rebuilt
    assert again.layers == python_base.layers


@pytest.mark.parametrize("spec", CATALOG, ids=[s.name for s in CATALOG])
def test_workspace_builds_and_its_tests_pass(host, python_base, spec):
    img = build_workspace(host, spec)
    assert img.config["role"] == "workspace" and not set(img.layers) & set(python_base.layers)
    r = verify_workspace(host, spec, quick=True)
    assert r.exit_code == 0, r.stdout[-1500:] + r.stderr[-1500:]
    assert " passed" in r.stdout
