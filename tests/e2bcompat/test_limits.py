"""The front's review items: auth before any body is read (and a cap on it), keys revoked while it runs,
and per-tenant limits on sandboxes, streams, processes and watchers."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from urllib.parse import urlsplit

import httpx
import pytest
from e2b import Sandbox

from shoal.e2b.app import CONTROL_BODY_MAX

from .conftest import start_front


def _raw(url: str, request: bytes, timeout: float = 3.0) -> bytes:
    """Send raw bytes; the reply (until the server closes, or `timeout`)."""
    u = urlsplit(url)
    with socket.create_connection((u.hostname, u.port), timeout=timeout) as s:
        s.sendall(request)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
                if b"\r\n\r\n" in out and b'"message"' in out:
                    break
        except TimeoutError:
            pass
    return out


def test_the_key_is_checked_before_the_body_is_read(e2b_server):
    # headers announce 100 MB that never come: a bad key is refused at once, without waiting for them
    head = (b"POST /sandboxes HTTP/1.1\r\nHost: x\r\nX-API-KEY: e2b_" + b"0" * 40 +
            b"\r\nContent-Type: application/json\r\nContent-Length: 100000000\r\n\r\n{")
    t = time.monotonic()
    reply = _raw(e2b_server["url"], head)
    assert reply.startswith(b"HTTP/1.1 401"), reply[:200]
    assert time.monotonic() - t < 2.5
    # a good key with a body over the cap: 413, whether the length is announced or not
    r = httpx.post(e2b_server["url"] + "/sandboxes", headers={"X-API-KEY": e2b_server["key"]},
                   content=b"{" + b" " * CONTROL_BODY_MAX + b"}")
    assert r.status_code == 413 and r.json()["code"] == 413

    def chunks():
        for _ in range(CONTROL_BODY_MAX // 4096 + 2):
            yield b" " * 4096

    r = httpx.post(e2b_server["url"] + "/sandboxes", headers={"X-API-KEY": e2b_server["key"]}, content=chunks())
    assert r.status_code == 413


def test_a_key_revoked_or_made_while_the_front_runs(e2b_server, root):
    env = {**os.environ, "SHOAL_URL": "local", "SHOAL_ROOT": str(root)}
    keys = ["--keys", str(root / f"{e2b_server['name']}-keys.json")]
    cli = [sys.executable, "-m", "shoal.cli", "e2b", "key"]
    new = subprocess.run([*cli, "create", "carol", *keys], env=env, check=True, capture_output=True,
                         text=True).stdout.strip()
    url = e2b_server["url"]
    assert httpx.get(url + "/v2/sandboxes", headers={"X-API-KEY": new}).status_code == 200  # no restart needed
    subprocess.run([*cli, "revoke", "carol", *keys], env=env, check=True, capture_output=True)
    r = httpx.get(url + "/v2/sandboxes", headers={"X-API-KEY": new})
    assert r.status_code == 401, r.text  # gone at the next request
    assert httpx.get(url + "/v2/sandboxes", headers={"X-API-KEY": e2b_server["key"]}).status_code == 200


@pytest.fixture(scope="module")
def tight_front(root, e2b_image):
    env = {**os.environ, "SHOAL_URL": "local", "SHOAL_ROOT": str(root)}
    d = start_front(root, env, "--template", f"base={e2b_image}", "--max-sandboxes", "2", "--max-streams", "2",
                    "--max-processes", "3", "--max-watchers", "1")
    yield d
    d["proc"].terminate()
    d["proc"].wait(20)


def test_per_tenant_limits(tight_front):
    from e2b import RateLimitException, SandboxException

    opts = {"api_url": tight_front["url"], "sandbox_url": tight_front["url"], "api_key": tight_front["key"]}
    a = Sandbox.create("base", timeout=60, **opts)
    b = Sandbox.create("base", timeout=60, **opts)
    other = Sandbox.create("base", timeout=60, **{**opts, "api_key": tight_front["other_key"]})  # its own count
    try:
        with pytest.raises(RateLimitException):
            Sandbox.create("base", timeout=60, **opts)
        # streams per tenant: two open background commands hold both; a third is refused
        h1 = a.commands.run("sleep 30", background=True)
        h2 = b.commands.run("sleep 30", background=True)
        with pytest.raises(SandboxException, match="streams"):
            a.commands.run("echo no")
        assert other.commands.run("echo yes").stdout == "yes\n"  # the other tenant is not held up
        h1.disconnect()
        h2.disconnect()
        deadline = time.monotonic() + 10
        while True:  # the stream slots come back once the front sees the clients gone
            try:
                assert a.commands.run("echo again").stdout == "again\n"
                break
            except SandboxException:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        # processes per sandbox: three running (h1 and two more), a fourth is refused
        a.commands.run("sleep 30", background=True).disconnect()
        a.commands.run("sleep 30", background=True).disconnect()
        with pytest.raises(SandboxException, match="processes"):
            a.commands.run("sleep 30", background=True)
        # watchers per sandbox
        w = a.files.watch_dir("/tmp")
        with pytest.raises(SandboxException, match="watchers"):
            a.files.watch_dir("/home/user")
        w.stop()
        a.files.watch_dir("/home/user").stop()
        a.kill()
        Sandbox.create("base", timeout=60, **opts).kill()  # a killed one frees its place
    finally:
        for s in (a, b, other):
            try:
                s.kill()
            except Exception:
                pass


def test_one_tenant_cannot_take_every_watch_of_the_front(opts, e2b_server):
    """The backend's watch caps are per sandbox (16) and per process (32): one tenant's two sandboxes
    could hold them all. The front's per-tenant cap (8) leaves other tenants theirs."""
    from e2b.exceptions import SandboxException

    from shoal.e2b.front import Limits

    a = Sandbox.create("base", timeout=60, **opts)
    b = Sandbox.create("base", timeout=60, **opts)
    other = Sandbox.create("base", timeout=60, **{**opts, "api_key": e2b_server["other_key"]})
    held = []
    try:
        with pytest.raises(SandboxException, match="file watches"):
            for i in range(20):
                held.append((a, b)[i % 2].files.watch_dir("/tmp"))
        assert len(held) == Limits().watches
        other.files.watch_dir("/tmp").stop()
        held.pop().stop()
        deadline = time.monotonic() + 10
        while True:  # the slot comes back once the front sees the stream gone
            try:
                held.append(a.files.watch_dir("/tmp"))
                break
            except SandboxException:
                assert time.monotonic() < deadline
                time.sleep(0.2)
    finally:
        for w in held:
            w.stop()
        for s in (a, b, other):
            s.kill()


