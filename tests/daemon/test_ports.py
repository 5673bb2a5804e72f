"""shoald's port tunnel (`connect_port` through the http backend) is the sandbox's tenant's alone."""
from __future__ import annotations

import time

import pytest

from shoal.backends.http import HttpBackend
from shoal.core.contract import StartRequest
from shoal.core.errors import SandboxError, SandboxNotFound, Unauthorized

from .conftest import created


def test_a_tenant_reaches_only_its_own_sandboxes_ports(daemon, base_image):
    from daemonctl import make_tenants

    # tenants of its own: the session's root (and its tenants) outlives each module's daemon, and
    # test_api's module makes tenant-a and tenant-b
    url = daemon["url"]
    keys = make_tenants(url, names=("ports-a", "ports-b"))
    a, b = HttpBackend(url, keys["ports-a"]), HttpBackend(url, keys["ports-b"])
    with created(a, base_image) as info:
        server = a.start(info.id, StartRequest(argv=["nc", "-ll", "-p", "7000", "-e", "echo", "secret"]))
        deadline = time.monotonic() + 10
        while True:
            try:
                s = a.connect_port(info.id, 7000)
                break
            except SandboxError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        with s:
            s.settimeout(10)
            assert s.recv(100) == b"secret\n"
        with pytest.raises(SandboxNotFound):  # 404, as every other route: existence not confirmed
            b.connect_port(info.id, 7000)
        with pytest.raises(Unauthorized):
            HttpBackend(url, "sk-wrong").connect_port(info.id, 7000)
        with pytest.raises(SandboxNotFound):
            a.connect_port("sb-000000000000", 7000)
        server.close()


def test_a_port_that_never_accepts_holds_no_request_thread(daemon, base_image):
    """Hostile: a listener that never accepts (stopped: once its backlog is full, connects hang until
    their timeout) is hit with 30 tunnel connects at once by its tenant. At most TENANT_CONNECTS are in
    flight (the rest are 429 at once), each ends at its timeout (409), and meanwhile the daemon's other
    routes answer: the connects run on a pool of their own, not on the request threads."""
    from concurrent.futures import ThreadPoolExecutor

    from daemonctl import make_tenants

    from shoal.core.contract import ExecRequest
    from shoal.core.errors import PortClosed, QuotaExceeded
    from shoal.server.routes.ports import TENANT_CONNECTS

    url = daemon["url"]
    a = HttpBackend(url, make_tenants(url, names=("ports-slow",))["ports-slow"])
    with created(a, base_image) as info:
        a.exec(info.id, ExecRequest(argv=["sh", "-c", "httpd -p 127.0.0.1:7001 -h /tmp && sleep 0.3 && "
                                                      "kill -STOP $(pidof httpd)"]))
        held = []
        try:
            while True:  # fill the stopped listener's backlog: then nothing more connects
                try:
                    held.append(a.connect_port(info.id, 7001, timeout=1))
                except PortClosed:
                    break
                assert len(held) < 60, "the stopped listener kept accepting"

            def one(_: int) -> tuple[str, float]:
                t0 = time.monotonic()
                try:
                    a.connect_port(info.id, 7001, timeout=3).close()
                    return "connected", time.monotonic() - t0
                except (PortClosed, QuotaExceeded) as e:
                    return type(e).__name__, time.monotonic() - t0

            with ThreadPoolExecutor(30) as pool:
                burst = pool.map(one, range(30))
                time.sleep(1.0)
                t0 = time.monotonic()
                assert a.info(info.id).id == info.id and a.list()
                assert time.monotonic() - t0 < 2.0
                got = list(burst)
            kinds = [k for k, _ in got]
            assert kinds.count("PortClosed") <= TENANT_CONNECTS and "connected" not in kinds, got
            assert kinds.count("QuotaExceeded") >= 30 - TENANT_CONNECTS, got
            assert all(d < 2.0 for k, d in got if k == "QuotaExceeded"), got
            assert all(2.5 < d < 10 for k, d in got if k == "PortClosed"), got
        finally:
            for s in held:
                s.close()


