"""shoald's API through the SDK: same classes, same errors, tenants isolated, quotas enforced."""
from __future__ import annotations

import time

import httpx
import pytest

from shoal import ImageNotFound, InvalidArgument, QuotaExceeded, Sandbox, SandboxNotFound
from shoal.core.errors import SandboxError, Unauthorized
from shoal.sdk.remote import Client, RemoteSandbox

from daemonctl import start_daemon


def test_remote_sandbox_has_the_same_surface(daemon, base_image):
    with Sandbox.create(base_image, url=daemon["url"], memory_mb=128, ttl=300) as sb:
        assert isinstance(sb, RemoteSandbox) and isinstance(sb, Sandbox)
        assert sb.id.startswith("sb-")
        r = sb.commands.run("echo hi; echo err >&2; exit 3", env={"A": "1"})
        assert (r.stdout, r.stderr, r.exit_code) == ("hi\n", "err\n", 3)
        assert sb.commands.run("cat", stdin=b"\x00\x01binary").stdout == "\x00\x01binary"
        seen = []
        r = sb.commands.run("for i in 1 2 3; do echo $i; done", on_stdout=seen.append)
        assert "".join(seen) == "1\n2\n3\n" == r.stdout
        assert sb.commands.run("sleep 5", timeout=0.3).timed_out
        sb.files.write("/work/x.txt", "remote file")
        assert sb.files.read("/work/x.txt") == "remote file"
        assert [e.name for e in sb.files.list("/work")] == ["x.txt"]
        assert sb.files.stat("/work/x.txt").size == 11
        tar = sb.files.download("/work")
        sb.files.upload("/copy", tar)
        assert sb.files.read("/copy/work/x.txt") == "remote file"
        h = sb.commands.start("echo bg; sleep 0.2; echo done")
        assert h.wait(10).stdout == "bg\ndone\n"
        with sb.sessions.create() as s:
            s.run("cd /tmp; export V=7")
            assert s.run("pwd; echo $V").stdout == "/tmp\n7\n"
        sb.pause()
        assert sb.info().state.value == "paused"
        sb.resume()
        sb.set_timeout(ttl=None, idle_ttl=None)
        assert sb.info().ttl is None
        snap = sb.snapshot()
        res = sb.fork(2)
        assert res.ok and all(isinstance(c, RemoteSandbox) for c in res.sandboxes)
        assert res.sandboxes[0].files.read("/work/x.txt") == "remote file"
        res.kill_all()
        with Sandbox.create(from_snapshot=snap.id, url=daemon["url"]) as restored:
            assert restored.files.read("/work/x.txt") == "remote file"


def test_remote_errors_are_the_same_types(daemon, base_image):
    url = daemon["url"]
    with pytest.raises(ImageNotFound, match="nope"):
        Sandbox.create("nope:1", url=url)
    with pytest.raises(SandboxNotFound):
        Sandbox.connect("sb-none-000000000000", url=url)
    with pytest.raises(InvalidArgument):
        Sandbox.create(base_image, url=url, memory_mb=-5)
    with Sandbox.create(base_image, url=url) as sb:
        sid = sb.id
        with pytest.raises(InvalidArgument, match="NUL"):
            sb.commands.run(["echo", "a\0b"])
    with pytest.raises(SandboxNotFound, match="killed"):
        Sandbox.connect(sid, root=daemon["root"], url="embedded").commands.run("true")


