"""The CLI's fast path (shoal.cli_fast): `shoal run` / `shoal exec` through a real shoald.

Behaviour only (timing lives in bench/startup.py): the daemon is used when it runs, the hot path
imports none of the heavy modules, its wire bodies are valid for the daemon's own models, its
results equal the SDK's, and without a daemon (or with --in-process) the full CLI runs in-process."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from shoal import cli_fast
from shoal.backends import LOCAL
from shoal.backends.http import HttpBackend
from shoal.config import DEFAULT_SOCKET
from shoal.core.contract import CreateRequest, ExecRequest, ExecResult, SandboxInfo
from shoal.sdk.sandbox import Sandbox

FAST = [sys.executable, "-m", "shoal.cli_fast"]  # what the `shoal` script runs (entry point cli_fast:main)


def _env(root) -> dict:
    """The CLI pointed at the test daemon's private socket (the `daemon` fixture's)."""
    return dict(os.environ, SHOAL_ROOT=str(root), SHOAL_URL=f"unix://{root / 'shoald.sock'}")


def _creates(client: HttpBackend) -> int:
    text = client.http.get("/metrics").text
    return int(next(x.split()[1] for x in text.splitlines() if x.startswith("shoal_creates_total ")))


# ------------------------------------------------------------------------------------------ argv
def test_parse_run_and_exec():
    cmd, o = cli_fast.parse(["run", "-l", "a", "--layer=b", "--memory-mb", "64", "--cpu=0.5", "--disk-mb", "32",
                             "--ttl", "30", "--timeout", "5", "-d", "--root", "/r", "img:1", "--", "sh", "-c",
                             "echo --root x"])
    assert cmd == "run" and o["target"] == "img:1" and o["cmd"] == ["sh", "-c", "echo --root x"]
    assert (o["layers"], o["memory_mb"], o["cpu"], o["disk_mb"], o["ttl"], o["timeout"], o["detach"], o["root"]) \
        == (["a", "b"], 64, 0.5, 32, 30.0, 5.0, True, "/r")
    cmd, o = cli_fast.parse(["exec", "sb-x", "--timeout", "2", "--", "true"])
    assert (cmd, o["target"], o["cmd"], o["timeout"]) == ("exec", "sb-x", ["true"], 2.0)
    assert cli_fast.parse(["run", "img"])[1]["cmd"] == []  # the default command, as the full CLI


@pytest.mark.parametrize("argv", [
    [], ["ps"], ["layer", "ls"], ["run", "--help"], ["run", "--bogus", "img", "--", "true"],
    ["run", "img", "true"],  # no `--`: click's rules decide, so the full CLI does
    ["run", "--memory-mb", "lots", "img", "--", "true"], ["run", "--", "true"], ["exec", "sb-x"],
    ["run", "-d=1", "img"], ["run", "img", "--cpu"], ["exec", "--in-process", "sb-x", "--", "true"],
])
def test_anything_else_goes_to_the_full_cli(argv):
    with pytest.raises(cli_fast.Fallback):
        cli_fast.try_fast(argv)


def test_socket_resolution(monkeypatch):
    """The fast path goes where the SDK goes: $SHOAL_URL's socket, else the host daemon's."""
    assert (cli_fast.DEFAULT_SOCKET, cli_fast.LOCAL) == (str(DEFAULT_SOCKET), LOCAL)
    monkeypatch.delenv("SHOAL_URL", raising=False)
    assert cli_fast.socket_path() == "/run/shoal/shoald.sock"
    monkeypatch.setenv("SHOAL_URL", "unix:///x/y.sock")
    assert cli_fast.socket_path() == "/x/y.sock"
    for url in ("local", "https://h:8443"):
        monkeypatch.setenv("SHOAL_URL", url)
        assert cli_fast.socket_path() is None


def test_stale_socket_falls_back(tmp_path, monkeypatch):
    """A socket file with nothing listening (a daemon that died) goes to the SDK, which names the problem."""
    monkeypatch.setenv("SHOAL_URL", f"unix://{tmp_path / 'shoald.sock'}")
    assert cli_fast.daemon_connection({}) is None  # no socket at all
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(tmp_path / "shoald.sock"))
    s.close()
    assert cli_fast.daemon_connection({}) is None


def test_no_daemon_runs_in_process_without_typer(root, base_image):
    """Asked for in-process: the sandbox runs here, and still without typer, rich or click."""
    env = dict(_env(root), SHOAL_URL=LOCAL)  # `exec` has no --in-process: SHOAL_URL=local says it
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "shoal.cli_fast", "run", "--in-process", "-d",
                        "--memory-mb", "96", base_image], env=env, capture_output=True, text=True)
    sid = r.stdout.strip()
    assert r.returncode == 0 and sid.startswith("sb-"), r.stderr[-2000:]
    mods = {line.split("|")[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "shoal.sdk.sandbox" in mods
    assert not {m for m in mods if m.split(".")[0] in ("typer", "rich", "click")}
    sb = Sandbox.connect(sid, root=root)
    assert sb.info().limits.memory_mb == 96
    r = subprocess.run(FAST + ["exec", "--root", str(root), sid, "--", "sh", "-c", "echo $((6*7)); exit 3"],
                       env=env, capture_output=True, text=True)
    assert (r.stdout, r.returncode) == ("42\n", 3)
    sb.kill()
    r = subprocess.run(FAST + ["run", "--in-process", "no-such:1", "--", "true"], env=env, capture_output=True,
                       text=True)
    assert r.returncode == 2 and r.stderr.startswith("error:") and "no-such:1" in r.stderr


def test_memory_cgroup_flag_reaches_the_sandbox(root, base_image):
    """`--memory-cgroup pooled` (docs/density.md) on the CLI: the sandbox is pooled; a bad value is a
    clear error naming the field, and makes no sandbox."""
    env = dict(_env(root), SHOAL_URL=LOCAL)
    r = subprocess.run(FAST + ["run", "--in-process", "-d", "--memory-cgroup", "pooled", base_image], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    sb = Sandbox.connect(r.stdout.strip(), root=root)
    try:
        assert sb.info().limits.memory_cgroup == "pooled"
    finally:
        sb.kill()
    r = subprocess.run(FAST + ["run", "--in-process", "-d", "--memory-cgroup", "shared", base_image], env=env,
                       capture_output=True, text=True)
    assert r.returncode != 0 and "memory_cgroup" in r.stderr, r.stderr[-2000:]
    assert not Sandbox.list(root=root)


@pytest.mark.parametrize("value", [
    {"id": "sb-x", "limits": {"cpu": 0.5, "memory_mb": 64}, "layers": [], "ttl": None, "ok": True},
    "caf\u00e9 \u20ac \ud83d\ude00 \\ \"q\" \n\t\x00", [1, -2, 3.25, 1e300, -0.0, 10**20, False], {},
    {"error": {"type": "ImageNotFound", "message": "image x:1 not found", "retryable": False}},
])
def test_json_matches_the_json_module(value):
    """cli_fast's JSON (the C scanner/encoder without `re`) is json.loads / json.dumps."""
    assert cli_fast.dumps(value) == json.dumps(value)
    for text in (json.dumps(value), json.dumps(value, indent=2, ensure_ascii=False) + "\n"):
        assert cli_fast.loads(text) == json.loads(text)