def test_who_holds_a_port_is_answered_from_the_host(daemon, base_image):
    """`port_sockets` through shoald (a grader's question before it trusts a server in the sandbox):
    the listener and its holder's program, whether that program is the image's own file or one
    written in the sandbox, and only for the sandbox's tenant."""
    from daemonctl import make_tenants

    from shoal.core.contract import ExecRequest
    from shoal.core.errors import InvalidArgument

    url = daemon["url"]
    keys = make_tenants(url, names=("ports-who-a", "ports-who-b"))
    a, b = HttpBackend(url, keys["ports-who-a"]), HttpBackend(url, keys["ports-who-b"])
    with created(a, base_image) as info:
        assert a.port_sockets(info.id, 7002) == []
        busybox = "/bin/busybox"  # every applet of the base image (nc among them) is this program
        # busybox runs the applet its argv[0] names
        r = a.exec(info.id, ExecRequest(argv=["sh", "-c", f"mkdir -p /opt/x && cp {busybox} /opt/x/nc"]))
        assert r.exit_code == 0, r.stderr
        own = a.start(info.id, StartRequest(argv=["nc", "-ll", "-p", "7002", "-e", "echo", "hi"]))
        copied = a.start(info.id, StartRequest(argv=["/opt/x/nc", "-ll", "-p", "7003", "-e", "echo", "hi"]))
        deadline = time.monotonic() + 10
        while not (a.port_sockets(info.id, 7002) and a.port_sockets(info.id, 7003)):
            assert time.monotonic() < deadline, (own.output(), copied.output())
            time.sleep(0.05)
        [s] = a.port_sockets(info.id, 7002)
        assert s.state == "listen" and len(s.pids) == 1 and s.exes == [busybox] and s.exes_from_image == [True], s
        # how it was started, read from the host: argv, start time (with the pid, one process instance)
        assert s.cmdlines == [["nc", "-ll", "-p", "7002", "-e", "echo", "hi"]] and s.code_from_image == [True], s
        assert len(s.starts) == 1 and s.starts[0] > 0, s
        # and a file's ctime, which the sandbox cannot set back (graders compare it with a load time)
        t = time.time()
        entry = a.stat_file(info.id, "/opt/x/nc")
        assert entry.ctime is not None and t - 60 < entry.ctime <= t + 1, entry
        [s] = a.port_sockets(info.id, 7003)
        assert s.exes == ["/opt/x/nc"] and s.exes_from_image == [False], s  # written in the sandbox
        with pytest.raises(SandboxNotFound):
            b.port_sockets(info.id, 7002)
        with pytest.raises(InvalidArgument):
            a.port_sockets(info.id, 70000)
        own.close()
        copied.close()


def test_a_port_guard_and_what_the_sandbox_wrote_through_shoald(daemon, base_image):
    """guard_port / port_guarded and written_under (what desktop graders ask, docs/desktop.md "Grader
    hardening") through shoald: the host's tunnel still reaches a guarded port, the sandbox does not;
    only the sandbox's tenant may ask."""
    from daemonctl import make_tenants

    from shoal.core.contract import ExecRequest

    url = daemon["url"]
    keys = make_tenants(url, names=("ports-guard-a", "ports-guard-b"))
    a, b = HttpBackend(url, keys["ports-guard-a"]), HttpBackend(url, keys["ports-guard-b"])
    with created(a, base_image) as info:
        srv = a.start(info.id, StartRequest(argv=["nc", "-ll", "-p", "7004", "-e", "echo", "hi"]))
        deadline = time.monotonic() + 10
        while not a.port_sockets(info.id, 7004):
            assert time.monotonic() < deadline, srv.output()
            time.sleep(0.05)
        assert not a.port_guarded(info.id, 7004)
        a.guard_port(info.id, 7004)
        assert a.port_guarded(info.id, 7004)
        r = a.exec(info.id, ExecRequest(argv=["sh", "-c", "echo x | nc 127.0.0.1 7004; echo rc=$?"], timeout=10))
        assert "hi" not in r.stdout and "rc=0" not in r.stdout, r.stdout
        with a.connect_port(info.id, 7004) as c:
            assert c.recv(16).startswith(b"hi")
        assert a.written_under(info.id, ["/usr", "/etc/ld.so.preload"]) == []
        a.exec(info.id, ExecRequest(argv=["touch", "/etc/ld.so.preload"]))
        assert a.written_under(info.id, ["/usr", "/etc/ld.so.preload"]) == ["/etc/ld.so.preload"]
        with pytest.raises(SandboxNotFound):
            b.port_guarded(info.id, 7004)
        with pytest.raises(SandboxNotFound):
            b.written_under(info.id, ["/usr"])
        srv.close()
