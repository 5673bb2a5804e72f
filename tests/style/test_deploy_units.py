"""The systemd unit files in deploy/systemd pass `systemd-analyze verify` (skipped where systemd's
tools are missing). The units name /usr/local/bin/shoal, which a checkout need not have: the check
runs on copies that point at an executable that exists."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

UNITS = Path(__file__).resolve().parents[2] / "deploy" / "systemd"


@pytest.mark.parametrize("unit", ["shoald.service", "shoal-gateway.service", "shoal.slice"])
def test_unit_file_verifies(unit, tmp_path):
    if not shutil.which("systemd-analyze"):
        pytest.skip("systemd-analyze is not installed")
    text = (UNITS / unit).read_text()
    assert unit.endswith(".slice") or "/usr/local/bin/shoal " in text
    copy = tmp_path / unit
    copy.write_text(text.replace("/usr/local/bin/shoal ", "/bin/true "))
    r = subprocess.run(["systemd-analyze", "verify", str(copy)], capture_output=True, text=True, timeout=60)
    problems = [line for line in (r.stdout + r.stderr).splitlines() if unit in line]
    assert r.returncode == 0 and not problems, r.stdout + r.stderr
