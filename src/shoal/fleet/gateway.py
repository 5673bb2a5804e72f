"""The gateway: shoald's own /v1 routes (server/routes) over a `FleetBackend`, with tenants, keys and
quotas from PostgreSQL. It keeps nothing between requests (command and session ids are the hosts'
own), so replicas are interchangeable: run two, and a client given both URLs retries on the other.

    shoal gateway --db postgresql://… --listen 0.0.0.0:8080 --fleet-dir /etc/shoal/fleet \\
                  [--tls-cert gw.pem --tls-key gw.key]

Every replica also settles leases: once a second it turns hosts whose lease ran out `down` and
their sandboxes `lost` (directory.expire, idempotent), so a dead host is noticed within its lease
plus a second, by whichever replica looks first.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from ..config import load_settings
from ..core import errors as E
from ..core.contract import CreateRequest, ForkReply, ForkRequest, SandboxInfo
from ..server.served import Served
from ..server.state import Tenant
from .backend import FleetBackend
from .directory import Directory
from .pki import FleetFiles, gateway_client_context
from .schema import LIVE, LOST, UP, open_db
from .tenants import PgTenants

log = logging.getLogger("shoal.fleet")
EXPIRE_EVERY_S = 1.0
PRUNE_EVERY_S = 600.0


class RemoteHandles:
    """Background commands or sessions as the hosts keep them: the id a client gets is the host's
    own, so any replica can serve the next call on it. Per-sandbox caps are the host's."""

    def __init__(self, backend: FleetBackend, kind: str):
        self.backend, self.kind = backend, kind

    def add(self, sandbox_id: str, obj: Any) -> str:
        return str(obj.id)

    def get(self, sandbox_id: str, key: str) -> Any:
        if self.kind == "session":
            return self.backend.session_handle(sandbox_id, key)
        return self.backend.process_handle(sandbox_id, key)

    def pop(self, sandbox_id: str, key: str) -> None:
        self.get(sandbox_id, key).close()

    def drop_sandbox(self, sandbox_id: str) -> None:
        return None  # the host frees what a sandbox held when it ends

    def prune(self, live: set[str]) -> None:
        return None

    def count(self) -> int:
        return 0  # held by the hosts; see their /metrics


