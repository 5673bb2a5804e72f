"""A fleet on one machine (fleetctl.py): placement, fleet-wide quotas, routing and streaming through
the gateway, tenants, mTLS, and the faults: a host killed or cut off, a gateway replica killed
mid-request, PostgreSQL restarted."""
from __future__ import annotations

import signal
import ssl
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from shoal import Sandbox
from shoal.backends.http import HttpBackend
from shoal.backends.http.backend import HttpProcessHandle
from shoal.core import errors as E
from shoal.core.contract import CreateRequest, ExecRequest, ProcessInfo, StartRequest

IMAGE = "busybox:test"


def create(fleet, key: str, image: str = IMAGE, **kw) -> Sandbox:
    return Sandbox.create(image, url=fleet.url, api_key=key, memory_mb=64, disk_mb=32, **kw)


def usage_drift(fleet) -> list:
    """Where the directory's usage counters differ from the live rows they count (Directory.usage_drift),
    once every gateway's background confirms had time to land."""
    from shoal.fleet.directory import Directory
    from shoal.fleet.schema import open_db

    pg = open_db(fleet.dsn)
    try:
        return Directory(pg).usage_drift()
    finally:
        pg.close()


def retrying(fn, timeout: float = 20.0):
    """fn() until it stops raising retryable errors (a database or host coming back)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return fn()
        except E.ShoalError as e:
            if not e.retryable or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_hosts_registered(fleet):
    be = fleet.admin()
    try:
        health = be.json("GET", "/health")
    finally:
        be.close()
    assert health["gateway"] is True and health["hosts_up"] == len(fleet.hosts)
    from shoal.fleet.directory import Directory
    from shoal.fleet.schema import open_db

    hosts = {h["id"]: h for h in Directory(open_db(fleet.dsn)).hosts()}
    for h in fleet.hosts:
        row = hosts[h.name]
        assert row["address"] == h.url and row["domain"] == h.domain and row["state"] == "up"
        assert row["capacity"]["sandboxes"] > 0 and row["lease_left_s"] > 0


def test_routing_files_commands_sessions(gw, tenant_key, made):
    sb = create(gw, tenant_key)
    made.append(sb)
    # the host sees the gateway; the gateway names the tenant, so a host's memory pools never mix tenants
    assert sb.info().limits.memory_pool.startswith("tenant:t-")  # conftest names tenants t-<hex>
    assert sb.commands.run("echo hi; echo err >&2").stdout == "hi\n"
    sb.files.write("/tmp/x.txt", "fleet")
    assert sb.files.read("/tmp/x.txt") == "fleet"
    assert any(e.name == "x.txt" for e in sb.files.list("/tmp"))
    with sb.sessions.create() as s:
        s.run("cd /tmp && export V=7")
        assert s.run("pwd; echo $V").stdout == "/tmp\n7\n"
    # a background command started through one gateway is followed through the other: no gateway state
    g1, g2 = (HttpBackend(g.url, tenant_key) for g in gw.gateways)
    try:
        h = g1.start(sb.id, StartRequest(argv=["sh", "-c", "echo bg; sleep 0.3; echo done"]))
        same = HttpProcessHandle(g2, sb.id, ProcessInfo(id=h.id, pid=None), [])
        res = same.wait(10)
        assert res.exit_code == 0 and res.stdout == "bg\ndone\n"
        assert sb.id in {i.id for i in g2.list()}
    finally:
        g1.close()
        g2.close()


def test_streaming_exec_is_not_buffered(gw, tenant_key, made):
    sb = create(gw, tenant_key)
    made.append(sb)
    t0 = time.monotonic()
    seen: list[tuple[float, str]] = []
    sb.backend.exec(sb.id, ExecRequest(argv=["sh", "-c", "echo first; sleep 2; echo second"]),
                    on_stdout=lambda s: seen.append((time.monotonic() - t0, s)))
    text = "".join(s for _, s in seen)
    assert text == "first\nsecond\n"
    first_at = next(t for t, s in seen if "first" in s)
    assert first_at < 1.5, f"the first line took {first_at:.2f} s to come through the gateway: buffered"
    assert time.monotonic() - t0 >= 2


def test_tenants_are_isolated_through_the_gateway(gw, made):
    ka, kb = gw.tenant(f"a-{uuid.uuid4().hex[:6]}"), gw.tenant(f"b-{uuid.uuid4().hex[:6]}")
    sa = create(gw, ka)
    made.append(sa)
    other = HttpBackend(gw.url, kb)
    try:
        for call in (lambda: other.info(sa.id), lambda: other.kill(sa.id),
                     lambda: other.read_file(sa.id, "/etc/passwd"),
                     lambda: other.exec(sa.id, ExecRequest(argv=["true"]))):
            with pytest.raises(E.SandboxNotFound) as ei:
                call()
            assert not isinstance(ei.value, E.SandboxLost)
        assert sa.id not in {i.id for i in other.list()}
    finally:
        other.close()
    assert sa.is_running()
    with pytest.raises(E.Unauthorized):
        HttpBackend(gw.url, "sk-not-a-key").list()


def test_quota_is_fleet_wide(gw, made):
    key = gw.tenant(f"q-{uuid.uuid4().hex[:6]}", sandboxes=3)
    # 8 concurrent creates against a quota of 3, spread over several hosts: exactly 3 are made
    def one(_):
        try:
            return create(gw, key)
        except E.QuotaExceeded as e:
            assert e.retryable
            return None

    with ThreadPoolExecutor(8) as pool:
        got = [sb for sb in pool.map(one, range(8)) if sb is not None]
    made.extend(got)
    assert len(got) == 3
    assert len({gw.host_of(sb.id).name for sb in got}) >= 2  # on more than one host, and still held
    with pytest.raises(E.QuotaExceeded):
        create(gw, key)
    got[0].kill()
    made.remove(got[0])
    made.append(create(gw, key))  # the kill gave its share back


def test_spread_over_failure_domains(gw, tenant_key, made):
    sbs = [create(gw, tenant_key) for _ in range(2)]
    made.extend(sbs)
    assert {gw.host_of(sb.id).domain for sb in sbs} == {"rack-a", "rack-b"}


def test_placement_prefers_the_host_with_the_image(gw, tenant_key, made):
    """An image whose layers only one host holds goes there, even when that host is the busiest."""
    target = gw.hosts[1]
    from shoal import Host

    host = Host.get(target.root)
    extra = host.store.build_from_dir(_tree(target.root), source="test", name="only-here")
    host.store.create_image("only-here:1", ["busybox", extra.digest])
    be = HttpBackend(gw.url, tenant_key)
    try:
        deadline = time.monotonic() + 15  # the host reports its inventory every few seconds
        while "only-here:1" not in {i.ref for i in be.images()}:
            assert time.monotonic() < deadline, "the gateway never saw the new image"
            time.sleep(0.3)
    finally:
        be.close()
    busy = [create(gw, tenant_key) for _ in range(2)]
    made.extend(busy)
    for _ in range(3):
        sb = create(gw, tenant_key, image="only-here:1")
        made.append(sb)
        assert gw.host_of(sb.id) is target
        assert sb.files.read("/only-here") == "yes"


def _tree(root):
    import tempfile
    from pathlib import Path

    d = Path(tempfile.mkdtemp(dir=str(root)))
    (d / "only-here").write_text("yes")
    return d


def test_hosts_refuse_clients_without_the_gateway_certificate(fleet):
    h = fleet.hosts[0]
    ca = str(fleet.fleet_dir / "ca.pem")
    with pytest.raises(httpx.TransportError):  # no client certificate: no TLS session at all
        httpx.get(h.url + "/v1/health", verify=ssl.create_default_context(cafile=ca), timeout=5).raise_for_status()

    ctx = ssl.create_default_context(cafile=ca)  # a host's certificate is not a client certificate
    other = fleet.hosts[1]
    ctx.load_cert_chain(str(fleet.fleet_dir / f"{other.name}.pem"), str(fleet.fleet_dir / f"{other.name}.key"))
    with pytest.raises(httpx.TransportError):
        httpx.get(h.url + "/v1/sandboxes", verify=ctx, timeout=5).raise_for_status()
    from shoal.fleet.pki import gateway_client_context

    r = httpx.get(h.url + "/v1/sandboxes", verify=gateway_client_context(fleet.fleet_dir), timeout=5)
    assert r.status_code == 200  # the gateway's certificate: the host's admin


def test_gateway_killed_mid_create_retry_gives_the_same_sandbox(gw, tenant_key, made):
    key = f"idem-{uuid.uuid4().hex}"
    g1, g2 = gw.gateways
    body = CreateRequest(image=IMAGE, memory_mb=64, disk_mb=32).model_dump_json()
    headers = {"authorization": f"Bearer {tenant_key}", "idempotency-key": key, "content-type": "application/json"}
    ca = ssl.create_default_context(cafile=str(gw.fleet_dir / "ca.pem"))
    first: dict = {}

    def send():
        try:
            first["resp"] = httpx.post(g1.url + "/v1/sandboxes", content=body, headers=headers, verify=ca, timeout=30)
        except httpx.TransportError as e:
            first["error"] = e

    t = threading.Thread(target=send)
    t.start()
    time.sleep(0.15)
    g1.proc.send_signal(signal.SIGKILL)  # mid-request (or just after: both must end in one sandbox)
    g1.proc.wait()
    t.join(30)
    r = httpx.post(g2.url + "/v1/sandboxes", content=body, headers=headers, verify=ca, timeout=60)
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    made.append(Sandbox.connect(sid, url=gw.gateways[1].url, api_key=tenant_key))
    if "resp" in first and first["resp"].status_code == 201:
        assert first["resp"].json()["id"] == sid
    again = httpx.post(g2.url + "/v1/sandboxes", content=body, headers=headers, verify=ca, timeout=60)
    assert again.json()["id"] == sid  # and any later retry too
    import psycopg

    with psycopg.connect(gw.dsn, autocommit=True) as c:
        n = c.execute("SELECT count(*) FROM fleet_sandboxes WHERE idem_key=%s", (key,)).fetchone()[0]
    assert n == 1
    # the SDK given both URLs carries on through the live one
    sb = Sandbox.create(IMAGE, url=gw.url, api_key=tenant_key, memory_mb=64, disk_mb=32)
    made.append(sb)
    assert sb.commands.run("echo ok").stdout == "ok\n"


def test_killed_host_is_lost_then_reconciles(gw, tenant_key, made):
    """SIGKILL a host's shoald (its sandboxes keep running there, unreachable): its lease runs out,
    its sandboxes are LOST with the reason (SandboxLost, 410); restarted, it kills them and rejoins."""
    sbs = [create(gw, tenant_key) for _ in range(3)]
    made.extend(sbs)
    victim = gw.host_of(sbs[0].id)
    mine = [sb for sb in sbs if gw.host_of(sb.id) is victim]
    others = [sb for sb in sbs if gw.host_of(sb.id) is not victim]
    t0 = time.monotonic()
    gw.stop_host(victim, signal.SIGKILL)
    while True:
        try:
            mine[0].info()
        except E.SandboxLost as e:
            assert victim.name in str(e) and "lease" in str(e)
            break
        except E.HostUnavailable:
            pass
        assert time.monotonic() - t0 < 15, "the host's sandboxes were never declared lost"
        time.sleep(0.2)
    detect = time.monotonic() - t0
    print(f"dead host detected after {detect:.1f} s (lease 3 s)")
    with pytest.raises(E.SandboxLost):
        mine[0].commands.run("true")
    assert not mine[0].is_running()
    for sb in others:
        assert sb.commands.run("echo alive").stdout == "alive\n"
    assert mine[0].id in gw.local_ids(victim)  # still running there, unreachable
    gw.start_host(victim)
    assert mine[0].id not in gw.local_ids(victim)  # reconciled on start: killed before it registered
    with pytest.raises(E.SandboxLost):
        mine[0].info()  # and stays lost for its owner
    for sb in mine:
        made.remove(sb)
    assert usage_drift(gw) == []  # the lost sandboxes left the tenant's and the host's usage counters


def test_cut_host_is_lost_then_reconciles(gw, tenant_key, made):
    """Cut a host's veth: no heartbeats reach the database, so it is declared down; when the link
    comes back its agent finds its registration gone, kills the lost sandboxes and registers again."""
    victim = gw.hosts[2]
    sb = None
    for _ in range(6):
        cand = create(gw, tenant_key)
        made.append(cand)
        if gw.host_of(cand.id) is victim:
            sb = cand
            break
    assert sb is not None, "no sandbox landed on the host to cut"
    gw.cut(victim)
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                sb.info()
            except E.SandboxLost:
                break
            except E.HostUnavailable:
                pass
            assert time.monotonic() < deadline, "a cut host's sandboxes were never declared lost"
            time.sleep(0.2)
    finally:
        gw.restore(victim)
    gw.wait_registered(victim, timeout=20)
    deadline = time.monotonic() + 10
    while sb.id in gw.local_ids(victim):
        assert time.monotonic() < deadline, "the host came back but kept running a lost sandbox"
        time.sleep(0.2)
    made.remove(sb)
    with pytest.raises(E.SandboxLost):
        sb.commands.run("true")


def test_postgres_restart(gw, tenant_key, made):
    """Gateways and hosts reconnect; no host is declared lost for the database's own downtime;
    creates in flight happen once or not at all (a retried key never makes a second sandbox)."""
    sb = create(gw, tenant_key)
    made.append(sb)
    keys = [f"pgr-{uuid.uuid4().hex}" for _ in range(6)]
    be = HttpBackend(gw.url, tenant_key)
    results: dict[str, str] = {}

    def creator():
        for k in keys:
            info = retrying(lambda k=k: be.create(CreateRequest(image=IMAGE, memory_mb=64, disk_mb=32),
                                                  idempotency_key=k), timeout=40)
            results[k] = info.id
            time.sleep(0.2)

    t = threading.Thread(target=creator)
    t.start()
    time.sleep(0.3)
    gw.pg.restart()
    t.join(90)
    try:
        assert len(results) == len(keys)
        made.extend(Sandbox.connect(sid, url=gw.url, api_key=tenant_key) for sid in results.values())
        for k, sid in results.items():  # each key made exactly one sandbox, and it is the one reported
            assert retrying(lambda k=k: be.create(CreateRequest(image=IMAGE), idempotency_key=k)).id == sid
        assert retrying(lambda: sb.commands.run("echo back").stdout) == "back\n"
        import psycopg

        with psycopg.connect(gw.dsn, autocommit=True) as c:
            assert c.execute("SELECT count(*) FROM fleet_sandboxes WHERE state='lost' AND tenant=("
                             "SELECT tenant FROM fleet_sandboxes WHERE id=%s)", (sb.id,)).fetchone()[0] == 0
            assert c.execute("SELECT count(*) FROM fleet_hosts WHERE state='up'").fetchone()[0] == len(gw.hosts)
        assert usage_drift(gw) == []  # creates cut by the restart left the counters as they left the rows
    finally:
        be.close()


def test_gateway_overhead_per_exec_and_create(gw, tenant_key, made):
    """What the gateway adds over calling the host directly (same TLS, same host); printed, loosely
    bounded here (bench/fleet.py is where the goal is measured)."""
    import statistics

    from shoal.fleet.pki import gateway_client_context

    sb = create(gw, tenant_key)
    made.append(sb)
    host = gw.host_of(sb.id)
    direct = HttpBackend(host.url, "", ssl_context=gateway_client_context(gw.fleet_dir))
    via = HttpBackend(gw.gateways[0].url, tenant_key)
    req = ExecRequest(argv=["true"])

    def p50(fn, n=30):
        fn()
        times = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1000

    try:
        d_exec, g_exec = p50(lambda: direct.exec(sb.id, req)), p50(lambda: via.exec(sb.id, req))
        cr = CreateRequest(image=IMAGE, memory_mb=64, disk_mb=32)

        def made_by(be):
            def one():
                info = be.create(cr)
                be.kill(info.id)
            return one

        d_create, g_create = p50(made_by(direct), 5), p50(made_by(via), 5)
    finally:
        direct.close()
        via.close()
    print(f"exec p50: direct {d_exec:.1f} ms, via gateway {g_exec:.1f} ms (+{g_exec - d_exec:.1f}); "
          f"create+kill p50: direct {d_create:.1f} ms, via gateway {g_create:.1f} ms (+{g_create - d_create:.1f})")
    assert g_exec - d_exec < 100


def test_cached_routes_fail_safe(gw, tenant_key, made):
    """Each gateway keeps a running sandbox's route for a moment (shoal.fleet.backend.ROUTE_CACHE_S):
    a sandbox killed through the other gateway is 404 with the directory's reason at once, never
    served from the stale route."""
    g1, g2 = (HttpBackend(g.url, tenant_key) for g in gw.gateways)
    try:
        info = g1.create(CreateRequest(image=IMAGE, memory_mb=64, disk_mb=32))
        assert g2.exec(info.id, ExecRequest(argv=["true"])).exit_code == 0  # g2 now holds its route
        g1.kill(info.id)
        for call in (lambda: g2.exec(info.id, ExecRequest(argv=["true"])), lambda: g2.info(info.id)):
            with pytest.raises(E.SandboxNotFound) as ei:
                call()
            assert not isinstance(ei.value, E.SandboxLost)
            assert "ended" in str(ei.value) or "not found" in str(ei.value)
    finally:
        g1.close()
        g2.close()


def test_image_of_another_tenant_is_checked_before_quota(gw, made):
    """Image ownership is checked in the create's reservation, before the quota (as shoald's route does)."""
    import psycopg

    a, b = f"ia-{uuid.uuid4().hex[:6]}", f"ib-{uuid.uuid4().hex[:6]}"
    gw.tenant(a)
    kb = gw.tenant(b, memory_mb=32)  # any create of 64 MiB is over its quota
    ref = f"private-{uuid.uuid4().hex[:6]}:1"
    with psycopg.connect(gw.dsn, autocommit=True) as c:
        c.execute("INSERT INTO fleet_owners(kind, ref, tenant, created) VALUES ('image', %s, %s, 0)", (ref, a))
    be = HttpBackend(gw.url, kb)
    try:
        with pytest.raises(E.ImageNotFound):
            be.create(CreateRequest(image=ref, memory_mb=64, disk_mb=32))
        with pytest.raises(E.QuotaExceeded):
            be.create(CreateRequest(image=IMAGE, memory_mb=64, disk_mb=32))
    finally:
        be.close()


def _row(fleet, slot_or_id: str) -> tuple | None:
    import psycopg

    with psycopg.connect(fleet.dsn, autocommit=True) as c:
        return c.execute("SELECT state, id, host FROM fleet_sandboxes WHERE slot=%s OR id=%s",
                         (slot_or_id, slot_or_id)).fetchone()


def test_create_answers_before_its_confirm_and_any_gateway_routes_it(gw, tenant_key, made):
    """The confirm is off the create's path (Directory.confirms): a sandbox made through one gateway
    is served at once by the other, whether or not the confirm has landed (the other waits for it)."""
    g1, g2 = (HttpBackend(g.url, tenant_key) for g in gw.gateways)
    try:
        for _ in range(8):
            info = g1.create(CreateRequest(image=IMAGE, memory_mb=64, disk_mb=32))
            made.append(Sandbox.connect(info.id, url=gw.url, api_key=tenant_key))
            assert g2.exec(info.id, ExecRequest(argv=["true"])).exit_code == 0
            assert g2.info(info.id).id == info.id
        assert _row(gw, info.id)[:2] == ("running", info.id)
    finally:
        g1.close()
        g2.close()


def test_lost_confirm_is_settled_by_the_host(gw, tenant_key, made):
    """A gateway that answered a create and died before its background confirm landed: the row stays
    `creating`. Another tenant gets its 404 at once; the owner's calls through a live gateway wait
    (or get a retryable 503) until the host confirms the row itself at a heartbeat, and then work."""
    from shoal.fleet.backend import FleetBackend
    from shoal.fleet.directory import Directory
    from shoal.fleet.pki import gateway_client_context
    from shoal.fleet.schema import open_db
    from shoal.fleet.tenants import PgTenants

    d = Directory(open_db(gw.dsn))
    dying = FleetBackend(d, gateway_client_context(gw.fleet_dir))  # a third gateway, in this process
    d.confirms.held = True  # its confirms never land: as if it died right after answering
    tenant = PgTenants(d.pg, d).tenant_for_key(tenant_key)
    assert tenant is not None
    other = HttpBackend(gw.gateways[1].url, gw.tenant(f"o-{uuid.uuid4().hex[:6]}"))
    owner = HttpBackend(gw.gateways[1].url, tenant_key)
    try:
        info = dying.create_as(tenant, CreateRequest(image=IMAGE, memory_mb=64, disk_mb=32), uuid.uuid4().hex)
        state, sid, _ = _row(gw, d.confirms._pending[info.id][0])
        assert (state, sid) == ("creating", None)
        with pytest.raises(E.SandboxNotFound) as ei:  # not this tenant's: no wait, no 503
            other.info(info.id)
        assert not isinstance(ei.value, E.SandboxLost)
        assert retrying(lambda: owner.exec(info.id, ExecRequest(argv=["true"]))).exit_code == 0
        made.append(Sandbox.connect(info.id, url=gw.url, api_key=tenant_key))
        assert _row(gw, info.id)[:2] == ("running", info.id)
        assert d.confirms.pending(info.id)  # still held here: the host confirmed it
    finally:
        other.close()
        owner.close()
        dying.close()


def test_usage_counters_follow_every_change_of_the_rows(gw, tenant_key, made):
    """Admission reads per-tenant, per-host usage counters kept by a trigger, not sums of the live
    rows: create, kill, a host refusing (the slot moves), a create that fails (released), quota
    refusals; after each, the counters equal the rows and the tenant's usage what it runs."""
    be = HttpBackend(gw.url, tenant_key)
    try:
        infos = [be.create(CreateRequest(image=IMAGE, memory_mb=64, disk_mb=32, cpu=0.5)) for _ in range(3)]
        made.extend(Sandbox.connect(i.id, url=gw.url, api_key=tenant_key) for i in infos)
        with pytest.raises(E.ImageNotFound):
            be.create(CreateRequest(image="no-such-image:1", memory_mb=64, disk_mb=32))
        with pytest.raises(E.QuotaExceeded):
            be.create(CreateRequest(image=IMAGE, memory_mb=8192, disk_mb=32))
        be.kill(infos[0].id)
        assert usage_drift(gw) == []
        import psycopg

        with psycopg.connect(gw.dsn, autocommit=True) as c:
            tenant = c.execute("SELECT tenant FROM fleet_sandboxes WHERE id=%s", (infos[1].id,)).fetchone()[0]
            row = c.execute("SELECT sum(sandboxes), sum(cpu), sum(memory_mb), sum(disk_mb) FROM fleet_usage "
                            "WHERE tenant=%s", (tenant,)).fetchone()
        assert (int(row[0]), float(row[1]), int(row[2]), int(row[3])) == (2, 1.0, 128, 64)
    finally:
        be.close()
