"""The security probes (C programs here, each built statically into a layer of its own), a sandbox that
carries the main one, and a marker file on the host's root file system for the escape tests."""
from __future__ import annotations

import os
import secrets
import subprocess
from pathlib import Path

import pytest

HERE = os.path.dirname(__file__)


def tool_layer(host, tmp_path_factory, tool: str, *gcc_args: str) -> str:
    """A layer with /usr/local/bin/TOOL, built statically from HERE/TOOL.c (named: survives `shoal gc`)."""
    d = tmp_path_factory.mktemp(tool)
    (d / "usr/local/bin").mkdir(parents=True)
    subprocess.run(["gcc", "-static", "-O1", "-o", str(d / "usr/local/bin" / tool), os.path.join(HERE, f"{tool}.c"),
                    *gcc_args], check=True)
    return host.store.build_from_dir(d, name=f"security-{tool.replace('_', '-')}").digest


def tool_results(sb, argv: list[str], timeout: float = 20) -> dict[str, str]:
    """Run a probe in `sb`; its NAME=VALUE lines as a dict."""
    out = sb.commands.run(argv, timeout=timeout).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


@pytest.fixture(scope="session")
def probe_layer(host, tmp_path_factory):
    return tool_layer(host, tmp_path_factory, "probe", "-lpthread")


@pytest.fixture
def host_marker():
    """A file on the host's root file system itself (not on /tmp or /run, which are mounts of their own
    that the sandbox's namespace detaches): what sits under the sandbox's overlay."""
    path = Path("/") / f".shoal-escape-{secrets.token_hex(4)}"
    path.write_text("host")
    try:
        yield path
    finally:
        path.unlink()


@pytest.fixture
def probed(make_sandbox, probe_layer):
    """A sandbox carrying the probe, on the test's backend (every backend in all_backends modules)."""
    return make_sandbox(layers=[probe_layer], memory_mb=128, pids=64, disk_mb=16)


def probe_results(sb, *args: str, timeout: float = 20) -> dict[str, str]:
    """Run `probe ARGS` in `sb`; its NAME=VALUE lines as a dict."""
    return tool_results(sb, ["probe", *args], timeout)


def template_switch_kernel() -> bool:
    """Whether this kernel takes the template root switch: overlayfs builds a detached overlay over a
    detached upper from Linux 6.15 (before that, init falls back to pivot_root)."""
    major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    return (major, minor) >= (6, 15)


@pytest.fixture(params=["template", "pivot_root"])
def switch(request, monkeypatch):
    """The root switch the sandboxes a test creates get (docs/density-create.md; read per create)."""
    if request.param == "pivot_root":
        monkeypatch.setenv("SHOAL_ROOT_SWITCH", "pivot_root")
    else:
        monkeypatch.delenv("SHOAL_ROOT_SWITCH", raising=False)
    return request.param
