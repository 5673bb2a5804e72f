"""Forging control-plane requests from inside a sandbox: every Unix socket a sandboxed process can
name (its own control socket's host path, another sandbox's, shoald's, the same through each
/proc/N/root, abstract names, every socket file it can find and any fd it holds) must refuse it."""
from __future__ import annotations

import os
import socket

import pytest

from shoal import Host, Sandbox

from .conftest import probe_results

pytestmark = pytest.mark.all_backends(fleet=True)  # the probing sandbox runs on every backend, and through a fleet


def test_no_unix_socket_reaches_the_host_or_another_sandbox(daemon, root, base_image, probe_layer, make_sandbox,
                                                             backend_kind, host_for):
    abstract_name = f"shoal-test-host-{os.getpid()}"
    host_abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    host_abstract.bind("\0" + abstract_name)
    host_abstract.listen(4)
    try:
        with Sandbox.create(base_image, root=root, url="local") as other, \
                make_sandbox(layers=[probe_layer]) as sb:
            runtime = Host.get(root).backend("container")
            targets = {"other sandbox's control socket": runtime.sock_path(other.id), "shoald": str(daemon["sock"])}
            if backend_kind != "gvisor":  # a gVisor sandbox has no init socket; runsc's are among `extra`
                targets["own control socket"] = host_for(sb).backend("container").sock_path(sb.id)
            if backend_kind == "fleet":  # the shoald of the fleet host it runs on
                targets["its host's shoald"] = str(host_for(sb).settings.root / "shoald.sock")
            # every target is live: from the host each one accepts a connection
            for kind, path in targets.items():
                stype = socket.SOCK_STREAM if "shoald" in kind else socket.SOCK_SEQPACKET
                with socket.socket(socket.AF_UNIX, stype) as c:
                    c.connect(path)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
                c.connect("\0" + abstract_name)

            # and every other path-bound socket listening on the host (other roots' sandboxes, daemons)
            with open("/proc/net/unix") as f:
                host_paths = sorted({line.split()[7] for line in f.readlines()[1:]
                                     if len(line.split()) > 7 and line.split()[7].startswith("/")})
            extra = [p for p in host_paths if p not in targets.values()][:40]
            res = probe_results(sb, "sockets", *targets.values(), abstract_name, *extra, timeout=60)
            assert res["connect:stream:control-abstract"] == "OK"  # control: the probe can connect
            attempts = {k: v for k, v in res.items() if k.startswith("connect:") and "control-abstract" not in k}
            connected = {k: v for k, v in attempts.items() if v == "OK"}
            assert not connected, connected
            for path in targets.values():  # tried directly, through /proc/N/root and as an abstract name
                assert res[f"connect:seqpacket:{path}"] in ("ENOENT", "ECONNREFUSED")
                assert res[f"connect:stream:abstract:{path}"] == "ECONNREFUSED"
                assert any(k.startswith("connect:seqpacket:/proc/") and k.endswith(path) for k in attempts)
            assert res[f"connect:stream:abstract:{abstract_name}"] == "ECONNREFUSED"  # own network namespace
            # no inherited socket, and init's fds (its listening socket) are out of reach
            assert not any(k.startswith("inherited_socket:") for k in res), res
            # init is non-dumpable: its fd links stay hidden (gVisor's pid 1 holds no socket at all)
            assert res.get("fdlink:1") == "EACCES" or (backend_kind == "gvisor" and "fdlink:1" not in res), res
            assert int(res["tried"]) >= 3 * (3 * len(targets) + 2)
    finally:
        host_abstract.close()