class Gateway(Served):
    backend: FleetBackend

    def __init__(self, dsn: str, fleet_dir: str | os.PathLike | None, admin_key: str | None,
                 expire_every_s: float = EXPIRE_EVERY_S):
        self._init_served()
        self.pg = open_db(dsn)
        self.directory = Directory(self.pg)
        tls = gateway_client_context(fleet_dir) if fleet_dir is not None else None
        self.backend = FleetBackend(self.directory, tls, load_settings())
        self.state = PgTenants(self.pg, self.directory)
        self.admin_key = admin_key
        self.commands = RemoteHandles(self.backend, "process")
        self.sessions = RemoteHandles(self.backend, "session")
        self.lost_total = 0
        self._stop = threading.Event()
        threading.Thread(target=self._leases, args=(expire_every_s,), name="fleet-leases", daemon=True).start()

    def _leases(self, every_s: float) -> None:
        last_prune = 0.0
        while not self._stop.wait(every_s):
            try:
                self.lost_total += self.directory.expire()
                self.backend.drop_hosts(self.directory.up_hosts())  # no cached route to a host gone down
                if time.monotonic() - last_prune > PRUNE_EVERY_S:
                    self.directory.prune()
                    last_prune = time.monotonic()
            except Exception as e:  # the database restarting: try again next round
                log.warning("lease check: %s", e)

    def close(self) -> None:
        self._stop.set()
        self.backend.close()

    # ---------------------------------------------------------------- served
    def visible(self, tenant: Tenant, sandbox_id: str) -> str:
        self.backend.entry(sandbox_id, tenant)  # 404 for another tenant's, 410 for a lost one
        return sandbox_id

    def forget(self, sandbox_id: str) -> None:
        return None  # FleetBackend.kill ended the directory row; the host closed its handles

    def create(self, tenant: Tenant, req: CreateRequest, idempotency_key: str | None = None) -> SandboxInfo:
        info = self.backend.create_as(tenant, req, idempotency_key)
        self.counters["creates"] += 1
        return info

    def check_create_images(self, tenant: Tenant, refs: list[str]) -> None:
        return None  # checked in the create's reservation (Directory.reserve), in the same round trip

    def fork(self, tenant: Tenant, sandbox_id: str, req: ForkRequest) -> ForkReply:
        reply = self.backend.fork_as(tenant, sandbox_id, req)
        self.state.own("image", reply.snapshot.image, tenant.name)
        self.counters["creates"] += len(reply.sandboxes)
        return reply

    def list_sandboxes(self, tenant: Tenant) -> list[SandboxInfo]:
        return self.backend.list_for(None if tenant.admin else tenant.name)

    def usage(self, tenant: Tenant) -> dict[str, float]:
        return self.directory.usage(tenant.name)

    def health(self) -> dict[str, Any]:
        row = self.pg.execute("SELECT count(*) FILTER (WHERE state=%s), count(*) FROM fleet_hosts", (UP,)).fetchone()
        assert row is not None
        return {"gateway": True, "hosts_up": int(row[0]), "hosts": int(row[1])}

    def gauges(self) -> dict[str, float]:
        q = "SELECT state, count(*) FROM {} GROUP BY state"
        rows: dict[str, int] = dict(self.pg.execute(q.format("fleet_sandboxes")).fetchall())
        hosts: dict[str, int] = dict(self.pg.execute(q.format("fleet_hosts")).fetchall())
        return {"fleet_hosts_up": hosts.get(UP, 0), "fleet_hosts_down": hosts.get("down", 0),
                "sandboxes": sum(rows.get(s, 0) for s in LIVE), "sandboxes_lost": rows.get(LOST, 0)}

    def totals(self) -> dict[str, int]:
        return {**self.counters, "sandboxes_lost_by_this_gateway": self.lost_total}

    def remove_image(self, ref: str) -> None:
        raise E.BackendUnavailable("a fleet's images live on its hosts and in the registry: remove them there")

    def layers(self) -> list[dict[str, Any]]:
        seen: dict[str, dict[str, Any]] = {}
        for (inv,) in self.pg.execute("SELECT inventory FROM fleet_hosts WHERE state=%s", (UP,)).fetchall():
            for digest, size in inv.get("cached", {}).items():
                seen.setdefault(digest, {"digest": digest, "size": size, "image_bytes": size, "created": 0.0,
                                         "names": [], "source": "fleet"})
        return sorted(seen.values(), key=lambda x: x["digest"])


def load_admin_key(fleet_dir: str | os.PathLike | None) -> str | None:
    """$SHOAL_ADMIN_KEY, else the fleet directory's admin.key (written by `shoal fleet init`)."""
    if os.environ.get("SHOAL_ADMIN_KEY"):
        return os.environ["SHOAL_ADMIN_KEY"]
    if fleet_dir is not None:
        path = FleetFiles(Path(fleet_dir)).admin_key
        if path.exists():
            return path.read_text().strip()
    return None


def serve_gateway(dsn: str, listen: str, fleet_dir: str | None, tls_cert: str | None = None,
                  tls_key: str | None = None, log_level: str = "warning") -> None:
    """Run one gateway replica until SIGTERM."""
    import uvicorn

    from ..server.app import create_app
    from ..server.server import GRACE_S, _serve

    if not (tls_cert and tls_key) and not os.environ.get("SHOAL_ALLOW_PLAIN_TCP"):
        raise SystemExit("the gateway serves tenants' keys: give --tls-cert and --tls-key (or SHOAL_ALLOW_PLAIN_TCP=1 "
                         "behind a TLS-terminating proxy or on loopback)")
    gw = Gateway(dsn, fleet_dir, load_admin_key(fleet_dir))
    app = create_app(gw, title="shoal gateway")
    host, _, port = listen.rpartition(":")
    server = uvicorn.Server(uvicorn.Config(app, host=host or "127.0.0.1", port=int(port), ssl_certfile=tls_cert,
                                           ssl_keyfile=tls_key, log_level=log_level, access_log=False,
                                           timeout_keep_alive=30, timeout_graceful_shutdown=GRACE_S))
    log.warning("shoal gateway on %s (directory %s)", listen, gw.backend.address)
    try:
        asyncio.run(_serve([(server, None)]))
    finally:
        gw.close()