@pytest.mark.parametrize("text", ["", "nope", "{\"a\": 1} x", "{\"a\": }"])
def test_json_rejects_what_json_rejects(text):
    with pytest.raises(ValueError):
        json.loads(text)
    with pytest.raises(ValueError):
        cli_fast.loads(text)


# ------------------------------------------------------------------------------------------ schema
def test_bodies_are_valid_for_the_daemon_models():
    """One source of truth for the wire schema: what the fast path sends, the daemon's models accept
    field for field, and what it reads, the models define."""
    _, o = cli_fast.parse(["run", "-l", "extra", "--memory-mb", "64", "--cpu", "0.5", "--disk-mb", "32",
                           "--ttl", "30", "--timeout", "5", "--memory-cgroup", "pooled", "img:1", "--", "sh",
                           "-c", "exit 3"])
    body = cli_fast.create_body(o)
    assert set(body) <= set(CreateRequest.model_fields)
    assert CreateRequest.model_validate(body).model_dump(exclude_unset=True) == body
    body = cli_fast.exec_body(o)
    assert set(body) <= set(ExecRequest.model_fields)
    assert ExecRequest.model_validate(body).model_dump(exclude_unset=True) == body
    _, o = cli_fast.parse(["run", "img"])
    assert CreateRequest.model_validate(cli_fast.create_body(o)).image == "img"
    assert ExecRequest.model_validate(cli_fast.exec_body(o)).argv == ["/bin/sh", "-c", "true"]
    assert "id" in SandboxInfo.model_fields and "exit_code" in ExecResult.model_fields


