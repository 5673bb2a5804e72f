"""Start a real shoald subprocess for tests (see the `daemon` fixture in conftest.py), and talk to it.

Each test daemon listens on a private socket (`<root>/shoald.sock` unless given), never on the
host's default /run/shoal/shoald.sock."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

TENANT_QUOTAS = {"sandboxes": 5, "cpu": 8, "memory_mb": 4096, "disk_mb": 8192}


def socket_of(root: Path) -> Path:
    return root / "shoald.sock"


def start_daemon(root: Path, *args: str, env: dict | None = None, sock: Path | None = None) -> subprocess.Popen:
    """Start `shoal serve` on `root` and wait until /v1/health answers on its Unix socket.

    Its output goes to <root>/shoald.log, not a pipe: a pipe nobody reads fills after 64 KiB of log
    and then blocks the daemon on its next write."""
    if "--socket" in args:  # given among the options: wait on that one
        sock = Path(args[args.index("--socket") + 1])
    else:
        sock = sock or socket_of(root)
        args = ("--socket", str(sock), *args)
    from shoal.server.ensure import answering

    if answering(sock):  # a leaked daemon: the new one would refuse the socket, and we would test the old one
        raise RuntimeError(f"a shoald already answers on {sock}; stop it first")
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


def admin_backend(url: str, api_key: str | None = None):
    """An HttpBackend as the admin: as root on the socket, no key is needed."""
    from shoal.backends.http import HttpBackend

    return HttpBackend(url, api_key or "")


def make_tenants(url: str, names=("tenant-a", "tenant-b"), quotas: dict | None = None) -> dict[str, str]:
    """Create tenants through the admin routes; name -> API key."""
    admin = admin_backend(url)
    try:
        return {name: admin.json("POST", "/tenants", json={"name": name, "quotas": quotas or TENANT_QUOTAS})["api_key"]
                for name in names}
    finally:
        admin.close()


def log_path(root: Path) -> Path:
    return root / "shoald.log"


def log_tail(root: Path, n: int = 20000) -> str:
    try:
        return log_path(root).read_bytes()[-n:].decode(errors="replace")
    except FileNotFoundError:
        return ""
