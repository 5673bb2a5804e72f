"""Fuzz shoald's OpenAPI spec with schemathesis, over TCP with TLS.

Every operation gets schema-valid and schema-violating requests (bodies, query strings, path
parameters, headers). The daemon must answer each with a status below 500, and every error with a
JSON body that names what is wrong. Half the requests that address a sandbox are pointed at a live
one, so the handlers behind the 404 are reached too. The daemon runs as a real subprocess, so a
crash would show as a dead process rather than as an exception in the test.
"""
from __future__ import annotations

import itertools
import os
import signal
import socket
import ssl
import subprocess
import time

import httpx
import pytest
import requests
import schemathesis
from daemonctl import log_tail, start_daemon
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from shoal.backends.http import HttpBackend
from shoal.core.contract import CreateRequest, ExecRequest
from shoal.server.app import create_app

MAX_EXAMPLES = int(os.environ.get("SHOAL_FUZZ_EXAMPLES", "50"))  # per operation and mode
FUZZ_QUOTAS = {"sandboxes": 3, "cpu": 2, "memory_mb": 1024, "disk_mb": 1024}


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _fd_kinds(pid: int) -> dict[str, int]:
    """What a process's fds point at, by kind (socket, pipe, anon_inode:[eventpoll], path)."""
    kinds: dict[str, int] = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        kind = target.split(":[")[0] if ":[" in target else target
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tls_daemon(root, base_image, tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    port = _free_port()
    proc = start_daemon(root, "--tcp", f"127.0.0.1:{port}", "--tls-cert", str(cert), "--tls-key", str(key))
    url, ctx = f"https://127.0.0.1:{port}", ssl.create_default_context(cafile=str(cert))
    deadline = time.time() + 15
    while True:  # the Unix socket answers first; wait for the TLS listener too
        try:
            httpx.get(url + "/v1/health", verify=ctx).raise_for_status()
            break
        except httpx.HTTPError:
            if time.time() > deadline:
                raise
            time.sleep(0.05)
    admin = HttpBackend(f"unix://{root / 'shoald.sock'}", "")  # root on the socket: the admin
    api_key = admin.json("POST", "/tenants", json={"name": "fuzz", "quotas": FUZZ_QUOTAS})["api_key"]
    yield {"proc": proc, "url": url, "cert": str(cert), "api_key": api_key,
           "admin": admin, "fds_at_start": _fds(proc.pid)}
    for sb in admin.list():
        admin.kill(sb.id)
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)
        time.sleep(1)
        proc.kill()
        raise AssertionError("shoald did not stop within 20 s of SIGTERM:\n" + log_tail(root)) from None


@pytest.fixture(scope="module")
def victim(tls_daemon, base_image):
    """A live sandbox of the fuzzing tenant, recreated whenever the fuzzer kills it."""
    c = httpx.Client(base_url=tls_daemon["url"], verify=ssl.create_default_context(cafile=tls_daemon["cert"]),
                     headers={"Authorization": f"Bearer {tls_daemon['api_key']}"}, timeout=30)
    state: dict = {"id": None}

    def live_id() -> str:
        if state["id"] is None or c.get(f"/v1/sandboxes/{state['id']}").status_code != 200:
            r = c.post("/v1/sandboxes", json={"image": base_image, "ttl": 600})
            if r.status_code == 201:
                state["id"] = r.json()["id"]
            else:  # the fuzzer holds the quota; any visible sandbox will do
                owned = c.get("/v1/sandboxes").json()
                state["id"] = owned[0]["id"] if owned else "sb-none"
        return state["id"]

    return live_id


# The spec is built from the same app factory the daemon serves, so operations are known at collection.
schemathesis.serializer.alias("application/x-tar", "application/octet-stream")  # tar upload: raw bytes
SPEC = create_app(None).openapi()
SCHEMA = schemathesis.openapi.from_dict(SPEC)
OPERATIONS = {f"{op.method.upper()} {op.path}": op for op in (r.ok() for r in SCHEMA.get_all_operations())}
_flip = itertools.count()


def _negatable(method: str, path: str) -> bool:
    """Whether any request violates the operation's schema (a body, a typed or bounded parameter, a
    required query); free-form string path parameters alone accept everything."""
    op = SPEC["paths"][path][method.lower()]
    if "requestBody" in op:
        return True
    for p in op.get("parameters", []):
        schema = p.get("schema", {})
        if (p.get("in") == "query" and p.get("required")) or schema.get("type", "string") != "string" or \
                set(schema) & {"enum", "minimum", "maximum", "pattern", "maxLength", "minLength", "format", "anyOf"}:
            return True
    return False


CASES = [(name, mode) for name in sorted(OPERATIONS) for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
         if mode == GenerationMode.POSITIVE or _negatable(*name.split(" ", 1))]


@pytest.mark.parametrize(("operation", "mode"), CASES, ids=[f"{n}-{m.value}" for n, m in CASES])
def test_fuzzed_requests_get_4xx_with_a_message_never_500(operation, mode, tls_daemon, victim):
    op = OPERATIONS[operation]
    session = requests.Session()  # one keep-alive connection, as a real client would use
    session.headers["Authorization"] = f"Bearer {tls_daemon['api_key']}"
    session.verify = tls_daemon["cert"]

    @given(case=op.as_strategy(generation_mode=mode))
    @settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
              derandomize=True, database=None)
    def check(case):
        if case.path_parameters and "sandbox_id" in case.path_parameters and next(_flip) % 2 == 0:
            case.path_parameters["sandbox_id"] = victim()
        _call_and_check(case, session, session.headers["Authorization"], tls_daemon)

    try:
        with session:
            check()
    except Unsatisfiable:
        # e.g. an operation whose only input is a free-form string path parameter: nothing violates it
        assert mode == GenerationMode.NEGATIVE
        pytest.skip(f"{operation}: the schema admits no invalid input")


