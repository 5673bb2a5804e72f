"""Running shoald: a Unix socket by default (root-only), optionally TCP with TLS."""
from __future__ import annotations

import asyncio
import faulthandler
import os
import secrets
import signal
from pathlib import Path

import anyio.to_thread
import uvicorn

from ..host import Host
from .admission import AdmissionConfig
from .app import Daemon, create_app


# On SIGTERM, requests still running after this long are cut off: a stuck client (say, one that never
# finishes its TLS handshake) must not keep the daemon from stopping.
GRACE_S = 5


def default_socket(root: Path) -> Path:
    return root / "shoald.sock"


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


async def _serve(servers: list[uvicorn.Server]) -> None:
    # blocking handlers (exec waits on a sandbox) run in worker threads: allow many at once
    anyio.to_thread.current_default_thread_limiter().total_tokens = 2048
    await asyncio.gather(*(s.serve() for s in servers))


def serve(root: str | Path | None = None, socket_path: str | Path | None = None, tcp: str | None = None,
          tls_cert: str | None = None, tls_key: str | None = None, admission: AdmissionConfig | None = None,
          log_level: str = "warning") -> None:
    os.environ.pop("SHOAL_URL", None)  # the daemon itself always runs sandboxes in-process
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1` dumps every thread's stack
    host = Host.get(root)
    daemon = Daemon(host, admission, admin_key=load_or_create_admin_key(host.settings.root))
    app = create_app(daemon)
    app.state.trust_local = True  # key-less requests over the root-only Unix socket act as admin
    sock = Path(socket_path or default_socket(host.settings.root))
    sock.unlink(missing_ok=True)
    servers = [uvicorn.Server(uvicorn.Config(app, uds=str(sock), log_level=log_level, access_log=False,
                                             timeout_keep_alive=30, timeout_graceful_shutdown=GRACE_S))]
    if tcp:
        if not (tls_cert and tls_key) and not os.environ.get("SHOAL_ALLOW_PLAIN_TCP"):
            raise SystemExit("TCP needs --tls-cert and --tls-key (or SHOAL_ALLOW_PLAIN_TCP=1 for loopback tests)")
        h, _, p = tcp.rpartition(":")
        servers.append(uvicorn.Server(uvicorn.Config(app, host=h or "127.0.0.1", port=int(p), log_level=log_level,
                                                     access_log=False, ssl_certfile=tls_cert, ssl_keyfile=tls_key,
                                                     timeout_graceful_shutdown=GRACE_S)))

    async def main():
        task = asyncio.create_task(_serve(servers))
        while not all(s.started for s in servers):
            if task.done():
                break
            await asyncio.sleep(0.01)
        os.chmod(sock, 0o600)
        await task

    asyncio.run(main())
