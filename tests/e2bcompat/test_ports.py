"""`sandbox.get_host(port)`: an HTTP server started inside a sandbox (which has no network) reached
through the front, by the host name the SDK builds or by the SDK's routing headers; and no tenant
reaches another's ports."""
from __future__ import annotations

import time

import httpx
import pytest
from e2b import NotFoundException, Sandbox

CGI = b"""#!/bin/sh
echo "Content-Type: text/plain"
echo
echo "method=$REQUEST_METHOD query=$QUERY_STRING"
env | grep -i -E '^HTTP_(X_ACCESS|E2B|X_API)' || echo "no tokens"
cat
"""


def _serve(s: Sandbox, port: int) -> None:
    s.files.write("/tmp/www/index.html", "served from the sandbox\n")
    s.files.write("/tmp/www/cgi-bin/echo", CGI)
    s.commands.run("chmod +x /tmp/www/cgi-bin/echo")
    s.commands.run(f"httpd -p 127.0.0.1:{port} -h /tmp/www")


def _get(url: str, headers: dict, method: str = "GET", content: bytes | None = None) -> httpx.Response:
    """The server's bind races the first request: 502 for a few tries, then the answer."""
    deadline = time.monotonic() + 10
    while True:
        r = httpx.request(method, url, headers=headers, content=content, timeout=30)
        if r.status_code != 502 or time.monotonic() > deadline:
            return r
        time.sleep(0.1)


def test_get_host_reaches_a_server_inside_the_sandbox(sbx, e2b_server):
    _serve(sbx, 8080)
    host = sbx.get_host(8080)
    assert host.startswith(f"8080-{sbx.sandbox_id}.")
    token = sbx.traffic_access_token
    assert token
    # what a client of get_host sends: the Host name (resolved to the front) and the traffic token
    r = _get(e2b_server["url"] + "/index.html", {"Host": host, "E2B-Traffic-Access-Token": token})
    assert (r.status_code, r.text) == (200, "served from the sandbox\n")
    # the SDK's own routing (E2B_SANDBOX_URL set): the sandbox and port in headers; a body both ways
    hdr = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8080", "E2B-Traffic-Access-Token": token,
           "X-Api-Key": e2b_server["key"]}
    r = _get(e2b_server["url"] + "/cgi-bin/echo?x=1", hdr, method="POST", content=b"posted body")
    assert r.status_code == 200, r.text
    # the tokens stay in the front: the server inside sees none of them
    assert r.text == "method=POST query=x=1\nno tokens\nposted body", r.text
    # a port nothing listens on, and the envd port is never a proxied one
    r = httpx.get(e2b_server["url"] + "/", headers={"Host": sbx.get_host(8099), "E2B-Traffic-Access-Token": token})
    assert r.status_code == 502 and "not open" in r.json()["message"]


def test_a_paused_or_killed_sandbox_port_is_502(opts, e2b_server):
    s = Sandbox.create("base", timeout=60, **opts)
    _serve(s, 8080)
    hdr = {"Host": s.get_host(8080), "E2B-Traffic-Access-Token": s.traffic_access_token}
    assert _get(e2b_server["url"] + "/index.html", hdr).status_code == 200
    s.pause()
    assert httpx.get(e2b_server["url"] + "/index.html", headers=hdr).status_code == 502
    s = Sandbox.connect(s.sandbox_id, **opts)
    assert httpx.get(e2b_server["url"] + "/index.html", headers=hdr).status_code == 200  # same process, resumed
    s.kill()
    assert httpx.get(e2b_server["url"] + "/index.html", headers=hdr).status_code == 502


def _one_char_off(token: str) -> str:
    """The token with its last character changed (a fixed "0" equals it one time in 16: a flaky test)."""
    return token[:-1] + ("1" if token.endswith("0") else "0")


def test_a_tenant_cannot_reach_another_tenants_port(sbx, opts, e2b_server):
    """Hostile: bob knows alice's sandbox id and port (ids are not secret) and tries every key he has."""
    _serve(sbx, 8080)
    own = {"Host": sbx.get_host(8080), "E2B-Traffic-Access-Token": sbx.traffic_access_token}
    assert _get(e2b_server["url"] + "/index.html", own).status_code == 200
    bob = Sandbox.create("base", timeout=60, **{**opts, "api_key": e2b_server["other_key"]})
    try:
        url = e2b_server["url"] + "/index.html"
        for headers in ({}, {"E2B-Traffic-Access-Token": bob.traffic_access_token},
                        {"X-Access-Token": bob._envd_access_token}, {"X-API-KEY": e2b_server["other_key"]},
                        {"E2B-Traffic-Access-Token": _one_char_off(sbx.traffic_access_token)}):
            r = httpx.get(url, headers={"Host": sbx.get_host(8080), **headers})
            assert r.status_code == 401, (headers, r.status_code)
            r = httpx.get(url, headers={"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8080", **headers})
            assert r.status_code == 401, (headers, r.status_code)
        with pytest.raises(NotFoundException):  # nor can he get alice's tokens from the control plane
            Sandbox.connect(sbx.sandbox_id, **{**opts, "api_key": e2b_server["other_key"]})
    finally:
        bob.kill()


def test_get_host_through_shoald(daemon, root, e2b_image):
    """The front over a shoald: the port route is shoald's tunnel (the http backend's connect_port)."""
    import os

    from .conftest import start_front

    env = {**os.environ, "SHOAL_ROOT": str(root)}
    env.pop("SHOAL_URL", None)
    front = start_front(root, env, "--url", daemon["url"], "--shoal-key", daemon["admin_key"],
                        "--template", f"base={e2b_image}")
    try:
        s = Sandbox.create("base", timeout=60, api_url=front["url"], sandbox_url=front["url"], api_key=front["key"])
        try:
            _serve(s, 8080)
            hdr = {"Host": s.get_host(8080), "E2B-Traffic-Access-Token": s.traffic_access_token}
            r = _get(front["url"] + "/cgi-bin/echo", hdr, method="POST", content=b"x" * 300_000)
            assert r.status_code == 200 and r.text.endswith("x" * 300_000), r.text[:200]
        finally:
            s.kill()
    finally:
        front["proc"].terminate()
        front["proc"].wait(20)
