"""Running shoald: the only privileged process. A Unix socket (group `shoal`), optionally TCP with TLS.

Who reaches it: the socket is root:shoal 0660 in a root:shoal 0750 directory (`/run/shoal` by
default), so root and members of the `shoal` group can connect and nobody else can. Each Unix
connection's peer uid is read with SO_PEERCRED (peercred.py): root without a key is the admin,
anyone else is a tenant (auth.py). Over TCP every request needs a key.
"""
from __future__ import annotations

import asyncio
import faulthandler
import grp
import logging
import os
import secrets
import signal
import socket
import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio.to_thread
import uvicorn

from ..config import DEFAULT_SOCKET, SOCKET_GROUP
from ..core.errors import SandboxError
from .admission import AdmissionConfig
from .app import create_app
from .daemon import Daemon
from .ensure import answering
from .peercred import PeerCredProtocol

log = logging.getLogger("shoald")

# On SIGTERM, requests still running after this long are cut off: a stuck client (say, one that never
# finishes its TLS handshake) must not keep the daemon from stopping.
GRACE_S = 5


def admin_key_file(root: Path) -> Path:
    return root / "admin.key"


def load_or_create_admin_key(root: Path) -> str:
    """The admin key lives in <root>/admin.key (0600); created on the first start."""
    path = admin_key_file(root)
    env = os.environ.get("SHOAL_ADMIN_KEY")
    if env:
        return env
    if path.exists():
        return path.read_text().strip()
    key = "sk-admin-" + secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key


def socket_group(name: str = SOCKET_GROUP) -> int:
    """The gid of the group allowed on the socket; the system group is created if missing."""
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        pass
    try:
        subprocess.run(["groupadd", "--system", name], check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or e
        raise SandboxError(f"cannot create the system group {name!r} for shoald's socket: {detail}") from None
    return grp.getgrnam(name).gr_gid


def bind_socket(path: Path, gid: int) -> socket.socket:
    """A listening Unix socket at `path`: root:<gid> 0660. Its directory is created root:<gid> 0750
    when missing (and kept so when it is the default's, /run/shoal); an existing one is left alone."""
    parent = path.parent
    if not parent.exists() or path == DEFAULT_SOCKET:
        parent.mkdir(mode=0o750, parents=True, exist_ok=True)
        os.chown(parent, 0, gid)
        os.chmod(parent, 0o750)
    path.unlink(missing_ok=True)  # a dead daemon's (serve() checked that none answers)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # bound with the umask's mode (no group/other write: nobody else can connect yet), then opened up
    sock.bind(str(path))
    os.chown(path, 0, gid)
    os.chmod(path, 0o660)
    sock.listen(2048)
    sock.setblocking(False)
    return sock


async def _serve(servers: list[tuple[uvicorn.Server, list[socket.socket] | None]]) -> None:
    # blocking handlers (exec waits on a sandbox) run in worker threads: allow many at once
    anyio.to_thread.current_default_thread_limiter().total_tokens = 2048
    await asyncio.gather(*(s.serve(sockets=socks) for s, socks in servers))


@dataclass(frozen=True)
class FleetJoin:
    """`shoal serve --join`: this host takes part in a fleet (shoal.fleet.agent). Its TCP port then
    serves TLS and accepts only clients with a certificate of the fleet CA (`client_ca`)."""

    dsn: str
    advertise: str  # the URL gateways reach this host at, https://HOST:PORT
    client_ca: str
    domain: str = ""
    lease_s: float = 10.0


def serve(root: str | Path | None = None, socket_path: str | Path | None = None, tcp: str | None = None,
          tls_cert: str | None = None, tls_key: str | None = None, admission: AdmissionConfig | None = None,
          log_level: str = "warning", group: str = SOCKET_GROUP, fleet: FleetJoin | None = None) -> None:
    if os.geteuid() != 0:
        raise SystemExit("shoald runs sandboxes (mounts, namespaces, cgroups): start it as root "
                         "(`sudo shoal serve`); clients in the `shoal` group then need no root")
    sock_path = Path(socket_path or os.environ.get("SHOAL_SOCKET") or DEFAULT_SOCKET)
    if answering(sock_path):  # never take the socket of a live daemon (say, the host's, from a test's daemon)
        raise SystemExit(f"a shoald already answers on {sock_path}: stop it first, or pass another --socket")
    if fleet is not None:
        if not (tls_cert and tls_key):
            raise SystemExit("a fleet host serves TLS: give --tls-cert and --tls-key (`shoal fleet cert`)")
        tcp = tcp or urlsplit(fleet.advertise).netloc
    from ..host import Host

    os.environ.pop("SHOAL_URL", None)  # the daemon itself always runs sandboxes in-process
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1` dumps every thread's stack
    host = Host.get(root)
    daemon = Daemon(host, admission, admin_key=load_or_create_admin_key(host.settings.root))
    from .protect import protect_from_settings

    protect_from_settings(host.settings)  # after the backends: v2's memory controller is enabled by then
    app = create_app(daemon)
    unix = bind_socket(sock_path, socket_group(group))
    # A request head up to 256 KiB reaches the app, so an over-long query (a 4,096-character path of
    # 4-byte characters is ~49 KiB percent-encoded) gets the API's typed JSON 422, not h11's plain 400.
    common: dict[str, Any] = dict(log_level=log_level, access_log=False, timeout_keep_alive=30,
                                  timeout_graceful_shutdown=GRACE_S, h11_max_incomplete_event_size=256 * 1024)
    servers: list[tuple[uvicorn.Server, list[socket.socket] | None]] = [
        (uvicorn.Server(uvicorn.Config(app, http=PeerCredProtocol, **common)), [unix])]
    if tcp:
        if not (tls_cert and tls_key) and not os.environ.get("SHOAL_ALLOW_PLAIN_TCP"):
            raise SystemExit("TCP needs --tls-cert and --tls-key (or SHOAL_ALLOW_PLAIN_TCP=1 for loopback tests)")
        h, _, p = tcp.rpartition(":")
        mtls: dict[str, Any] = {}
        if fleet is not None:  # only the fleet's gateways: a verified client certificate, or no handshake
            mtls = dict(ssl_ca_certs=fleet.client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED, http=PeerCredProtocol)
        servers.append((uvicorn.Server(uvicorn.Config(app, host=h.strip("[]") or "127.0.0.1", port=int(p),
                                                      ssl_certfile=tls_cert, ssl_keyfile=tls_key, **mtls,
                                                      **common)), None))
    agent = None
    if fleet is not None:
        from ..fleet.agent import HostAgent

        agent = HostAgent(daemon, fleet.dsn, fleet.advertise, fleet.domain, fleet.lease_s)
        agent.start()  # reconciles now; registers once the TCP port answers
    log.warning("shoald serving %s on %s%s", host.settings.root, sock_path, f" and {tcp}" if tcp else "")
    try:
        asyncio.run(_serve(servers))
    finally:
        if agent is not None:
            agent.stop()
