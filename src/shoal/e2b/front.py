"""The E2B front's shared parts: the backend it drives (any `SandboxBackend`, through the contract only),
keys, the sandbox index, templates, and the typed error the REST side answers with."""
from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..core.contract import SandboxBackend
from .ports import Starts
from .state import Boxes, Keys
from .templates import DEFAULT_TEMPLATES, HOME, USER

if TYPE_CHECKING:
    from fastapi import Request

    from .snapshots import SnapshotIndex
    from .state import Box


class ApiError(Exception):
    """An error of the REST control plane or envd's plain HTTP routes: status + `{code, message}`."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def not_running(sandbox_id: str) -> ApiError:
    # the SDK tells "sandbox gone" from other 502s by the words "was not found"
    return ApiError(502, f"The sandbox {sandbox_id} was not found (killed, paused or timed out)")


@dataclass(frozen=True)
class Limits:
    """What one tenant may hold in the front (0 = no limit). On top of these, a front over shoald
    (`--url` with a tenant key) is held to that tenant's quotas (sandboxes, CPU, memory, disk): the
    backend's QuotaExceeded answers 429 as these do."""

    sandboxes: int = 100  # live sandboxes per tenant (paused ones count)
    streams: int = 64  # open Start/Connect/WatchDir streams per tenant
    processes: int = 64  # running background processes per sandbox (each keeps 2 x 4 MiB of output)
    watchers: int = 16  # polling watchers (CreateWatcher) per sandbox
    watch_entries: int = 20_000  # entries a watcher re-lists each poll; a bigger tree is refused
    ports: int = 64  # open proxied connections to sandbox ports per tenant (requests in flight, WebSockets)
    port_connects: int = 8  # connects into sandboxes in flight per tenant (each holds a pool thread)
    port_answer_s: float = 60.0  # seconds a sandbox port has to send a response head (then 504)
    # backend watches (inotify) per tenant, streams and watchers together: the backend's own caps are
    # per sandbox and per process, so one tenant's two sandboxes could otherwise take them all
    watches: int = 8


class StreamSlots:
    """A count per tenant with a cap (open streams, creates in flight)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, int] = {}

    def take(self, tenant: str, limit: int) -> bool:
        with self._lock:
            n = self._open.get(tenant, 0)
            if limit and n >= limit:
                return False
            self._open[tenant] = n + 1
            return True

    def take_room(self, tenant: str, cap: int, live: Callable[[], int]) -> bool:
        """A slot while `live()` (the tenant's sandboxes now) plus the slots in flight stay under `cap`.
        Counted under the lock: a create or fork registers its sandbox before it gives its slot back,
        so two racing calls can never both see the room of one."""
        with self._lock:
            n = self._open.get(tenant, 0)
            if n + live() >= cap:
                return False
            self._open[tenant] = n + 1
            return True

    def give(self, tenant: str) -> None:
        with self._lock:
            n = self._open.get(tenant, 0) - 1
            if n > 0:
                self._open[tenant] = n
            else:
                self._open.pop(tenant, None)


def _snapshot_index() -> SnapshotIndex:
    from .snapshots import SnapshotIndex

    return SnapshotIndex()


@dataclass
class Front:
    backend: SandboxBackend
    keys: Keys
    templates: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_TEMPLATES))
    default_timeout: float = 300.0  # E2B's default sandbox lifetime, seconds
    user: str = USER
    home: str = HOME
    boxes: Boxes = field(default_factory=Boxes)
    limits: Limits = field(default_factory=Limits)
    streams: StreamSlots = field(default_factory=StreamSlots)
    creating: StreamSlots = field(default_factory=StreamSlots)  # creates in flight per tenant
    starts: Starts = field(default_factory=Starts)  # templates' start commands (ports.py)
    sandbox_backend: str | None = None  # the isolation backend of new sandboxes (CreateRequest.backend)
    domain: str | None = None  # get_host's domain: only PORT-ID.<domain> hosts are proxied (None: any)
    ports: StreamSlots = field(default_factory=StreamSlots)  # proxied connections open per tenant
    port_connects: StreamSlots = field(default_factory=StreamSlots)  # connects in flight per tenant
    watches: StreamSlots = field(default_factory=StreamSlots)  # backend watches open per tenant
    snapshots: SnapshotIndex = field(default_factory=lambda: _snapshot_index())  # snapshots.py
    # blocking waits of output streams (one per open Start/Connect/WatchDir stream): a pool of its own,
    # so long-lived streams never starve the request handlers' thread pool
    stream_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=256, thread_name_prefix="e2b-stream"))

    def tenant_of(self, request: Request) -> str:
        """The tenant of the request's X-API-KEY (401 without a known key): one check for every router."""
        tenant = self.keys.tenant(request.headers.get("x-api-key"))
        if tenant is None:
            raise ApiError(401, "Invalid API key: pass a key from `shoal e2b key create` in X-API-KEY")
        return tenant

    def owned(self, request: Request, sandbox_id: str) -> Box:
        """The caller's own live sandbox; another tenant's answers 404, as a missing one does."""
        tenant = self.tenant_of(request)
        box = self.boxes.get(sandbox_id)
        if box is None or box.tenant != tenant:
            raise ApiError(404, f"sandbox {sandbox_id!r} not found")
        return box

    def close(self) -> None:
        for box in self.boxes.all():
            for proc in list(box.procs.values()):
                proc.handle.close()
            self.starts.forget(box.id)
        self.stream_pool.shutdown(wait=False, cancel_futures=True)
