"""`FleetBackend`: the whole contract over many hosts. Creates are placed (directory.py, placement.py);
every other call goes to the sandbox's host through an `HttpBackend` (mTLS, the gateway's
certificate), so a gateway is "shoald's routes over a FleetBackend" and holds no state of its own.

Streaming passes through: a streamed exec reaches the host as a streamed exec, and each output
event the host sends is handed to the caller's callback as it arrives (the gateway's exec route
turns those into its own Server-Sent Events), never buffered to the end.
"""
from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from ..backends.http import HttpBackend
from ..backends.http.backend import HttpProcessHandle, HttpSessionHandle
from ..config import Settings
from ..core import errors as E
from ..core.contract import (
    DEFAULT_DOWNLOAD_MAX,
    DEFAULT_READ_MAX,
    PORT_CONNECT_TIMEOUT,
    CreateRequest,
    ExecRequest,
    ExecResult,
    FileEntry,
    ForkReply,
    ForkRequest,
    ImageSummary,
    Limits,
    NetworkPolicy,
    NetworkRequest,
    OutputCallback,
    PortSocket,
    ProcessHandle,
    ProcessInfo,
    ReclaimRequest,
    ReclaimResult,
    SandboxBackend,
    SandboxInfo,
    SessionHandle,
    SessionInfo,
    SessionRequest,
    SnapshotInfo,
    SnapshotRequest,
    StartRequest,
    TimeoutRequest,
    WatchHandle,
)
from ..core.postgres import redact
from ..layers.store import split_ref
from ..server.quotas import limits_of
from ..server.state import ADMIN, Tenant, own_memory_pool
from . import placement
from .directory import Directory, Entry, Slot
from .schema import CREATING, DEAD, LOST, RUNNING, UP

log = logging.getLogger("shoal.fleet")
T = TypeVar("T")
FileEntries = list[FileEntry]  # `list` is a contract method inside the class
DEAD_PEER_S = 5.0  # a host that stops acknowledging fails the call after this long (HostUnavailable)
ROUTE_CACHE_S = 1.0  # a running sandbox's host is remembered this long (see `entry`)
ROUTE_CACHE_MAX = 200_000
CONFIRM_WAIT_S = 3.0  # a call on a sandbox whose confirm has not landed waits this long, then 503 (retry)


