"""shoald through the HTTP backend: the whole contract, the same error classes, tenants isolated,
quotas and caps enforced, and a daemon crash survived."""
from __future__ import annotations

import grp
import io
import json
import os
import signal
import stat
import tarfile
import threading
import time

import httpx
import pytest
from daemonctl import start_daemon

from shoal.backends.http import HttpBackend
from shoal.core.contract import (
    CreateRequest,
    ExecRequest,
    ForkRequest,
    NetworkRequest,
    SessionRequest,
    SnapshotRequest,
    StartRequest,
    TimeoutRequest,
)
from shoal.core.errors import (
    CommandTimeout,
    FileOpError,
    ImageNotFound,
    InvalidArgument,
    QuotaExceeded,
    SandboxError,
    SandboxNotFound,
    ShoalError,
    Unauthorized,
)

from .conftest import created


def run(be: HttpBackend, sid: str, *argv: str, **kw):
    return be.exec(sid, ExecRequest(argv=list(argv), **kw))


def sh(be: HttpBackend, sid: str, script: str, **kw):
    return run(be, sid, "sh", "-c", script, **kw)


def test_http_backend_implements_the_whole_contract(admin, base_image):
    be = admin
    with created(be, base_image, memory_mb=128, ttl=300, env={"BASE": "b"}) as info:
        sid = info.id
        assert sid.startswith("sb-") and be.info(sid).state.value == "running"
        assert sid in [i.id for i in be.list()]
        r = sh(be, sid, "echo hi; echo err >&2; exit 3", env={"A": "1"})
        assert (r.stdout, r.stderr, r.exit_code) == ("hi\n", "err\n", 3)
        assert run(be, sid, "cat", stdin=b"\x00\x01binary").stdout == "\x00\x01binary"
        # stdin travels as base64 (pydantic's urlsafe alphabet: "-_8A" for these bytes)
        assert run(be, sid, "od", "-An", "-tx1", stdin=b"\xfb\xff\x00").stdout.split() == ["fb", "ff", "00"]
        seen: list[str] = []
        errs: list[str] = []
        r = be.exec(sid, ExecRequest(argv=["sh", "-c", "for i in 1 2 3; do echo $i; done; echo e >&2"]),
                    on_stdout=seen.append, on_stderr=errs.append)  # streamed (SSE)
        assert "".join(seen) == "1\n2\n3\n" == r.stdout and "".join(errs) == "e\n"
        assert run(be, sid, "sleep", "5", timeout=0.3).timed_out
        # files
        assert be.write_file(sid, "/work/x.txt", b"remote file") == 11
        assert be.read_file(sid, "/work/x.txt") == b"remote file"
        assert [e.name for e in be.list_files(sid, "/work")] == ["x.txt"]
        assert be.stat_file(sid, "/work/x.txt").size == 11
        be.mkdir(sid, "/work/d/e")
        assert be.stat_file(sid, "/work/d/e").type == "dir"
        be.remove_file(sid, "/work/d/e")
        be.remove_file(sid, "/work/d")
        with pytest.raises(FileOpError):
            be.stat_file(sid, "/work/d")
        tar = be.download_tar(sid, "/work")
        assert "work/x.txt" in tarfile.open(fileobj=io.BytesIO(tar)).getnames()
        assert be.upload_tar(sid, "/copy", tar) >= 1
        assert be.read_file(sid, "/copy/work/x.txt") == b"remote file"
        # a background command: output since a cursor, wait with the real result, kill with a signal
        h = be.start(sid, StartRequest(argv=["sh", "-c", "echo bg; sleep 0.2; echo done"]))
        res = h.wait(10)
        assert res.stdout == "bg\ndone\n" and res.exit_code == 0
        out = h.output((3, 0))
        assert out.stdout == "done\n" and out.exit_code == 0
        h.close()
        h = be.start(sid, StartRequest(argv=["sleep", "30"]))
        assert h.poll() is None
        with pytest.raises(CommandTimeout):
            h.wait(0.2)
        h.kill(15)
        res = h.wait(10)
        assert res.exit_code == 128 + 15 and res.signal == 15
        h.close()
        # sessions keep state; shell, cwd and env are the caller's to choose
        s = be.open_session(sid, SessionRequest(shell="/bin/sh", cwd="/tmp", env={"S": "5"}))
        assert s.shell == "/bin/sh"
        s.run("cd /work; export V=7")
        assert s.run("pwd; echo $V $S").stdout == "/work\n7 5\n"
        s.close()
        # lifecycle
        be.pause(sid)
        assert be.info(sid).state.value == "paused"
        be.resume(sid)
        info = be.set_ttl(sid, TimeoutRequest(ttl=None, idle_ttl=None))
        assert info.ttl is None and be.info(sid).ttl is None
        # snapshot, fork (with exclude), restore
        be.write_file(sid, "/work/secret", b"x")
        snap = be.snapshot(sid, SnapshotRequest())
        fork = be.fork(sid, ForkRequest(n=2, exclude=["work/secret"], copy_env=True))
        assert len(fork.sandboxes) == 2 and not fork.failed
        try:
            child = fork.sandboxes[0].id
            assert be.read_file(child, "/work/x.txt") == b"remote file"
            assert not be.list_files(child, "/work") or "secret" not in [e.name for e in be.list_files(child, "/work")]
            assert sh(be, child, "echo $BASE").stdout == "b\n"
        finally:
            for c in fork.sandboxes:
                be.kill(c.id)
        with created(be, from_snapshot=snap.id) as restored:
            assert be.read_file(restored.id, "/work/x.txt") == b"remote file"
        be.kill(sid)
        with pytest.raises(SandboxNotFound):
            be.info(sid)