def _call_and_check(case, session, auth: str, tls_daemon):
    """Send one fuzzed request; no 5xx, every error carries a message, shoald still alive."""
    resp = case.call(base_url=tls_daemon["url"], session=session, verify=tls_daemon["cert"], timeout=60,
                     headers={"Authorization": auth})
    where = (f"{case.method} {case.formatted_path} -> {resp.status_code}: {resp.text[:300]}\n"
             f"{case.as_curl_command()[:2000]}")
    # 501 is a typed answer, not a crash: the host cannot do this at all (e.g. reclaim with no swap area)
    deliberate = resp.status_code == 501 and resp.json().get("error", {}).get("type") in (
        "BackendUnavailable", "NotSupported")
    assert resp.status_code < 500 or deliberate, where
    if resp.status_code >= 400:
        message = resp.json().get("error", {}).get("message")
        assert isinstance(message, str) and message, where
    assert tls_daemon["proc"].poll() is None, "shoald died"
    return resp, where


ADMIN_CASES = [(name, mode) for name, mode in CASES if name.split(" ", 1)[1].startswith("/v1/tenants")]


@pytest.fixture(scope="module")
def admin_victim(tls_daemon):
    """A scratch tenant for the admin routes' {name}, recreated whenever the fuzzer deletes it."""
    admin = tls_daemon["admin"]

    def live_name() -> str:
        if not any(t["name"] == "admin-victim" for t in admin.json("GET", "/tenants")):
            admin.json("POST", "/tenants", json={"name": "admin-victim"})
        return "admin-victim"

    return live_name


@pytest.mark.parametrize(("operation", "mode"), ADMIN_CASES, ids=[f"admin-{n}-{m.value}" for n, m in ADMIN_CASES])
def test_fuzzed_admin_requests_with_the_admin_key_never_500(operation, mode, root, tls_daemon, admin_victim):
    """The tenant key above only reaches the admin routes' 401; here the same fuzzing runs with the
    admin key, so the handlers behind it (tenant create/list/quotas/delete) get the input too."""
    assert ADMIN_CASES, "no admin operations found in the spec"
    op = OPERATIONS[operation]
    auth = f"Bearer {(root / 'admin.key').read_text().strip()}"
    session = requests.Session()
    session.verify = tls_daemon["cert"]
    seen: dict[int, int] = {}

    @given(case=op.as_strategy(generation_mode=mode))
    @settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
              derandomize=True, database=None)
    def check(case):
        # never the tenant the other fuzz tests run as; half the time a tenant that exists
        if case.path_parameters and "name" in case.path_parameters and \
                (next(_flip) % 2 == 0 or case.path_parameters["name"] == "fuzz"):
            case.path_parameters["name"] = admin_victim()
        resp, where = _call_and_check(case, session, auth, tls_daemon)
        seen[resp.status_code] = seen.get(resp.status_code, 0) + 1
        assert resp.status_code not in (401, 403), where  # the admin key is accepted: the handler ran

    try:
        with session:
            check()
    except Unsatisfiable:
        assert mode == GenerationMode.NEGATIVE
        pytest.skip(f"{operation}: the schema admits no invalid input")
    if mode == GenerationMode.POSITIVE:
        assert any(code < 300 for code in seen), f"{operation}: no valid request succeeded: {seen}"
    # the fuzzing tenant still works
    c = httpx.Client(base_url=tls_daemon["url"], verify=ssl.create_default_context(cafile=tls_daemon["cert"]),
                     headers={"Authorization": f"Bearer {tls_daemon['api_key']}"})
    assert c.get("/v1/sandboxes").status_code == 200


def test_daemon_survived_the_fuzzing_and_the_http_backend_works_over_tls(tls_daemon, base_image, monkeypatch):
    assert tls_daemon["proc"].poll() is None
    monkeypatch.setenv("SHOAL_CA_CERT", tls_daemon["cert"])
    for sb in tls_daemon["admin"].list():
        tls_daemon["admin"].kill(sb.id)
    # whatever the fuzzer opened (sessions, background commands, connections) was released
    time.sleep(6)  # sandboxes the fuzzer gave a short TTL died on their own: the reaper runs every 5 s
    fds = _fds(tls_daemon["proc"].pid)
    start = tls_daemon["fds_at_start"]
    assert fds <= start + 16, f"{fds} fds vs {start} at start: {_fd_kinds(tls_daemon['proc'].pid)}"
    be = HttpBackend(tls_daemon["url"], tls_daemon["api_key"])
    sid = be.create(CreateRequest(image=base_image)).id
    try:
        assert be.exec(sid, ExecRequest(argv=["echo", "over-tls"])).stdout == "over-tls\n"
    finally:
        be.kill(sid)
    # over TCP a request without a key is refused, whoever sends it (no peer credentials there)
    r = httpx.get(tls_daemon["url"] + "/v1/sandboxes", verify=ssl.create_default_context(cafile=tls_daemon["cert"]))
    assert r.status_code == 401 and r.json()["error"]["type"] == "Unauthorized"
    # plain HTTP to the TLS port, and a client that does not trust the certificate, are refused
    with pytest.raises(httpx.HTTPError):
        httpx.get(tls_daemon["url"] + "/v1/health", verify=True)
    with pytest.raises(httpx.HTTPError):
        httpx.get(tls_daemon["url"].replace("https", "http") + "/v1/health")