class FleetBackend(SandboxBackend):
    name = "fleet"

    def __init__(self, directory: Directory, tls: ssl.SSLContext | None, defaults: Settings | None = None):
        self.directory = directory
        self.tls = tls
        self.defaults = defaults or Settings()
        self._clients: dict[str, HttpBackend] = {}
        self._lock = threading.Lock()
        self._routes: dict[str, tuple[Entry, float]] = {}  # sandbox id -> (entry, when read), running ones

    def __repr__(self) -> str:
        return f"FleetBackend({redact(self.directory.pg.dsn)})"

    # ---------------------------------------------------------------- hosts
    def client(self, address: str) -> HttpBackend:
        """The shared client of one host (a connection pool each), as the gateway: no key, the
        gateway's certificate."""
        with self._lock:
            c = self._clients.get(address)
            if c is None:
                c = self._clients[address] = HttpBackend(address, "", ssl_context=self.tls, dead_peer_s=DEAD_PEER_S)
            return c

    def entry(self, sandbox_id: str, tenant: Tenant | None = None, fresh: bool = False) -> Entry:
        """The directory's word on a sandbox this tenant (None: anyone) may see, live on a live
        host. SandboxNotFound (404) if unknown or another tenant's, SandboxLost (410) if lost.

        A running sandbox's entry is kept ROUTE_CACHE_S (its tenant and host never change). A stale
        one fails safe: a sandbox killed through another gateway answers 404 on its host, a dead or
        cut-off host does not answer, and either sends the call back to the directory (`_on`) for
        the real answer (404 with the reason, 410 lost); hosts that lose their lease are dropped
        from the cache within a second (`drop_hosts`, from the gateway's lease thread)."""
        e = None
        if not fresh:
            with self._lock:
                hit = self._routes.get(sandbox_id)
            if hit is not None and time.monotonic() - hit[1] < ROUTE_CACHE_S:
                e = hit[0]
        if e is None:
            e = self.directory.locate(sandbox_id) if isinstance(sandbox_id, str) else None
            if e is None and isinstance(sandbox_id, str):
                e = self._unconfirmed(sandbox_id, tenant)
            if e is not None and e.state in (RUNNING, CREATING) and e.host_gone:  # its lease ran out: settle it now
                self.directory.expire()
                e = self.directory.locate(sandbox_id) or e
            if e is not None and e.state == RUNNING and not e.host_gone and e.address:
                self.remember(e)
            else:
                self.forget_route(sandbox_id)
        if e is None or (tenant is not None and not tenant.admin and e.tenant != tenant.name):
            raise E.SandboxNotFound(f"sandbox {sandbox_id} not found")
        if e.state == LOST:
            raise E.SandboxLost(f"sandbox {sandbox_id} is lost: {e.reason or 'its host left the fleet'}")
        if e.state == DEAD:
            raise E.SandboxNotFound(f"sandbox {sandbox_id} has ended ({e.reason or 'killed'})")
        if e.host_gone or not e.address:
            raise E.SandboxLost(f"sandbox {sandbox_id} is lost: host {e.host} left the fleet")
        return e

    def _unconfirmed(self, sandbox_id: str, tenant: Tenant | None) -> Entry | None:
        """A sandbox the directory does not know by its id may be one whose confirm has not landed
        (Directory.confirm_many runs off the create's path). This process's own: wait for it. Else,
        while the caller has sandboxes on the id's host awaiting their confirm, poll for it, then
        answer 503 (retry); its host confirms it within a heartbeat if the gateway that made it
        died. A tenant with nothing unconfirmed there gets its 404 at once, and a sandbox is only
        routed once the directory says whose it is."""
        if self.directory.confirms.wait(sandbox_id):
            return self.directory.locate(sandbox_id)
        parts = sandbox_id.split("-")
        if len(parts) < 3:
            return None
        owner = None if tenant is None or tenant.admin else tenant.name
        if not self.directory.unconfirmed(parts[1], owner):
            return None
        deadline = time.monotonic() + CONFIRM_WAIT_S
        while time.monotonic() < deadline:
            time.sleep(0.01)
            e = self.directory.locate(sandbox_id)
            if e is not None:
                return e
        raise E.HostUnavailable(f"sandbox {sandbox_id} is not yet in the fleet's directory (its create is being "
                                "confirmed); retry shortly")

    def remember(self, e: Entry) -> None:
        with self._lock:
            if len(self._routes) > ROUTE_CACHE_MAX:
                self._routes.clear()
            self._routes[e.id] = (e, time.monotonic())

    def forget_route(self, sandbox_id: str) -> None:
        with self._lock:
            self._routes.pop(sandbox_id, None)

    def drop_hosts(self, up: set[str]) -> None:
        """Forget routes to hosts not in `up` and routes past their time (the gateway's lease thread)."""
        old = time.monotonic() - ROUTE_CACHE_S
        with self._lock:
            for sid in [sid for sid, (e, at) in self._routes.items() if e.host not in up or at < old]:
                del self._routes[sid]

    def _on(self, sandbox_id: str, call: Callable[[HttpBackend], T]) -> T:
        e = self.entry(sandbox_id)
        assert e.address is not None
        try:
            return call(self.client(e.address))
        except E.SandboxLost:
            self.forget_route(sandbox_id)
            raise
        except E.SandboxNotFound:  # gone on its host: the directory says why (killed, lost), if it knows
            self.forget_route(sandbox_id)
            self.entry(sandbox_id, fresh=True)
            raise
        except E.SandboxError as err:
            if err.retryable and type(err) is E.SandboxError:  # the host did not answer
                self.forget_route(sandbox_id)
                self.entry(sandbox_id, fresh=True)  # 410 if its host was declared lost meanwhile
                raise E.HostUnavailable(f"host {e.host} of sandbox {sandbox_id} does not answer ({err}); "
                                        "retry shortly") from None
            raise

    # ---------------------------------------------------------------- lifecycle
    def create(self, req: CreateRequest) -> SandboxInfo:
        return self.create_as(ADMIN, req)

    def wanted(self, req: CreateRequest) -> placement.Wanted:
        refs: list[str] = [req.image] if req.image else []
        digests: list[str] = []
        for x in req.layers or []:
            if x.startswith("sha256:"):
                digests.append(x)
            elif ":" in x:
                refs.append(x)
        pin = None
        if req.from_snapshot:
            refs.append(f"snapshots/{req.from_snapshot}:latest")
            pin = self.directory.snapshot_host(req.from_snapshot)
        return placement.Wanted(refs=tuple(refs), digests=tuple(digests), pin=pin)

    def _slot_answer(self, slot: Slot) -> SandboxInfo | None:
        """A reservation that answers an earlier create with the same key: its sandbox, or why not."""
        if slot.state == RUNNING and slot.info is not None:
            return slot.info  # a retry of a create that completed
        if slot.state == LOST:
            raise E.SandboxLost(f"sandbox {slot.sandbox_id or slot.slot} is lost: {slot.reason}")
        if slot.state == DEAD:
            raise E.SandboxNotFound(f"sandbox {slot.sandbox_id}, created under this idempotency key, has ended")
        return None

    def _made(self, tenant: Tenant, slot: Slot, host: str, address: str, info: SandboxInfo) -> SandboxInfo:
        # routed from here at once; confirmed in the directory in the background (Directory's doc)
        self.remember(Entry(info.id, slot.slot, host, tenant.name, RUNNING, None, address, False, info))
        self.directory.confirms.submit(slot.slot, info)
        return info

    def _images(self, tenant: Tenant, want: placement.Wanted) -> list[str]:
        return [] if tenant.admin else ["{}:{}".format(*split_ref(r)) for r in want.refs]

    def create_as(self, tenant: Tenant, req: CreateRequest, idempotency_key: str | None = None) -> SandboxInfo:
        """Reserve (quota + placement, one transaction), create on the host with the slot as its
        idempotency key, confirm (in the background). A host that refuses for capacity hands the
        slot to the next best."""
        req = own_memory_pool(tenant, req)  # hosts see the gateway (an admin): it names the tenant
        limits = limits_of(req, self.defaults)
        want = self.wanted(req)
        slot = self.directory.reserve(tenant, limits, want, idempotency_key, images=self._images(tenant, want))
        done = self._slot_answer(slot)
        if done is not None:
            return done
        host, address, others = slot.host, slot.address, list(slot.alternatives)
        while True:
            try:
                info = self.client(address).create(req, idempotency_key=slot.slot)
                break
            except E.QuotaExceeded:  # this host's admission refused (full, or too many starting)
                if not others:
                    self.directory.release(slot.slot)
                    raise
                host, address = others.pop(0)
                self.directory.move(slot.slot, host)
            except E.SandboxError as err:
                if err.retryable and type(err) is E.SandboxError:  # unreachable: it may have made it, or not
                    raise E.HostUnavailable(f"host {host} did not answer a create ({err}); retry with the same "
                                            "idempotency key") from None
                self.directory.release(slot.slot)
                raise
            except E.ShoalError:
                self.directory.release(slot.slot)
                raise
        return self._made(tenant, slot, host, address, info)

    def info(self, sandbox_id: str) -> SandboxInfo:
        try:
            return self._on(sandbox_id, lambda c: c.info(sandbox_id))
        except E.SandboxLost:
            raise
        except E.SandboxNotFound:  # ended on its host (TTL, idle TTL, OOM)
            self.directory.end(sandbox_id, "ended on its host")
            raise

    def kill(self, sandbox_id: str) -> None:
        try:
            self._on(sandbox_id, lambda c: c.kill(sandbox_id))
        except E.SandboxLost:
            raise
        except E.SandboxNotFound:
            self.directory.end(sandbox_id, "ended on its host")
            raise
        finally:
            self.forget_route(sandbox_id)
        self.directory.end(sandbox_id, "killed")

    def pause(self, sandbox_id: str) -> None:
        self._on(sandbox_id, lambda c: c.pause(sandbox_id))

    def resume(self, sandbox_id: str) -> None:
        self._on(sandbox_id, lambda c: c.resume(sandbox_id))

    def set_ttl(self, sandbox_id: str, req: TimeoutRequest) -> SandboxInfo:
        return self._on(sandbox_id, lambda c: c.set_ttl(sandbox_id, req))

    def reclaim(self, sandbox_id: str, req: ReclaimRequest) -> ReclaimResult:
        return self._on(sandbox_id, lambda c: c.reclaim(sandbox_id, req))

    def connect_port(self, sandbox_id: str, port: int, timeout: float = PORT_CONNECT_TIMEOUT) -> socket.socket:
        return self._on(sandbox_id, lambda c: c.connect_port(sandbox_id, port, timeout))

    def port_sockets(self, sandbox_id: str, port: int) -> list[PortSocket]:
        return self._on(sandbox_id, lambda c: c.port_sockets(sandbox_id, port))

    def guard_port(self, sandbox_id: str, port: int) -> None:
        self._on(sandbox_id, lambda c: c.guard_port(sandbox_id, port))

    def port_guarded(self, sandbox_id: str, port: int) -> bool:
        return self._on(sandbox_id, lambda c: c.port_guarded(sandbox_id, port))

    def written_under(self, sandbox_id: str, paths: list[str], limit: int = 20) -> list[str]:
        return self._on(sandbox_id, lambda c: c.written_under(sandbox_id, paths, limit))

    def watch_dir(self, sandbox_id: str, path: str, recursive: bool = False) -> WatchHandle:
        return self._on(sandbox_id, lambda c: c.watch_dir(sandbox_id, path, recursive))

    # ---------------------------------------------------------------- commands
    def exec(self, sandbox_id: str, req: ExecRequest, on_stdout: OutputCallback | None = None,
             on_stderr: OutputCallback | None = None) -> ExecResult:
        return self._on(sandbox_id, lambda c: c.exec(sandbox_id, req, on_stdout=on_stdout, on_stderr=on_stderr))

    def start(self, sandbox_id: str, req: StartRequest) -> ProcessHandle:
        return self._on(sandbox_id, lambda c: c.start(sandbox_id, req))

    def open_session(self, sandbox_id: str, req: SessionRequest) -> SessionHandle:
        return self._on(sandbox_id, lambda c: c.open_session(sandbox_id, req))

    def process_handle(self, sandbox_id: str, command_id: str) -> HttpProcessHandle:
        """The host's background command `command_id`, by its id alone (the gateway keeps none)."""
        e = self.entry(sandbox_id)
        assert e.address is not None
        return HttpProcessHandle(self.client(e.address), sandbox_id, ProcessInfo(id=command_id, pid=None), [])

    def session_handle(self, sandbox_id: str, session_id: str) -> HttpSessionHandle:
        e = self.entry(sandbox_id)
        assert e.address is not None
        return HttpSessionHandle(self.client(e.address), sandbox_id, SessionInfo(id=session_id, shell=""))

    # ---------------------------------------------------------------- files
    def read_file(self, sandbox_id: str, path: str, max_bytes: int = DEFAULT_READ_MAX) -> bytes:
        return self._on(sandbox_id, lambda c: c.read_file(sandbox_id, path, max_bytes))

    def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> int:
        return self._on(sandbox_id, lambda c: c.write_file(sandbox_id, path, data, mode))

    def list_files(self, sandbox_id: str, path: str = "/") -> FileEntries:
        return self._on(sandbox_id, lambda c: c.list_files(sandbox_id, path))

    def stat_file(self, sandbox_id: str, path: str) -> FileEntry:
        return self._on(sandbox_id, lambda c: c.stat_file(sandbox_id, path))

    def mkdir(self, sandbox_id: str, path: str) -> None:
        self._on(sandbox_id, lambda c: c.mkdir(sandbox_id, path))

    def chown(self, sandbox_id: str, path: str, uid: int, gid: int) -> None:
        self._on(sandbox_id, lambda c: c.chown(sandbox_id, path, uid, gid))

    def set_xattrs(self, sandbox_id: str, path: str, attrs: dict[str, str]) -> None:
        self._on(sandbox_id, lambda c: c.set_xattrs(sandbox_id, path, attrs))

    def remove_file(self, sandbox_id: str, path: str) -> None:
        self._on(sandbox_id, lambda c: c.remove_file(sandbox_id, path))

    def upload_tar(self, sandbox_id: str, dest_dir: str, tar: bytes) -> int:
        return self._on(sandbox_id, lambda c: c.upload_tar(sandbox_id, dest_dir, tar))

    def download_tar(self, sandbox_id: str, path: str, max_bytes: int = DEFAULT_DOWNLOAD_MAX) -> bytes:
        return self._on(sandbox_id, lambda c: c.download_tar(sandbox_id, path, max_bytes))

    # ---------------------------------------------------------------- snapshots
    def snapshot(self, sandbox_id: str, req: SnapshotRequest) -> SnapshotInfo:
        e = self.entry(sandbox_id)
        snap = self._on(sandbox_id, lambda c: c.snapshot(sandbox_id, req))
        self.directory.record_snapshot(snap.id, e.host, e.tenant)  # sandboxes restored from it go there
        return snap

    def fork(self, sandbox_id: str, req: ForkRequest) -> ForkReply:
        return self.fork_as(ADMIN, sandbox_id, req)

    def fork_as(self, tenant: Tenant, sandbox_id: str, req: ForkRequest) -> ForkReply:
        """n children on the source's host (they share its snapshot), each a slot of the tenant's
        quota taken before the host is asked; slots of children that failed are given back."""
        e = self.entry(sandbox_id, tenant)
        src = self.info(sandbox_id).limits
        child = Limits(cpu=req.cpu or src.cpu, memory_mb=req.memory_mb or src.memory_mb,
                       disk_mb=req.disk_mb or src.disk_mb, pids=req.pids or src.pids, upper=req.upper or src.upper)
        slots: list[str] = []
        try:
            for _ in range(req.n):
                slots.append(self.directory.reserve(tenant, child, placement.Wanted(pin=e.host), None).slot)
            assert e.address is not None
            reply = self.client(e.address).fork(sandbox_id, req)
        except BaseException:
            for s in slots:
                self.directory.release(s)
            raise
        for s, info in zip(slots, reply.sandboxes):
            self.directory.confirm(s, info)
        for s in slots[len(reply.sandboxes):]:
            self.directory.release(s)
        self.directory.record_snapshot(reply.snapshot.id, e.host, e.tenant)
        return reply

    # ---------------------------------------------------------------- network
    def get_network(self, sandbox_id: str) -> NetworkPolicy:
        return self._on(sandbox_id, lambda c: c.get_network(sandbox_id))

    def set_network(self, sandbox_id: str, req: NetworkRequest) -> NetworkPolicy:
        return self._on(sandbox_id, lambda c: c.set_network(sandbox_id, req))

    # ---------------------------------------------------------------- images
    def images(self) -> list[ImageSummary]:
        """Every image some live host offers (as its heartbeat reported them), once per ref."""
        seen: dict[str, ImageSummary] = {}
        for (inv,) in self.directory.pg.execute("SELECT inventory FROM fleet_hosts WHERE state=%s ORDER BY id",
                                                (UP,)).fetchall():
            for i in inv.get("images", []):
                seen.setdefault(i["ref"], ImageSummary.model_validate(i))
        return sorted(seen.values(), key=lambda i: i.ref)

    # ---------------------------------------------------------------- resources
    @property
    def address(self) -> str:
        return f"fleet:{redact(self.directory.pg.dsn)}"

    def close(self) -> None:
        with self._lock:
            clients = list(self._clients.values())
            self._clients.clear()
        for c in clients:
            c.close()

    def list_for(self, tenant: str | None) -> list[SandboxInfo]:
        """Live sandboxes (one tenant's, or all), as their hosts describe them now; a host that does
        not answer is described by what the directory recorded at creation."""
        self.directory.confirms.flush()  # this gateway's own creates are listed
        entries = self.directory.live(tenant)
        by_host: dict[str, list[Entry]] = {}
        for e in entries:
            if e.address:
                by_host.setdefault(e.address, []).append(e)

        def ask(address: str) -> dict[str, SandboxInfo] | None:
            try:
                return {i.id: i for i in self.client(address).list()}
            except E.ShoalError as err:
                log.warning("listing sandboxes on %s: %s", address, err)
                return None

        with ThreadPoolExecutor(max_workers=max(1, min(16, len(by_host)))) as pool:
            answers = dict(zip(by_host, pool.map(ask, by_host)))
        out = []
        for e in entries:
            live = answers.get(e.address or "")
            info = e.info if live is None else live.get(e.id)  # a host that answered is the truth
            if info is not None:
                out.append(info)
        return out

    def list(self) -> list[SandboxInfo]:
        return self.list_for(None)
