"""ruff and mypy over the code, with the project's configs (ruff.toml, mypy.ini): a style or type
regression fails `make test`, so CI runs both."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=900)


def test_ruff_is_clean():
    r = _run("ruff", "check", "--no-cache", "src", "tests", "bench", "vm")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_mypy_is_clean():
    r = _run("mypy", "--no-incremental")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_every_type_ignore_says_why():
    """`# type: ignore[code]  # reason`: an ignore without its code and a reason hides a real error."""
    bare = []
    for path in (REPO / "src").rglob("*.py"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if "type: ignore" not in line:
                continue
            tail = line.split("type: ignore", 1)[1]
            if not tail.startswith("[") or "#" not in tail.split("]", 1)[1]:
                bare.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert bare == [], "\n".join(bare)
