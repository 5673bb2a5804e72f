"""A Shoal fleet on one machine, for tests/fleet: hosts in their own network namespaces, gateways.

Topology: a bridge `shfb0` (10.77.0.1/24) in the root namespace; each host i in namespace
`shoal-fh<i>` with one veth end (10.77.0.1<i>) and the other on the bridge, so the host is reachable
only over its veth (cutting it cuts the host off, PostgreSQL included). Each host has its own Shoal
root, its own shoald (TLS with a certificate of the fleet CA, mTLS for gateways) and joins the
fleet's database. Gateways run in the root namespace on loopback ports, serving TLS to clients.
Everything is torn down by `Fleet.close()` (namespaces, veths, bridge, daemons, sandboxes)."""
from __future__ import annotations

import os
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

BRIDGE, BRIDGE_IP, PREFIX = "shfb0", "10.77.0.1", "10.77.0"
HOST_PORT = 8443
LEASE_S = 3.0
START_S = float(os.environ.get("SHOAL_TEST_DAEMON_START_S", "30"))


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(argv), capture_output=True, text=True, timeout=60)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip()}")
    return r


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class FleetHost:
    index: int
    domain: str
    root: Path
    proc: subprocess.Popen | None = None

    @property
    def name(self) -> str:
        return f"fh{self.index}"

    @property
    def ns(self) -> str:
        return f"shoal-fh{self.index}"

    @property
    def veth(self) -> str:
        return f"shfv{self.index}"

    @property
    def ip(self) -> str:
        return f"{PREFIX}.1{self.index}"

    @property
    def url(self) -> str:
        return f"https://{self.ip}:{HOST_PORT}"

    @property
    def sock(self) -> Path:
        return self.root / "shoald.sock"

    @property
    def log(self) -> Path:
        return self.root / "shoald.log"


@dataclass
class GatewayProc:
    port: int
    log: Path
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"