@pytest.mark.parametrize("cmd", [
    "echo out; echo err >&2; exit 3",
    "printf 'caf\\303\\251 \\342\\202\\254\\n'; printf 'no newline'",
    "i=0; while [ $i -lt 2000 ]; do echo line-$i; echo e-$i >&2; i=$((i+1)); done",
    "kill -9 $$",
    "head -c 3000000 /dev/zero | tr '\\0' x",  # beyond the 1 MiB output cap
])
def test_fast_path_and_sdk_agree(daemon, base_image, cmd):
    """The same command through the fast path's HTTP + SSE parsing and through the SDK (httpx)."""
    conn = cli_fast.Connection(str(daemon["sock"]))
    _, o = cli_fast.parse(["run", base_image, "--", "sh", "-c", cmd])
    sid = conn.call("POST", "/v1/sandboxes", cli_fast.create_body(o))["id"]
    try:
        out: list[str] = []
        err: list[str] = []
        fast = ExecResult.model_validate(cli_fast.stream_exec(conn, sid, cli_fast.exec_body(o), out.append,
                                                              err.append))
        sdk = Sandbox.connect(sid, url=daemon["url"]).commands.run(["sh", "-c", cmd])
    finally:
        conn.call("DELETE", f"/v1/sandboxes/{sid}")
        conn.close()
    assert fast.model_dump(exclude={"duration_s"}) == sdk.model_dump(exclude={"duration_s"})
    if not fast.stdout_truncated:
        assert "".join(out) == fast.stdout and "".join(err) == fast.stderr


# ------------------------------------------------------------------------------------------ end to end
def test_run_goes_through_the_daemon(daemon, base_image, root):
    client = HttpBackend(daemon["url"], "")
    before, live = _creates(client), {i.id for i in client.list()}
    r = subprocess.run(FAST + ["run", base_image, "--", "sh", "-c", "echo from-daemon; echo e >&2; exit 4"],
                       env=_env(root), capture_output=True, text=True)
    assert (r.stdout, r.stderr, r.returncode) == ("from-daemon\n", "e\n", 4)
    assert _creates(client) == before + 1
    assert {i.id for i in client.list()} <= live  # and removed afterwards