def test_remote_errors_are_the_same_types(admin, base_image):
    with pytest.raises(ImageNotFound, match="nope"):
        admin.create(CreateRequest(image="nope:1"))
    with pytest.raises(SandboxNotFound):
        admin.info("sb-none-000000000000")
    with pytest.raises(InvalidArgument):  # the server's validation (422), sent unvalidated on purpose
        admin.json("POST", "/sandboxes", json={"image": base_image, "memory_mb": -5})
    with created(admin, base_image) as info:
        with pytest.raises(InvalidArgument, match="NUL"):
            admin.json("POST", f"/sandboxes/{info.id}/exec", json={"argv": ["echo", "a\0b"]})
        with pytest.raises(InvalidArgument, match="base64"):
            admin.json("POST", f"/sandboxes/{info.id}/exec", json={"argv": ["cat"], "stdin": "not base64!"})
        with pytest.raises(FileOpError):
            admin.read_file(info.id, "/no/such/file")
    with pytest.raises(SandboxNotFound):
        run(admin, info.id, "true")


def test_tenants_cannot_see_each_other(daemon, tenants, base_image):
    url = daemon["url"]
    a, b = HttpBackend(url, tenants["tenant-a"]), HttpBackend(url, tenants["tenant-b"])
    with created(a, base_image) as info:
        for method, path in (("GET", f"/sandboxes/{info.id}"), ("DELETE", f"/sandboxes/{info.id}"),
                             ("POST", f"/sandboxes/{info.id}/pause")):
            with pytest.raises(SandboxNotFound):  # 404, not 403: existence is not confirmed
                b.call(method, path)
        with pytest.raises(SandboxNotFound):
            run(b, info.id, "true")
        assert info.id not in [i.id for i in b.list()]
        assert info.id in [i.id for i in a.list()]
        snap = a.snapshot(info.id, SnapshotRequest())
        with pytest.raises(ImageNotFound):
            b.create(CreateRequest(from_snapshot=snap.id))
        # a's snapshot is a's (snapshots made in-process by other test modules have no owner: shared)
        assert snap.image not in [i["ref"] for i in b.json("GET", "/images")]
        assert snap.image in [i["ref"] for i in a.json("GET", "/images")]
        with pytest.raises(Unauthorized, match="admin"):  # the host's network is the admin's
            b.create(CreateRequest(image=base_image, network="host"))
        with pytest.raises(Unauthorized, match="side channel"):  # merged pages cross tenants: admin's choice
            b.create(CreateRequest(image=base_image, ksm=True))
        h = a.start(info.id, StartRequest(argv=["sleep", "30"]))
        with pytest.raises(SandboxNotFound):  # another tenant's background command
            b.call("GET", f"/sandboxes/{info.id}/commands/{h.id}")
        h.close()
        assert run(a, info.id, "echo", "mine").stdout == "mine\n"