def test_tenants_cannot_see_each_other(daemon, tenants, base_image):
    url = daemon["url"]
    a = Sandbox.create(base_image, url=url, api_key=tenants["tenant-a"])
    try:
        b_client = Client(url, tenants["tenant-b"])
        for method, path in (("GET", f"/v1/sandboxes/{a.id}"), ("DELETE", f"/v1/sandboxes/{a.id}"),
                             ("POST", f"/v1/sandboxes/{a.id}/pause")):
            with pytest.raises(SandboxNotFound):  # 404, not 403: existence is not confirmed
                b_client.call(method, path)
        assert a.id not in [i.id for i in Sandbox.list(url=url, api_key=tenants["tenant-b"])]
        assert a.id in [i.id for i in Sandbox.list(url=url, api_key=tenants["tenant-a"])]
        snap = a.snapshot()
        with pytest.raises(ImageNotFound):
            Sandbox.create(from_snapshot=snap.id, url=url, api_key=tenants["tenant-b"])
        assert not any(i["ref"].startswith("snapshots/") for i in b_client.json("GET", "/v1/images"))
        assert a.commands.run("echo mine").stdout == "mine\n"
    finally:
        a.kill()


def test_auth_is_required_and_checked(daemon, tenants):
    with pytest.raises(Unauthorized):
        Client(daemon["url"], "sk-wrong").json("GET", "/v1/sandboxes")
    with pytest.raises(Unauthorized):
        Client(daemon["url"], tenants["tenant-a"]).json("GET", "/v1/tenants")  # admin only
    raw = httpx.Client(transport=httpx.HTTPTransport(uds=str(daemon["sock"])), base_url="http://x",
                       headers={"Authorization": "Bearer sk-wrong"})
    r = raw.get("/v1/sandboxes")
    assert r.status_code == 401 and r.json()["error"]["type"] == "Unauthorized"
    admin = Client(daemon["url"], daemon["admin_key"])
    assert {t["name"] for t in admin.json("GET", "/v1/tenants")} >= {"tenant-a", "tenant-b"}


def test_tenant_quota_is_enforced(daemon, tenants, base_image):
    url, key = daemon["url"], tenants["tenant-b"]
    made = []
    try:
        for _ in range(5):
            made.append(Sandbox.create(base_image, url=url, api_key=key, memory_mb=64))
        with pytest.raises(QuotaExceeded, match="sandboxes") as e:
            Sandbox.create(base_image, url=url, api_key=key, memory_mb=64)
        assert e.value.retryable
        made.pop().kill()
        with pytest.raises(QuotaExceeded, match="memory_mb"):
            Sandbox.create(base_image, url=url, api_key=key, memory_mb=5000)
    finally:
        for sb in made:
            sb.kill()


def test_concurrent_creates_cannot_overrun_a_quota(daemon, base_image):
    from concurrent.futures import ThreadPoolExecutor

    admin = Client(daemon["url"])
    key = admin.json("POST", "/v1/tenants", json={"name": "tenant-race", "quotas": {"sandboxes": 2}})["api_key"]

    def create(_):
        try:
            return Sandbox.create(base_image, url=daemon["url"], api_key=key, memory_mb=64)
        except QuotaExceeded:
            return None

    with ThreadPoolExecutor(8) as pool:
        made = [sb for sb in pool.map(create, range(8)) if sb]
    try:
        assert len(made) == 2  # each create reserves its share before starting, so exactly the quota
    finally:
        for sb in made:
            sb.kill()


def test_sandbox_whose_host_processes_died_is_reaped_and_frees_its_quota(daemon, base_image):
    """kill -9 of a sandbox's supervisor and init leaves a state dir; the daemon's reaper clears it."""
    import json
    import os
    import signal

    admin = Client(daemon["url"])
    key = admin.json("POST", "/v1/tenants", json={"name": "tenant-reap", "quotas": {"sandboxes": 1}})["api_key"]
    sb = Sandbox.create(base_image, url=daemon["url"], api_key=key)
    state = daemon["root"] / "sandboxes" / sb.id
    meta = json.loads((state / "meta.json").read_text())
    os.kill(meta["sup_pid"], signal.SIGKILL)  # no supervisor left to clean up...
    os.kill(meta["init_pid"], signal.SIGKILL)
    time.sleep(0.5)
    assert state.exists()  # ...so the state dir (and its cgroups and tmpfs) stay behind
    deadline = time.time() + 15
    while state.exists() and time.time() < deadline:
        time.sleep(0.2)
    assert not state.exists()
    assert not any(str(state) in line for line in open("/proc/self/mountinfo"))
    with Sandbox.create(base_image, url=daemon["url"], api_key=key) as again:  # the quota is free again
        assert again.commands.run("echo ok").stdout == "ok\n"