@dataclass
class Fleet:
    pg: object  # tests/pgctl.PgServer
    dsn: str  # as the root namespace reaches the database
    host_dsn: str  # as hosts reach it, over their veths
    fleet_dir: Path
    work: Path
    hosts: list[FleetHost] = field(default_factory=list)
    gateways: list[GatewayProc] = field(default_factory=list)
    # how a host's shoald is started (bench/fleet.py: bench/fleet_nullhost.py, a shoald with a null backend)
    serve_cmd: list[str] = field(default_factory=lambda: [sys.executable, "-m", "shoal.cli"])
    serve_args: list[str] = field(default_factory=list)  # more `shoal serve` flags

    # ---------------------------------------------------------------- topology
    @staticmethod
    def clear_topology(n: int) -> None:
        for i in range(1, n + 1):
            sh("ip", "netns", "del", f"shoal-fh{i}", check=False)
            sh("ip", "link", "del", f"shfv{i}", check=False)
        sh("ip", "link", "del", BRIDGE, check=False)

    def make_topology(self) -> None:
        self.clear_topology(len(self.hosts))
        sh("ip", "link", "add", BRIDGE, "type", "bridge")
        sh("ip", "addr", "add", f"{BRIDGE_IP}/24", "dev", BRIDGE)
        sh("ip", "link", "set", BRIDGE, "up")
        for h in self.hosts:
            sh("ip", "netns", "add", h.ns)
            sh("ip", "link", "add", h.veth, "type", "veth", "peer", "name", "eth0", "netns", h.ns)
            sh("ip", "link", "set", h.veth, "master", BRIDGE, "up")
            sh("ip", "-n", h.ns, "addr", "add", f"{h.ip}/24", "dev", "eth0")
            sh("ip", "-n", h.ns, "link", "set", "eth0", "up")
            sh("ip", "-n", h.ns, "link", "set", "lo", "up")

    def cut(self, h: FleetHost) -> None:
        sh("ip", "link", "set", h.veth, "down")

    def restore(self, h: FleetHost) -> None:
        sh("ip", "link", "set", h.veth, "up")

    # ---------------------------------------------------------------- hosts
    def start_host(self, h: FleetHost) -> None:
        env = dict(os.environ, SHOAL_ROOT=str(h.root), SHOAL_HOST_ID=h.name)
        env.pop("SHOAL_URL", None)
        d = self.fleet_dir
        argv = ["nsenter", f"--net=/run/netns/{h.ns}", *self.serve_cmd, "serve",
                "--socket", str(h.sock), "--max-starting", "8", "--tls-cert", str(d / f"{h.name}.pem"),
                "--tls-key", str(d / f"{h.name}.key"), "--join", self.host_dsn, "--advertise", h.url,
                "--client-ca", str(d / "ca.pem"), "--domain", h.domain, "--lease", str(LEASE_S), *self.serve_args]
        with open(h.log, "ab") as log:
            h.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.wait_registered(h)

    def wait_registered(self, h: FleetHost, timeout: float = START_S) -> None:
        import psycopg

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if h.proc is not None and h.proc.poll() is not None:
                raise RuntimeError(f"shoald of {h.name} exited:\n{h.log.read_text()[-4000:]}")
            try:
                with psycopg.connect(self.dsn, autocommit=True) as c:
                    row = c.execute("SELECT state FROM fleet_hosts WHERE id=%s AND address=%s AND "
                                    "lease_until > extract(epoch from clock_timestamp())", (h.name, h.url)).fetchone()
                if row and row[0] == "up":
                    return
            except psycopg.Error:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{h.name} did not register:\n{h.log.read_text()[-4000:]}")

    def stop_host(self, h: FleetHost, sig: int = signal.SIGTERM) -> None:
        if h.proc is None:
            return
        if h.proc.poll() is None:
            h.proc.send_signal(sig)
            try:
                h.proc.wait(20)
            except subprocess.TimeoutExpired:
                h.proc.kill()
                h.proc.wait()
        h.proc = None

    def ensure_hosts(self) -> None:
        """Every host's shoald running (a test may have killed one and failed before restarting it)."""
        for h in self.hosts:
            if h.proc is None or h.proc.poll() is not None:
                self.restore(h)
                self.start_host(h)

    def host_of(self, sandbox_id: str) -> FleetHost:
        tag = sandbox_id.split("-")[1]
        return next(h for h in self.hosts if h.name == tag)

    def local_ids(self, h: FleetHost) -> set[str]:
        """The sandboxes live on a host, asked from its own root (not through any daemon)."""
        from shoal import Host

        return Host.get(h.root).live_ids()

    # ---------------------------------------------------------------- gateways
    def start_gateway(self, g: GatewayProc) -> None:
        env = dict(os.environ)
        env.pop("SHOAL_URL", None)
        d = self.fleet_dir
        argv = [sys.executable, "-m", "shoal.cli", "gateway", "--db", self.dsn, "--listen", f"127.0.0.1:{g.port}",
                "--fleet-dir", str(d), "--tls-cert", str(d / "gw.pem"), "--tls-key", str(d / "gw.key")]
        with open(g.log, "ab") as log:
            g.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if g.proc.poll() is not None:
                raise RuntimeError(f"gateway exited:\n{g.log.read_text()[-4000:]}")
            try:
                ca = ssl.create_default_context(cafile=str(d / "ca.pem"))
                if httpx.get(g.url + "/v1/health", verify=ca, timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"gateway did not start:\n{g.log.read_text()[-4000:]}")

    def stop_gateway(self, g: GatewayProc, sig: int = signal.SIGTERM) -> None:
        if g.proc is not None and g.proc.poll() is None:
            g.proc.send_signal(sig)
            try:
                g.proc.wait(20)
            except subprocess.TimeoutExpired:
                g.proc.kill()
                g.proc.wait()
        g.proc = None

    def ensure_gateways(self) -> None:
        for g in self.gateways:
            if g.proc is None or g.proc.poll() is not None:
                self.start_gateway(g)

    @property
    def url(self) -> str:
        """Both gateways: the SDK tries the next when one cannot be reached."""
        return ",".join(g.url for g in self.gateways)

    @property
    def admin_key(self) -> str:
        return (self.fleet_dir / "admin.key").read_text().strip()

    def admin(self):
        from shoal.backends.http import HttpBackend

        return HttpBackend(self.url, self.admin_key)

    def tenant(self, name: str, **quotas: float) -> str:
        """A new tenant (through a gateway, as the fleet admin); its key."""
        q = {"sandboxes": 10, "cpu": 16, "memory_mb": 8192, "disk_mb": 16384, **quotas}
        be = self.admin()
        try:
            return be.json("POST", "/tenants", json={"name": name, "quotas": q})["api_key"]
        finally:
            be.close()

    # ---------------------------------------------------------------- teardown
    def close(self) -> None:
        for g in self.gateways:
            try:
                self.stop_gateway(g, signal.SIGKILL)
            except Exception:
                pass
        for h in self.hosts:
            try:
                self.stop_host(h, signal.SIGKILL)
            except Exception:
                pass
        from roots import wipe_root

        for h in self.hosts:
            try:
                wipe_root(h.root)
            except Exception:
                pass
        self.clear_topology(len(self.hosts))
        import shutil

        shutil.rmtree(self.work, ignore_errors=True)  # the CA, the gateways' logs