def test_pooled_sandboxes_never_share_a_memory_cgroup_across_tenants(daemon, tenants, base_image, admin):
    """A pool member can push its neighbours into an OOM kill: shoald keys each tenant's pools by the
    tenant, whatever key the tenant sends (here tenant a forges b's); an admin's key (a fleet gateway
    passing its tenant on) is kept."""
    from shoal.backends.container.mempools import group_prefix

    url = daemon["url"]
    a, b = HttpBackend(url, tenants["tenant-a"]), HttpBackend(url, tenants["tenant-b"])
    by_id = daemon["root"] / "mempools" / "by-id"
    kw = {"image": base_image, "memory_mb": 32, "memory_cgroup": "pooled"}
    with created(a, **kw) as a1, created(a, memory_pool="tenant:tenant-b", **kw) as a2, \
            created(b, **kw) as b1, created(admin, memory_pool="gw:tenant-c", **kw) as c1:
        pools = {i.id: os.readlink(by_id / i.id) for i in (a1, a2, b1, c1)}
        assert pools[a1.id] == pools[a2.id]  # one pool for a's two, the forged key ignored
        assert pools[a1.id].startswith(group_prefix("tenant:tenant-a"))
        assert pools[b1.id].startswith(group_prefix("tenant:tenant-b")) and pools[b1.id] != pools[a1.id]
        assert pools[c1.id].startswith(group_prefix("gw:tenant-c"))
        assert a.info(a2.id).limits.memory_pool == "tenant:tenant-a"
    with pytest.raises(InvalidArgument, match="memory_pool"):  # the server's validation, sent unvalidated
        a.json("POST", "/sandboxes", json={**kw, "memory_pool": "a/b"})


def test_auth_is_required_and_checked(daemon, tenants):
    with pytest.raises(Unauthorized):
        HttpBackend(daemon["url"], "sk-wrong").list()
    with pytest.raises(Unauthorized):
        HttpBackend(daemon["url"], tenants["tenant-a"]).json("GET", "/tenants")  # admin only
    raw = httpx.Client(transport=httpx.HTTPTransport(uds=str(daemon["sock"])), base_url="http://x",
                       headers={"Authorization": "Bearer sk-wrong"})
    r = raw.get("/v1/sandboxes")
    assert r.status_code == 401 and r.json()["error"]["type"] == "Unauthorized"
    admin = HttpBackend(daemon["url"], daemon["admin_key"])
    assert {t["name"] for t in admin.json("GET", "/tenants")} >= {"tenant-a", "tenant-b"}


def test_tenant_quota_is_enforced(daemon, tenants, base_image):
    be = HttpBackend(daemon["url"], tenants["tenant-b"])
    made = []
    try:
        for _ in range(5):
            made.append(be.create(CreateRequest(image=base_image, memory_mb=64)).id)
        with pytest.raises(QuotaExceeded, match="sandboxes") as e:
            be.create(CreateRequest(image=base_image, memory_mb=64))
        assert e.value.retryable
        be.kill(made.pop())
        with pytest.raises(QuotaExceeded, match="memory_mb"):
            be.create(CreateRequest(image=base_image, memory_mb=5000))
        with pytest.raises(QuotaExceeded, match="sandboxes"):  # a fork of 2 needs room for both
            be.fork(made[0], ForkRequest(n=2))
    finally:
        for sid in made:
            be.kill(sid)