def test_detach_exec_and_kill_through_the_daemon(daemon, base_image, root):
    env = _env(root)
    client = HttpBackend(daemon["url"], "")
    before = _creates(client)
    sid = subprocess.run(FAST + ["run", "-d", "--memory-mb", "96", "--ttl", "120", base_image], env=env,
                         capture_output=True, text=True).stdout.strip()
    assert sid.startswith("sb-") and _creates(client) == before + 1
    info = Sandbox.connect(sid, url=daemon["url"]).info()
    assert info.limits.memory_mb == 96 and info.ttl == 120
    r = subprocess.run(FAST + ["exec", sid, "--", "hostname"], env=env, capture_output=True, text=True)
    assert (r.stdout.strip(), r.returncode) == (sid, 0)
    r = subprocess.run(FAST + ["exec", "--timeout", "0.3", sid, "--", "sleep", "5"], env=env, capture_output=True,
                       text=True)
    assert r.returncode != 0  # timed out: killed, as in-process
    assert subprocess.run(FAST + ["kill", sid], env=env, capture_output=True).returncode == 0
    r = subprocess.run(FAST + ["exec", sid, "--", "true"], env=env, capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("error:") and "killed" in r.stderr


def test_quote_is_urllib_quote():
    from urllib.parse import quote

    for seg in ("sb-host-0123abcd", "a b/c?d#e%f", "x\r\nHost: evil", "caf\u00e9", "\udcff", ""):
        assert cli_fast.quote(seg) == quote(seg, safe="", errors="surrogateescape")


def test_daemon_errors_are_one_line_and_status_2(daemon, base_image, root):
    r = subprocess.run(FAST + ["run", "no-such-image:9", "--", "true"], env=_env(root), capture_output=True,
                       text=True)
    assert r.returncode == 2 and r.stderr.startswith("error:") and "no-such-image:9" in r.stderr
    assert "Traceback" not in r.stderr
    r = subprocess.run(FAST + ["exec", "sb-x/../../health?x=\r\nA: b", "--", "true"], env=_env(root),
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("error:") and "not found" in r.stderr.lower(), r.stderr
    for bad in ("-5", "0"):
        r = subprocess.run(FAST + ["run", "--memory-mb", bad, base_image, "--", "true"], env=_env(root),
                           capture_output=True, text=True)
        assert r.returncode == 2 and "memory_mb" in r.stderr


def test_in_process_flag_bypasses_the_daemon(daemon, base_image, root):
    client = HttpBackend(daemon["url"], "")
    before = _creates(client)
    r = subprocess.run(FAST + ["run", "--in-process", base_image, "--", "sh", "-c", "echo here; exit 5"],
                       env=_env(root), capture_output=True, text=True)
    assert (r.stdout, r.returncode) == ("here\n", 5)
    assert _creates(client) == before


def test_hot_path_imports_no_heavy_modules(daemon, base_image, root):
    """`python -X importtime`: the daemon path loads none of typer, rich, pydantic, httpx, the host
    or the SDK (what made `shoal run` slower than `docker run`)."""
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "shoal.cli_fast", "run", base_image, "--", "true"],
                       env=_env(root), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    mods = {line.split("|")[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "shoal.cli_fast" in mods or "shoal" in mods
    heavy = {m for m in mods if m.split(".")[0] in ("typer", "rich", "pydantic", "httpx", "fastapi", "click",
                                                    "http", "email", "typing", "json", "socket", "re",
                                                    "enum")
             or m == "shoal.cli" or m.startswith(("shoal.host", "shoal.sdk", "shoal.runtime", "shoal.layers"))}
    assert not heavy, sorted(heavy)


def test_full_cli_run_uses_the_daemon_too(daemon, base_image, root):
    """argv the fast parser leaves to typer (no `--`) still runs through the daemon: one dispatch."""
    client = HttpBackend(daemon["url"], "")
    before = _creates(client)
    r = subprocess.run(FAST + ["run", base_image, "echo", "via-typer"], env=_env(root), capture_output=True,
                       text=True)
    assert (r.stdout, r.returncode) == ("via-typer\n", 0), r.stderr
    assert _creates(client) == before + 1


def test_module_main_and_full_cli_still_work(root, base_image):
    """`python -m shoal.cli` enters through the fast path's main; other commands reach typer."""
    env = _env(root)
    r = subprocess.run([sys.executable, "-m", "shoal.cli", "image", "ls"], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and base_image.split(":")[0] in r.stdout
    r = subprocess.run(FAST + ["run", "--help"], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and "--in-process" in r.stdout
    r = subprocess.run(FAST + ["ps", "--json"], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and isinstance(json.loads(r.stdout), list)


def test_reader_going_away_removes_the_sandbox(daemon, base_image, root):
    """`shoal run … | head`: no traceback, SIGPIPE's status, and the sandbox is removed."""
    client = HttpBackend(daemon["url"], "")
    live = {i.id for i in client.list()}
    p = subprocess.Popen(FAST + ["run", base_image, "--", "sh", "-c", "yes | head -c 20000000"], env=_env(root),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.read(4) == b"y\ny\n"
    p.stdout.close()
    err = p.stderr.read().decode() if p.stderr else ""
    assert p.wait(60) == 141 and "Traceback" not in err
    assert {i.id for i in client.list()} <= live
