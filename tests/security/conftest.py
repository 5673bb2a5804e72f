"""The security probe (probe.c, built statically into a layer) and a sandbox that carries it."""
from __future__ import annotations

import os
import subprocess

import pytest


HERE = os.path.dirname(__file__)


@pytest.fixture(scope="session")
def probe_layer(host, tmp_path_factory):
    d = tmp_path_factory.mktemp("probe")
    (d / "usr/local/bin").mkdir(parents=True)
    subprocess.run(["gcc", "-static", "-O1", "-o", str(d / "usr/local/bin/probe"), os.path.join(HERE, "probe.c"),
                    "-lpthread"], check=True)
    return host.store.build_from_dir(d, name="security-probe").digest  # named: survives `shoal gc`


@pytest.fixture
def probed(make_sandbox, probe_layer):
    """A sandbox carrying the probe, on the test's backend (every backend in all_backends modules)."""
    return make_sandbox(layers=[probe_layer], memory_mb=128, pids=64, disk_mb=16)


def probe_results(sb, *args: str, timeout: float = 20) -> dict[str, str]:
    """Run `probe ARGS` in `sb`; its NAME=VALUE lines as a dict."""
    out = sb.commands.run(["probe", *args], timeout=timeout).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