def test_quota_answers_429_with_retry_after(daemon, base_image, admin):
    key = admin.json("POST", "/tenants", json={"name": "tenant-429", "quotas": {"sandboxes": 1}})["api_key"]
    raw = httpx.Client(transport=httpx.HTTPTransport(uds=str(daemon["sock"])), base_url="http://x",
                       headers={"Authorization": f"Bearer {key}"}, timeout=60)
    first = raw.post("/v1/sandboxes", json={"image": base_image})
    assert first.status_code == 201, first.text
    try:
        r = raw.post("/v1/sandboxes", json={"image": base_image})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"] == {"type": "QuotaExceeded", "message": r.json()["error"]["message"],
                                     "retryable": True}
    finally:
        raw.delete(f"/v1/sandboxes/{first.json()['id']}")


def test_concurrent_creates_cannot_overrun_a_quota(daemon, base_image, admin):
    from concurrent.futures import ThreadPoolExecutor

    key = admin.json("POST", "/tenants", json={"name": "tenant-race", "quotas": {"sandboxes": 2}})["api_key"]
    be = HttpBackend(daemon["url"], key)

    def create(_):
        try:
            return be.create(CreateRequest(image=base_image, memory_mb=64)).id
        except QuotaExceeded:
            return None

    with ThreadPoolExecutor(8) as pool:
        made = [sid for sid in pool.map(create, range(8)) if sid]
    try:
        assert len(made) == 2  # each create reserves its share before starting, so exactly the quota
    finally:
        for sid in made:
            be.kill(sid)


def test_sandbox_whose_host_processes_died_is_reaped_and_frees_its_quota(daemon, base_image, admin):
    """kill -9 of a sandbox's supervisor and init leaves a state dir; the daemon's reaper clears it."""
    key = admin.json("POST", "/tenants", json={"name": "tenant-reap", "quotas": {"sandboxes": 1}})["api_key"]
    be = HttpBackend(daemon["url"], key)
    sid = be.create(CreateRequest(image=base_image)).id
    state = daemon["root"] / "sandboxes" / sid
    meta = json.loads((state / "meta.json").read_text())
    os.kill(meta["sup_pid"], signal.SIGKILL)  # no supervisor left to clean up...
    os.kill(meta["init_pid"], signal.SIGKILL)
    time.sleep(0.05)  # short: the reaper (every 5 s) may legitimately clear it any moment after
    assert state.exists()  # ...so the state dir (and its cgroups and tmpfs) stay behind
    deadline = time.time() + 15
    while state.exists() and time.time() < deadline:
        time.sleep(0.2)
    assert not state.exists()
    assert not any(str(state) in line for line in open("/proc/self/mountinfo"))
    with created(be, base_image) as again:  # the quota is free again
        assert run(be, again.id, "echo", "ok").stdout == "ok\n"


def test_ttl_update_replaces_both_fields(admin, base_image):
    with created(admin, base_image, ttl=100, idle_ttl=50) as info:
        got = admin.json("PUT", f"/sandboxes/{info.id}/timeout", json={"ttl": 30})
        assert got["ttl"] == 30 and got["idle_ttl"] is None  # omitted = cleared, not kept