def build_fleet(pg, n_hosts: int = 3, domains: tuple[str, ...] = ("rack-a", "rack-a", "rack-b"),
                serve_cmd: list[str] | None = None, serve_args: list[str] | None = None, n_gateways: int = 2) -> Fleet:
    """Start the whole fleet (see the module doc); the caller closes it."""
    from shoal.fleet.pki import init_fleet, issue_server_cert

    dsn = pg.new_database()
    db = dsn.rsplit("/", 1)[1]
    work = Path(tempfile.mkdtemp(prefix="shoal-fleet-", dir="/tmp"))
    fleet_dir = work / "pki"
    init_fleet(fleet_dir)
    fleet = Fleet(pg=pg, dsn=dsn, host_dsn=pg.dsn(db, address=BRIDGE_IP), fleet_dir=fleet_dir, work=work)
    if serve_cmd:
        fleet.serve_cmd = serve_cmd
    fleet.serve_args = list(serve_args or [])
    for i in range(1, n_hosts + 1):
        root = Path(tempfile.mkdtemp(prefix=f"shfh{i}-", dir="/tmp"))
        fleet.hosts.append(FleetHost(i, domains[(i - 1) % len(domains)], root))
        issue_server_cert(fleet_dir, f"fh{i}", [f"{PREFIX}.1{i}"], fleet_dir)
    issue_server_cert(fleet_dir, "gw", ["127.0.0.1", "localhost"], fleet_dir)
    fleet.gateways = [GatewayProc(free_port(), work / f"gateway{k}.log") for k in range(1, n_gateways + 1)]
    try:
        fleet.make_topology()
        pg.allow_network(BRIDGE_IP, f"{PREFIX}.0/24")  # once the bridge has its address
        for h in fleet.hosts:
            seed_root(h.root)
        for h in fleet.hosts:
            fleet.start_host(h)
        fleet.ensure_gateways()
    except BaseException:
        fleet.close()
        raise
    return fleet


def seed_root(root: Path) -> None:
    """The busybox base image in a host's own store (each host has its own layers)."""
    from shoal import Host
    from shoal.layers.busybox import make_busybox_tree

    host = Host.get(root)
    tree = make_busybox_tree(Path(tempfile.mkdtemp(prefix="bb-", dir=str(root))))
    host.store.build_from_dir(tree, source="busybox", name="busybox")
    host.store.create_image("busybox:test", ["busybox"])
