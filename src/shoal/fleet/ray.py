"""A Shoal fleet on an existing Ray cluster, with one call.

    from shoal.fleet.ray import start_fleet
    fleet = start_fleet("postgresql://shoal@db/fleet")      # a shoald on every alive node, one gateway
    os.environ.update(fleet.env())                          # SHOAL_CA_CERT: the SDK trusts the gateway
    key = fleet.tenant("rl-job")                            # or the fleet admin key, fleet.admin_key
    Sandbox.create("python:3.11", url=fleet.url, api_key=key)
    ...
    fleet.stop()

Each host is a `HostActor` pinned to its node (`NodeAffinitySchedulingStrategy`, hard), which runs
`shoal serve --join DSN` as a child process: its own root (`root_base/<host id>`), its own Unix
socket in that root, a TCP port picked free on the node, TLS with a certificate the fleet CA signed
for the node's IP. The gateway is a `GatewayActor` (on the driver's node unless told otherwise)
running `shoal gateway`. Nothing needs a shared filesystem: the driver makes the fleet CA
(`shoal fleet init`) and hands each actor the PEM bytes it needs. PostgreSQL must be reachable from
every node at `dsn`.

Actors take no CPU (`num_cpus=0`): the sandboxes use the node's cores. Sandboxes need root, so the
Ray workers must run as root on the nodes that host them (as shoald does under systemd). Only nodes
that hold the custom resource `resource` (when given) get a host: e.g. start CPU nodes with
`--resources '{"shoal-host": 1}'` and keep sandboxes off the GPU nodes.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
except ImportError as e:  # an extra: the SDK, CLI and daemon do not need it
    raise ImportError("a fleet on Ray needs ray: pip install 'shoal[rollout]'") from e

START_S = 60.0


def _free_port(ip: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


def _write(path: Path, data: bytes, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _die_with_parent() -> None:
    """In the child: SIGTERM when the actor's process dies (the node is lost, the actor killed)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class _Child:
    """A shoald / gateway child process of an actor, its log in `log`."""

    proc: subprocess.Popen | None = None
    log: Path

    def _spawn(self, argv: list[str], env: dict[str, str]) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         preexec_fn=_die_with_parent)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, timeout: float = 20.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@ray.remote(num_cpus=0, max_restarts=0)
class HostActor(_Child):
    """One Shoal host on this actor's node: `shoal serve --join` as a child process."""

    def __init__(self, host_id: str, root: str):
        self.host_id, self.root = host_id, Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.log = self.root / "shoald.log"
        self.ip = ray.util.get_node_ip_address()
        self.port = _free_port(self.ip)

    def where(self) -> dict:
        return {"host_id": self.host_id, "node_id": ray.get_runtime_context().get_node_id(), "ip": self.ip,
                "port": self.port, "root": str(self.root), "pid": os.getpid()}

    def start(self, dsn: str, ca_pem: bytes, cert_pem: bytes, key_pem: bytes, domain: str, lease_s: float,
              serve_args: list[str]) -> dict:
        tls = self.root / "fleet-tls"
        _write(tls / "ca.pem", ca_pem, 0o644)
        _write(tls / "host.pem", cert_pem, 0o644)
        _write(tls / "host.key", key_pem, 0o600)
        host = f"[{self.ip}]" if ":" in self.ip else self.ip
        advertise = f"https://{host}:{self.port}"
        env = dict(os.environ, SHOAL_ROOT=str(self.root), SHOAL_HOST_ID=self.host_id)
        env.pop("SHOAL_URL", None)
        self._spawn([sys.executable, "-m", "shoal.cli", "serve", "--socket", str(self.root / "shoald.sock"),
                     "--join", dsn, "--advertise", advertise, "--domain", domain, "--lease", str(lease_s),
                     "--tls-cert", str(tls / "host.pem"), "--tls-key", str(tls / "host.key"),
                     "--client-ca", str(tls / "ca.pem"), *serve_args], env)
        assert self.proc is not None
        return {**self.where(), "address": advertise, "domain": domain, "child_pid": self.proc.pid}

    def status(self) -> dict:
        return {"alive": self.alive(), "log": "" if self.alive() else self.tail()}

    def shutdown(self, kill_sandboxes: bool = True) -> int | None:
        """Stop shoald (SIGTERM); then kill what still runs in this root (its sandboxes outlive a
        daemon on purpose, so that a restarted daemon finds them)."""
        rc = self.stop()
        if kill_sandboxes:
            from ..host import Host

            host = Host.get(self.root)
            for sid in host.live_ids():
                with contextlib.suppress(Exception):
                    host.kill(sid)
        return rc