def test_bad_input_gets_4xx_with_a_message(daemon, base_image):
    raw = httpx.Client(transport=httpx.HTTPTransport(uds=str(daemon["sock"])), base_url="http://x")
    for method, path, kw in (("POST", "/v1/sandboxes", {"json": {"image": 5}}),
                             ("POST", "/v1/sandboxes", {"content": b"{not json"}),
                             ("POST", "/v1/sandboxes", {"json": {"image": base_image, "cpu": -1}}),
                             ("POST", "/v1/sandboxes", {"json": {"image": base_image, "typo_field": 1}}),
                             ("POST", "/v1/sandboxes", {"content": b'{"image": "\\ud800"}'}),
                             ("GET", "/v1/sandboxes/..%2f..%2fetc", {}),
                             ("POST", "/v1/sandboxes/sb-x/exec", {"json": {"argv": []}}),
                             ("POST", "/v1/sandboxes/sb-x/exec", {"json": {"cmd": "old-style"}}),
                             ("PUT", "/v1/tenants/ghost/quotas", {"json": {"sandboxes": 0}}),
                             ("POST", "/v1/tenants", {"json": {"name": "Bad Name!"}}),
                             ("GET", "/v1/no-such-route", {})):
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
    # the request bodies are the contract's models, not copies
    schemas = spec["components"]["schemas"]
    assert {"CreateRequest", "ExecRequest", "StartRequest", "ForkRequest", "SandboxInfo", "ExecResult"} <= set(schemas)
    assert all(p.startswith("/v1/") or p == "/metrics" for p in spec["paths"])


def test_daemon_socket_is_for_the_shoal_group_and_invisible_inside(daemon, admin, base_image):
    st = os.stat(daemon["sock"])
    assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_uid == 0
    assert st.st_gid == grp.getgrnam("shoal").gr_gid
    with created(admin, base_image) as info:
        r = sh(admin, info.id, "find / -name 'shoald*' 2>/dev/null; ls /var/lib /run 2>/dev/null")
        assert "shoald" not in r.stdout


def test_daemon_restart_reattaches_live_sandboxes(daemon, base_image):
    url = daemon["url"]
    be = HttpBackend(url, "")
    sid = be.create(CreateRequest(image=base_image)).id
    be.write_file(sid, "/state", b"kept")
    proc = daemon["proc"]
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    with pytest.raises(SandboxError, match="unreachable") as e:  # a retryable error while it is down
        run(be, sid, "true")
    assert e.value.retryable
    daemon["proc"] = start_daemon(daemon["root"])
    assert be.read_file(sid, "/state") == b"kept"  # the sandbox survived the daemon's crash
    assert run(be, sid, "echo", "back").stdout == "back\n"
    be.kill(sid)


def test_network_update_replaces_rules_through_the_api(admin, base_image):
    with created(admin, base_image) as info:
        first = admin.set_network(info.id, NetworkRequest(allow=["10.202.0.2:8080"]))
        assert first.allow == ["10.202.0.2:8080"]
        assert admin.get_network(info.id).allow == ["10.202.0.2:8080"]
        second = admin.json("PUT", f"/sandboxes/{info.id}/network", json={"presets": {}})
        assert second["allow"] == [] and second["resolved"] == []  # omitted = cleared
        with pytest.raises(InvalidArgument):
            admin.set_network(info.id, NetworkRequest(allow=["nonsense"]))


def test_kill_9_under_load_gives_retryable_errors_and_leaks_nothing(daemon, base_image):
    """Bounded load (40 sandboxes, 8 clients, ~6 s) with the daemon SIGKILLed in the middle."""
    url, root = daemon["url"], daemon["root"]
    be = HttpBackend(url, "")
    held = [be.create(CreateRequest(image=base_image, memory_mb=64, disk_mb=16)).id for _ in range(40)]
    stop = time.monotonic() + 6
    stats: dict = {"ok": 0, "retryable": 0, "other": []}
    lock = threading.Lock()

    def churn(k: int):
        i = k
        while time.monotonic() < stop:
            sid = held[i % len(held)]
            i += 7
            try:
                out = sh(be, sid, "echo $HOSTNAME", timeout=10).stdout.strip()
                with lock:
                    if out == sid:
                        stats["ok"] += 1
                    else:
                        stats["other"].append(f"wrong output {out!r} from {sid}")
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
    assert all(run(be, sid, "echo", "up").stdout == "up\n" for sid in held)
    for sid in held:
        be.kill(sid)
    assert not any(str(root / "sandboxes") in line for line in open("/proc/self/mountinfo"))
    assert not [p for p in (root / "sandboxes").iterdir()]