def test_ttl_update_replaces_both_fields(daemon, base_image):
    with Sandbox.create(base_image, url=daemon["url"], ttl=100, idle_ttl=50) as sb:
        c = sb._c
        info = c.json("PUT", f"/v1/sandboxes/{sb.id}/timeout", json={"ttl": 30})
        assert info["ttl"] == 30 and info["idle_ttl"] is None  # omitted = cleared, not kept


def test_bad_input_gets_4xx_with_a_message(daemon, base_image):
    raw = httpx.Client(transport=httpx.HTTPTransport(uds=str(daemon["sock"])), base_url="http://x")
    for method, path, kw in (("POST", "/v1/sandboxes", {"json": {"image": 5}}),
                             ("POST", "/v1/sandboxes", {"content": b"{not json"}),
                             ("POST", "/v1/sandboxes", {"json": {"image": base_image, "cpu": -1}}),
                             ("GET", "/v1/sandboxes/..%2f..%2fetc", {}),
                             ("POST", "/v1/sandboxes/sb-x/exec", {"json": {"cmd": []}}),
                             ("PUT", "/v1/tenants/ghost/quotas", {"json": {"sandboxes": 0}}),
                             ("POST", "/v1/tenants", {"json": {"name": "Bad Name!"}})):
        r = raw.request(method, path, **kw)
        assert 400 <= r.status_code < 500, (path, r.status_code, r.text)
        assert r.json()["error"]["message"]


def test_health_metrics_and_openapi(daemon):
    raw = httpx.Client(transport=httpx.HTTPTransport(uds=str(daemon["sock"])), base_url="http://x")
    assert raw.get("/v1/health").json()["ok"]
    m = raw.get("/metrics").text
    assert "shoal_sandboxes " in m and "shoal_requests_total" in m
    spec = raw.get("/openapi.json").json()
    assert "/v1/sandboxes/{sandbox_id}/exec" in spec["paths"]


def test_daemon_socket_is_root_only_and_invisible_inside(daemon, base_image):
    import os
    import stat

    assert stat.S_IMODE(os.stat(daemon["sock"]).st_mode) == 0o600
    with Sandbox.create(base_image, url=daemon["url"]) as sb:
        r = sb.commands.run("find / -name 'shoald*' 2>/dev/null; ls /var/lib 2>/dev/null")
        assert "shoald" not in r.stdout


def test_daemon_restart_reattaches_live_sandboxes(daemon, base_image):
    import signal

    url = daemon["url"]
    sb = Sandbox.create(base_image, url=url)
    sb.files.write("/state", "kept")
    proc = daemon["proc"]
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    with pytest.raises(SandboxError, match="unreachable") as e:  # a retryable error while it is down
        sb.commands.run("true")
    assert getattr(e.value, "retryable", False)
    daemon["proc"] = start_daemon(daemon["root"])
    again = Sandbox.connect(sb.id, url=url)
    assert again.files.read("/state") == "kept"  # the sandbox survived the daemon's crash
    assert again.commands.run("echo back").stdout == "back\n"
    again.kill()


def test_network_update_replaces_rules_through_the_api(daemon, base_image):
    with Sandbox.create(base_image, url=daemon["url"]) as sb:
        first = sb.set_network(allow=["10.202.0.2:8080"])
        assert first["allow"] == ["10.202.0.2:8080"]
        second = sb._c.json("PUT", f"/v1/sandboxes/{sb.id}/network", json={"presets": {}})
        assert second["allow"] == [] and second["resolved"] == []  # omitted = cleared
        with pytest.raises(InvalidArgument):
            sb._c.call("PUT", f"/v1/sandboxes/{sb.id}/network", json={"allow": ["nonsense"]})


