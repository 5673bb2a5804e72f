"""Start a real shoald subprocess for tests (see the `daemon` fixture in conftest.py)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx


def start_daemon(root: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    """Start `shoal serve` on `root` and wait until /v1/health answers on its Unix socket.

    Its output goes to <root>/shoald.log, not a pipe: a pipe nobody reads fills after 64 KiB of log
    and then blocks the daemon on its next write."""
    sock = root / "shoald.sock"
    env = dict(os.environ, SHOAL_ROOT=str(root), **(env or {}))
    env.pop("SHOAL_URL", None)
    with open(log_path(root), "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "shoal.cli", "serve", *args], env=env,
                                stdout=log, stderr=subprocess.STDOUT)
    # 30 s is ample on a real host; an emulated one (make test-vm under TCG) imports FastAPI 10-30x slower
    deadline = time.time() + float(os.environ.get("SHOAL_TEST_DAEMON_START_S", "30"))
    while time.time() < deadline:
        if sock.exists():
            try:
                with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://x") as c:
                    if c.get("/v1/health").status_code == 200:
                        return proc
            except httpx.TransportError:
                pass
        if proc.poll() is not None:
            raise RuntimeError(log_tail(root))
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("shoald did not start:\n" + log_tail(root))


def log_path(root: Path) -> Path:
    return root / "shoald.log"


def log_tail(root: Path, n: int = 20000) -> str:
    try:
        return log_path(root).read_bytes()[-n:].decode(errors="replace")
    except FileNotFoundError:
        return ""