def _daemon_fds(daemon) -> int:
    return len(os.listdir(f"/proc/{daemon['proc'].pid}/fd"))


def test_sessions_and_background_commands_are_capped_per_sandbox(daemon, admin, base_image):
    """A client opening sessions or background commands in a loop hits a 429, not the daemon's fd limit."""
    c = admin
    fds_before = _daemon_fds(daemon)
    sid = c.create(CreateRequest(image=base_image)).id
    try:
        p = f"/sandboxes/{sid}"
        sessions = [c.json("POST", f"{p}/sessions", json={})["id"] for _ in range(16)]
        with pytest.raises(QuotaExceeded, match="16 live sessions"):
            c.json("POST", f"{p}/sessions", json={})
        c.call("DELETE", f"{p}/sessions/{sessions[0]}")
        c.json("POST", f"{p}/sessions")  # closing one made room (and the body is optional)
        running = [c.json("POST", f"{p}/commands", json={"argv": ["sleep", "300"]})["id"] for _ in range(64)]
        with pytest.raises(QuotaExceeded, match="64 live background commands"):
            c.json("POST", f"{p}/commands", json={"argv": ["true"]})
        # a finished command is forgotten to make room; a running one never is
        c.call("POST", f"{p}/commands/{running[0]}/kill")
        deadline = time.time() + 10
        while c.json("GET", f"{p}/commands/{running[0]}")["exit_code"] is None and time.time() < deadline:
            time.sleep(0.05)
        new = c.json("POST", f"{p}/commands", json={"argv": ["echo", "hi"]})["id"]
        with pytest.raises(SandboxNotFound):
            c.json("GET", f"{p}/commands/{running[0]}")
        assert c.json("GET", f"{p}/commands/{running[1]}")["exit_code"] is None
        c.call("DELETE", f"{p}/commands/{new}")
        with pytest.raises(SandboxNotFound):
            c.json("GET", f"{p}/commands/{new}")
        assert _daemon_fds(daemon) > fds_before + 64  # each live handle holds host fds...
    finally:
        c.kill(sid)
    time.sleep(0.5)
    assert _daemon_fds(daemon) <= fds_before + 8  # ...and killing the sandbox released all of them


def test_streamed_exec_errors_and_a_reader_that_leaves(daemon, admin, base_image):
    """An error after the stream started arrives as the same class as without streaming; a client that
    leaves mid-stream costs the daemon nothing once the command's timeout ends it."""
    from shoal import Host

    with created(admin, base_image) as gone:  # ended behind the daemon's back: it still owns the id
        Host.get(daemon["root"]).kill(gone.id)
        with pytest.raises(SandboxNotFound):
            run(admin, gone.id, "true")
        with pytest.raises(SandboxNotFound):  # the stream's `error` event, raised as the same class
            admin.exec(gone.id, ExecRequest(argv=["true"]), on_stdout=lambda _: None)
    with created(admin, base_image) as info:
        pid = daemon["proc"].pid
        threads0 = len(os.listdir(f"/proc/{pid}/task"))
        raw = httpx.Client(transport=httpx.HTTPTransport(uds=str(daemon["sock"])), base_url="http://x", timeout=30)
        with raw.stream("POST", f"/v1/sandboxes/{info.id}/exec", params={"stream": "true"},
                        json={"argv": ["yes"], "timeout": 2}) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            assert [next(lines) for _ in range(4)][0] == "event: stdout"
        raw.close()  # gone, with `yes` still writing
        time.sleep(4)  # its timeout ends it; the runner thread must not stay blocked on a full queue
        assert len(os.listdir(f"/proc/{pid}/task")) <= threads0 + 2
        assert run(admin, info.id, "echo", "still").stdout == "still\n"
