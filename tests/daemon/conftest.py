"""A real shoald (uvicorn on a Unix socket) per test module, on the session's Shoal root."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest


@pytest.fixture(scope="module")
def daemon(root, base_image):
    sock = root / "shoald.sock"
    env = dict(os.environ, SHOAL_ROOT=str(root))
    env.pop("SHOAL_URL", None)
    proc = subprocess.Popen([sys.executable, "-m", "shoal.cli", "serve", "--max-starting", "8"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 30
    while time.time() < deadline:
        if sock.exists():
            try:
                with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://x") as c:
                    if c.get("/v1/health").status_code == 200:
                        break
            except httpx.TransportError:
                pass
        if proc.poll() is not None:
            raise RuntimeError(proc.stdout.read().decode())
        time.sleep(0.05)
    else:
        proc.kill()
        raise RuntimeError("shoald did not start")
    yield {"proc": proc, "sock": sock, "url": f"unix://{sock}", "root": root,
           "admin_key": (root / "admin.key").read_text().strip()}
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="module")
def tenants(daemon):
    """Two tenants, a and b, with their keys."""
    from shoal.sdk.remote import Client

    admin = Client(daemon["url"])
    keys = {}
    for name in ("tenant-a", "tenant-b"):
        keys[name] = admin.json("POST", "/v1/tenants", json={"name": name, "quotas": {"sandboxes": 5, "cpu": 8,
                                                                                       "memory_mb": 4096,
                                                                                       "disk_mb": 8192}})["api_key"]
    return keys