@ray.remote(num_cpus=0, max_restarts=0)
class GatewayActor(_Child):
    """One gateway replica on this actor's node: `shoal gateway` as a child process."""

    def __init__(self, workdir: str):
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log = self.dir / "gateway.log"
        self.ip = ray.util.get_node_ip_address()
        self.port = _free_port(self.ip)

    def where(self) -> dict:
        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": self.ip, "port": self.port,
                "dir": str(self.dir)}

    def start(self, dsn: str, files: dict[str, bytes], cert_pem: bytes, key_pem: bytes, listen_ip: str) -> dict:
        fleet_dir = self.dir / "fleet"
        for name, data in files.items():
            _write(fleet_dir / name, data, 0o600 if name.endswith(".key") else 0o644)
        _write(self.dir / "gw.pem", cert_pem, 0o644)
        _write(self.dir / "gw.key", key_pem, 0o600)
        env = dict(os.environ)
        env.pop("SHOAL_URL", None)
        self._spawn([sys.executable, "-m", "shoal.cli", "gateway", "--db", dsn, "--listen", f"{listen_ip}:{self.port}",
                     "--fleet-dir", str(fleet_dir), "--tls-cert", str(self.dir / "gw.pem"), "--tls-key",
                     str(self.dir / "gw.key")], env)
        host = f"[{self.ip}]" if ":" in self.ip else self.ip
        return {**self.where(), "url": f"https://{host}:{self.port}"}

    def status(self) -> dict:
        return {"alive": self.alive(), "log": "" if self.alive() else self.tail()}

    def shutdown(self) -> int | None:
        return self.stop()


@dataclass
class RayFleet:
    """What `start_fleet` started: the gateways' URL (comma-separated for the SDK), the CA the SDK
    must trust, the fleet admin key, and the hosts (host id, Ray node, address, root)."""

    dsn: str
    url: str
    ca_cert: Path
    admin_key: str
    fleet_dir: Path
    hosts: list[dict] = field(default_factory=list)
    gateways: list[dict] = field(default_factory=list)
    _host_actors: list[Any] = field(default_factory=list, repr=False)
    _gateway_actors: list[Any] = field(default_factory=list, repr=False)

    def env(self) -> dict[str, str]:
        """Environment for SDK clients (workers) of this fleet: trust its CA."""
        return {"SHOAL_CA_CERT": str(self.ca_cert)}

    def tenant(self, name: str, **quotas: float) -> str:
        """A new tenant (as the fleet admin, through a gateway); its API key."""
        from ..backends.http import HttpBackend

        be = HttpBackend(self.url, self.admin_key)
        try:
            body: dict[str, Any] = {"name": name}
            if quotas:
                body["quotas"] = quotas
            return be.json("POST", "/tenants", json=body)["api_key"]
        finally:
            be.close()

    def stop(self, kill_sandboxes: bool = True) -> None:
        """Stop the gateways and every host (and, by default, the sandboxes still running on them)."""
        for a in self._gateway_actors:
            with contextlib.suppress(Exception):
                ray.get(a.shutdown.remote(), timeout=30)
        for a in self._host_actors:
            with contextlib.suppress(Exception):
                ray.get(a.shutdown.remote(kill_sandboxes), timeout=60)
        for a in self._gateway_actors + self._host_actors:
            with contextlib.suppress(Exception):
                ray.kill(a)
        self._gateway_actors, self._host_actors = [], []


def _nodes(resource: str | None) -> list[dict]:
    return [n for n in ray.nodes() if n.get("Alive") and (resource is None or n.get("Resources", {}).get(resource))]


def _pinned(node_id: str) -> NodeAffinitySchedulingStrategy:
    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)


