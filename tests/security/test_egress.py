"""Egress rules: default deny; allow rules let exactly the listed address:port through; updates
replace the rule set. The servers live in test network namespaces this test creates, reachable only
through the host's routing (never any address outside this machine)."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from shoal import InvalidArgument, Sandbox

SRV_NS = "shoal-test-srv"
HOST_IP, SRV_IP = "10.202.0.1", "10.202.0.2"


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def servers():
    subprocess.run(["ip", "netns", "del", SRV_NS], check=False, capture_output=True)
    subprocess.run(["ip", "link", "del", "shoaltsrv0"], check=False, capture_output=True)
    sh("ip", "netns", "add", SRV_NS)
    sh("ip", "link", "add", "shoaltsrv0", "type", "veth", "peer", "name", "shoaltsrv1")
    sh("ip", "link", "set", "shoaltsrv1", "netns", SRV_NS)
    sh("ip", "addr", "add", f"{HOST_IP}/24", "dev", "shoaltsrv0")
    sh("ip", "link", "set", "shoaltsrv0", "up")
    ns = ["ip", "netns", "exec", SRV_NS]
    sh(*ns, "ip", "addr", "add", f"{SRV_IP}/24", "dev", "shoaltsrv1")
    sh(*ns, "ip", "link", "set", "shoaltsrv1", "up")
    sh(*ns, "ip", "link", "set", "lo", "up")
    sh(*ns, "ip", "route", "add", "default", "via", HOST_IP)
    procs = []
    for port in (8080, 8081):
        code = ("import socket\ns=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
                f"s.bind(('{SRV_IP}', {port})); s.listen(64)\n"
                "while True:\n c,_=s.accept(); c.sendall(b'hello-%d\\n'); c.close()\n" % port)
        procs.append(subprocess.Popen([*ns, sys.executable, "-c", code]))
    time.sleep(0.5)
    yield
    for p in procs:
        p.kill()
    subprocess.run(["ip", "netns", "del", SRV_NS], check=False, capture_output=True)
    subprocess.run(["ip", "link", "del", "shoaltsrv0"], check=False, capture_output=True)


def _fetch(sb, port: int) -> str:
    return sb.commands.run(f"nc -w 2 {SRV_IP} {port} </dev/null; echo rc=$?", timeout=10).stdout


def test_default_deny_then_allow_exactly_what_is_listed(root, base_image, servers):
    with Sandbox.create(base_image, root=root) as sb:
        assert "hello" not in _fetch(sb, 8080)  # no network at all by default
        net = sb.set_network(allow=[f"{SRV_IP}:8080"])
        assert net.resolved == [f"{SRV_IP}/32:8080"] and net.subnet
        assert "hello-8080" in _fetch(sb, 8080)
        assert "hello-8081" not in _fetch(sb, 8081)  # same host, unlisted port
        assert sb.commands.run(f"nc -w 1 {HOST_IP} 22 </dev/null; echo rc=$?").stdout.strip().endswith("rc=1")
        sb.set_network(allow=[])  # replace: everything cleared
        assert "hello" not in _fetch(sb, 8080)
        sb.set_network(allow=["10.202.0.0/24"])  # a CIDR opens every port of it
        assert "hello-8081" in _fetch(sb, 8081)
        assert sb.get_network().allow == ["10.202.0.0/24"]


def test_root_in_the_sandbox_cannot_change_the_rules(root, base_image, servers):
    with Sandbox.create(base_image, root=root) as sb:
        sb.set_network(allow=[f"{SRV_IP}:8080"])
        r = sb.commands.run("ip route del default 2>&1; ip link set eth0 down 2>&1; ip addr add 10.9.9.9/32 dev eth0 2>&1")
        assert "Operation not permitted" in r.stdout or "Permission denied" in r.stdout
        assert "hello-8081" not in _fetch(sb, 8081)
        assert "hello-8080" in _fetch(sb, 8080)


def test_presets_map_to_configured_addresses(root, base_image, servers, host):
    import dataclasses

    rt = host.backend("container")
    saved = rt.settings
    rt.settings = dataclasses.replace(saved, egress_presets={"testmirror": [f"{SRV_IP}:8081"]})
    try:
        with Sandbox.create(base_image, root=root) as sb:
            sb.set_network(presets={"testmirror": True})
            assert "hello-8081" in _fetch(sb, 8081) and "hello-8080" not in _fetch(sb, 8080)
            with pytest.raises(InvalidArgument, match="not configured"):
                sb.set_network(presets={"npm": True})
    finally:
        rt.settings = saved


def test_bad_rules_are_refused(sandbox):
    for bad in (["not an address"], ["10.0.0.1:99999"], ["example-nonexistent.invalid:443"], [""]):
        with pytest.raises(InvalidArgument):
            sandbox.set_network(allow=bad)


def test_veth_is_gone_with_the_sandbox(root, base_image, servers):
    from shoal.backends.container.network import EgressManager

    sb = Sandbox.create(base_image, root=root)
    sb.set_network(allow=[f"{SRV_IP}:8080"])
    ifname = EgressManager.host_ifname(sb.id)
    assert subprocess.run(["ip", "link", "show", ifname], check=False, capture_output=True).returncode == 0
    sb.kill()
    time.sleep(0.2)
    assert subprocess.run(["ip", "link", "show", ifname], check=False, capture_output=True).returncode != 0