def test_kill_9_under_load_gives_retryable_errors_and_leaks_nothing(daemon, base_image):
    """Bounded load (40 sandboxes, 8 clients, ~6 s) with the daemon SIGKILLed in the middle."""
    import signal
    import threading

    from shoal import ShoalError

    url, root = daemon["url"], daemon["root"]
    held = [Sandbox.create(base_image, url=url, memory_mb=64, disk_mb=16) for _ in range(40)]
    stop = time.monotonic() + 6
    stats = {"ok": 0, "retryable": 0, "other": []}
    lock = threading.Lock()

    def churn(k: int):
        i = k
        while time.monotonic() < stop:
            sb = held[i % len(held)]
            i += 7
            try:
                out = sb.commands.run("echo $HOSTNAME", timeout=10).stdout.strip()
                with lock:
                    if out == sb.id:
                        stats["ok"] += 1
                    else:
                        stats["other"].append(f"wrong output {out!r} from {sb.id}")
            except ShoalError as e:
                with lock:
                    if e.retryable:
                        stats["retryable"] += 1
                    else:
                        stats["other"].append(repr(e))
                time.sleep(0.05)

    threads = [threading.Thread(target=churn, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    time.sleep(2)
    daemon["proc"].send_signal(signal.SIGKILL)
    daemon["proc"].wait(10)
    time.sleep(0.5)
    daemon["proc"] = start_daemon(root)
    for t in threads:
        t.join()
    assert stats["ok"] > 100 and stats["retryable"] > 0 and stats["other"] == []
    # every sandbox survived the crash and is served by the new daemon
    assert all(sb.commands.run("echo up").stdout == "up\n" for sb in held)
    for sb in held:
        sb.kill()
    assert not any(str(root / "sandboxes") in line for line in open("/proc/self/mountinfo"))
    assert not [p for p in (root / "sandboxes").iterdir()]


def _daemon_fds(daemon) -> int:
    import os

    return len(os.listdir(f"/proc/{daemon['proc'].pid}/fd"))


def test_sessions_and_background_commands_are_capped_per_sandbox(daemon, base_image):
    """A client opening sessions or background commands in a loop hits a 429, not the daemon's fd limit."""
    c = Client(daemon["url"])
    fds_before = _daemon_fds(daemon)
    sb = Sandbox.create(base_image, url=daemon["url"])
    try:
        p = f"/v1/sandboxes/{sb.id}"
        sessions = [c.json("POST", f"{p}/sessions")["id"] for _ in range(16)]
        with pytest.raises(QuotaExceeded, match="16 live sessions"):
            c.json("POST", f"{p}/sessions")
        c.call("DELETE", f"{p}/sessions/{sessions[0]}")
        c.json("POST", f"{p}/sessions")  # closing one made room
        running = [c.json("POST", f"{p}/commands", json={"cmd": "sleep 300"})["id"] for _ in range(64)]
        with pytest.raises(QuotaExceeded, match="64 live background commands"):
            c.json("POST", f"{p}/commands", json={"cmd": "true"})
        # a finished command is forgotten to make room; a running one never is
        c.call("POST", f"{p}/commands/{running[0]}/kill")
        deadline = time.time() + 10
        while c.json("GET", f"{p}/commands/{running[0]}")["exit_code"] is None and time.time() < deadline:
            time.sleep(0.05)
        new = c.json("POST", f"{p}/commands", json={"cmd": "echo hi"})["id"]
        with pytest.raises(SandboxNotFound):
            c.json("GET", f"{p}/commands/{running[0]}")
        assert c.json("GET", f"{p}/commands/{running[1]}")["exit_code"] is None
        c.call("DELETE", f"{p}/commands/{new}")
        with pytest.raises(SandboxNotFound):
            c.json("GET", f"{p}/commands/{new}")
        assert _daemon_fds(daemon) > fds_before + 64  # each live handle holds host fds...
    finally:
        sb.kill()
    time.sleep(0.5)
    assert _daemon_fds(daemon) <= fds_before + 8  # ...and killing the sandbox released all of them