def start_fleet(dsn: str, *, resource: str | None = None, root_base: str = "/var/lib/shoal-ray",
                fleet_dir: str | os.PathLike | None = None, gateways: int = 1, gateway_node: str | None = None,
                domain: str = "node", lease_s: float = 10.0, serve_args: list[str] | None = None,
                listen_ip: str = "0.0.0.0", timeout: float = START_S) -> RayFleet:
    """Start a shoald on every alive node of the connected Ray cluster (only nodes holding `resource`,
    when given) and `gateways` gateway replicas (on `gateway_node`, default the driver's node);
    return once every host is registered and the gateways answer.

    root_base: each host's root is root_base/<host id> on its node (host id: `ray` + the first 8
    hex digits of the node id, so roots, sockets and sandbox ids never collide, even with several
    nodes on one machine). domain: "node" (each node its own failure domain), or a fixed string.
    serve_args: more `shoal serve` flags (`--max-sandboxes 512`)."""
    from ..fleet.pki import FleetFiles, init_fleet, issue_server_cert

    if not ray.is_initialized():
        raise RuntimeError("connect to the Ray cluster first (ray.init(address=...))")
    nodes = _nodes(resource)
    if not nodes:
        raise RuntimeError(f"no alive Ray node{f' holds the resource {resource!r}' if resource else ''}")
    fdir = Path(fleet_dir) if fleet_dir else Path(tempfile.mkdtemp(prefix="shoal-ray-fleet-"))
    files = FleetFiles(fdir)
    if not files.ca_cert.exists():
        init_fleet(fdir)
    fleet = RayFleet(dsn=dsn, url="", ca_cert=files.ca_cert, admin_key=files.admin_key.read_text().strip(),
                     fleet_dir=fdir)
    try:
        for n in nodes:
            hid = "ray" + n["NodeID"][:8]
            fleet._host_actors.append(HostActor.options(  # type: ignore[attr-defined]  # ray's ActorClass
                scheduling_strategy=_pinned(n["NodeID"]), name=f"shoal-host-{hid}").remote(hid, f"{root_base}/{hid}"))
        wheres = ray.get([a.where.remote() for a in fleet._host_actors], timeout=timeout)
        certs = fdir / "certs"
        starts = []
        for a, w in zip(fleet._host_actors, wheres):
            cert, key = issue_server_cert(fdir, w["host_id"], [w["ip"]], certs)
            dom = w["node_id"][:12] if domain == "node" else domain
            starts.append(a.start.remote(dsn, files.ca_cert.read_bytes(), cert.read_bytes(), key.read_bytes(), dom,
                                         lease_s, list(serve_args or [])))
        fleet.hosts = ray.get(starts, timeout=timeout)
        gw_node = gateway_node or ray.get_runtime_context().get_node_id()
        shared = {p.name: p.read_bytes() for p in (files.ca_cert, files.gateway_cert, files.gateway_key,
                                                   files.admin_key)}
        for k in range(gateways):
            fleet._gateway_actors.append(GatewayActor.options(  # type: ignore[attr-defined]  # ray's ActorClass
                scheduling_strategy=_pinned(gw_node)).remote(str(fdir / f"gateway{k}")))
        gstarts = []
        for k, (a, w) in enumerate(zip(fleet._gateway_actors,
                                       ray.get([a.where.remote() for a in fleet._gateway_actors], timeout=timeout))):
            cert, key = issue_server_cert(fdir, f"gateway{k}", sorted({w["ip"], "127.0.0.1", "localhost"}), certs)
            gstarts.append(a.start.remote(dsn, shared, cert.read_bytes(), key.read_bytes(), listen_ip))
        fleet.gateways = ray.get(gstarts, timeout=timeout)
        fleet.url = ",".join(g["url"] for g in fleet.gateways)
        _wait_ready(fleet, timeout)
    except BaseException:
        fleet.stop()
        raise
    return fleet


def _wait_ready(fleet: RayFleet, timeout: float) -> None:
    """Every host registered (up, under its lease) and every gateway answering /v1/health."""
    import ssl

    import httpx

    from .directory import Directory
    from .schema import open_db

    want = {h["host_id"] for h in fleet.hosts}
    deadline = time.monotonic() + timeout
    ca = ssl.create_default_context(cafile=str(fleet.ca_cert))
    pending_gw = [g["url"] for g in fleet.gateways]
    up: set[str] = set()
    db = None
    while time.monotonic() < deadline:
        for a in fleet._host_actors + fleet._gateway_actors:
            st = ray.get(a.status.remote(), timeout=30)
            if not st["alive"]:
                raise RuntimeError(f"a fleet process exited on its node:\n{st['log']}")
        try:
            db = db or Directory(open_db(fleet.dsn))
            up = {h["id"] for h in db.hosts() if h["state"] == "up" and h["lease_left_s"] > 0}
        except Exception:  # noqa: BLE001 - the database may still be coming up: try again
            up = set()
        for url in list(pending_gw):
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/v1/health", verify=ca, timeout=2).status_code == 200:
                    pending_gw.remove(url)
        if want <= up and not pending_gw:
            return
        time.sleep(0.2)
    raise TimeoutError(f"fleet not ready after {timeout:.0f} s: hosts up {sorted(up)} of {sorted(want)}, "
                       f"gateways not answering {pending_gw}")