def test_concurrent_forks_cannot_pass_the_sandbox_cap(tight_front):
    """Forks in flight hold their children's places like creates do: two forks sent at once by a
    tenant with room for one child make one child, not two past --max-sandboxes (2)."""
    from concurrent.futures import ThreadPoolExecutor

    opts = {"api_url": tight_front["url"], "sandbox_url": tight_front["url"], "api_key": tight_front["key"]}
    src = Sandbox.create("base", timeout=60, **opts)
    hdr = {"x-api-key": tight_front["key"]}
    try:
        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda _: httpx.post(f"{tight_front['url']}/sandboxes/{src.sandbox_id}/fork",
                                                         json={"count": 1, "timeout": 60}, headers=hdr, timeout=60),
                                    range(4)))
        made = [c["sandbox"]["sandboxID"] for r in replies if r.status_code == 201 for c in r.json() if "sandbox" in c]
        live = [s for s in httpx.get(f"{tight_front['url']}/v2/sandboxes", headers=hdr).json()]
        assert len(made) == 1 and len(live) == 2, ([r.status_code for r in replies], made)
    finally:
        for s in httpx.get(f"{tight_front['url']}/v2/sandboxes", headers=hdr).json():
            httpx.delete(f"{tight_front['url']}/sandboxes/{s['sandboxID']}", headers=hdr)
