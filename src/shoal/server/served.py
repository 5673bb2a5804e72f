"""What the /v1 routes need from what they serve: one host (`daemon.Daemon`, state in SQLite) or a
fleet (`shoal.fleet.gateway.Gateway`, state in PostgreSQL). Routes call only this interface, so the
same API, SDK and CLI front either, and neither reaches into the other's internals."""
from __future__ import annotations

import abc
import time
from typing import Any, Protocol

from ..core import errors as E
from ..core.contract import CreateRequest, ForkReply, ForkRequest, SandboxBackend, SandboxInfo
from .idle import authorized
from .state import Quotas, Tenant


class TenantStore(Protocol):
    """Tenants, their keys (hashed) and who owns what: `state.DaemonState` (SQLite) on one host,
    `shoal.fleet.tenants.PgTenants` (PostgreSQL) on a fleet."""

    def tenant_for_key(self, key: str) -> Tenant | None: ...

    def cached_tenant(self, key: str) -> Tenant | None:
        """The key's tenant if this process has it in memory (no I/O: asked on the event loop)."""
        ...

    def tenant_for_uid(self, name: str) -> Tenant: ...

    def create_tenant(self, name: str, quotas: Quotas | None = None) -> tuple[Tenant, str]: ...

    def get_tenant(self, name: str) -> Tenant: ...

    def list_tenants(self) -> list[Tenant]: ...

    def set_quotas(self, name: str, quotas: Quotas) -> Tenant: ...

    def delete_tenant(self, name: str) -> None: ...

    def own(self, kind: str, ref: str, tenant: str) -> None: ...

    def owner(self, kind: str, ref: str) -> str | None: ...

    def owned(self, kind: str, tenant: str) -> list[str]: ...

    def disown(self, kind: str, ref: str) -> None: ...


class Handles(Protocol):
    """Live background commands or sessions under ids the server hands out (`handles.HandleTable`
    on a host; a stateless pass-through of the host's ids on a fleet gateway)."""

    def add(self, sandbox_id: str, obj: Any) -> str: ...

    def get(self, sandbox_id: str, key: str) -> Any: ...

    def pop(self, sandbox_id: str, key: str) -> None: ...

    def drop_sandbox(self, sandbox_id: str) -> None: ...

    def prune(self, live: set[str]) -> None: ...

    def count(self) -> int: ...


class Served(abc.ABC):
    """The served side of the API. Subclasses set the attributes and implement what differs
    between a host and a fleet: creation (quotas, admission, placement), listing, usage, images."""

    backend: SandboxBackend
    state: TenantStore
    admin_key: str | None
    counters: dict[str, int]
    commands: Handles
    sessions: Handles
    started: float = 0.0

    def _init_served(self) -> None:
        self.counters = {"requests": 0, "creates": 0, "execs": 0, "errors_4xx": 0, "errors_5xx": 0}
        self.started = time.time()

    # ---------------------------------------------------------------- visibility
    def visible(self, tenant: Tenant, sandbox_id: str) -> str:
        """The id, if the tenant may see that sandbox; SandboxNotFound (404, never 403) otherwise."""
        if not tenant.admin and self.state.owner("sandbox", sandbox_id) != tenant.name:
            raise E.SandboxNotFound(f"sandbox {sandbox_id} not found")
        authorized(sandbox_id)  # the request is activity for the idle policy from here (idle.py)
        return sandbox_id

    def keep(self, table: Handles, sandbox_id: str, obj: Any) -> str:
        """Keep a live handle under an id the client can name again."""
        return table.add(sandbox_id, obj)

    def lookup(self, table: Handles, tenant: Tenant, sandbox_id: str, key: str) -> Any:
        """The handle `key` of a sandbox the tenant may see; 404 otherwise."""
        return table.get(self.visible(tenant, sandbox_id), key)

    def forget(self, sandbox_id: str) -> None:
        """The sandbox is gone: drop its ownership record and close what it held."""
        self.state.disown("sandbox", sandbox_id)
        for table in (self.commands, self.sessions):
            table.drop_sandbox(sandbox_id)

    def check_image(self, tenant: Tenant, ref: str) -> None:
        """ImageNotFound unless the image is the tenant's or shared (no owner)."""
        from ..layers.store import split_ref

        name, tag = split_ref(ref)
        owner = self.state.owner("image", f"{name}:{tag}")
        if owner is not None and not tenant.admin and owner != tenant.name:
            raise E.ImageNotFound(f"image {name}:{tag} not found (see `shoal image ls`)")

    def check_create_images(self, tenant: Tenant, refs: list[str]) -> None:
        """The images a create names, checked before it (a fleet gateway checks them in the same
        database round trip as the create's quota and placement, and overrides this)."""
        for ref in refs:
            self.check_image(tenant, ref)

    def list_sandboxes(self, tenant: Tenant) -> list[SandboxInfo]:
        infos = self.backend.list()
        if tenant.admin:
            return infos
        mine = set(self.state.owned("sandbox", tenant.name))
        return [i for i in infos if i.id in mine]

    # ---------------------------------------------------------------- what differs
    @abc.abstractmethod
    def create(self, tenant: Tenant, req: CreateRequest, idempotency_key: str | None = None) -> SandboxInfo:
        """A new sandbox owned by `tenant`, within its quotas. With an idempotency key, a repeated
        call (a client's retry, maybe through another replica) answers the same sandbox."""

    @abc.abstractmethod
    def fork(self, tenant: Tenant, sandbox_id: str, req: ForkRequest) -> ForkReply: ...

    @abc.abstractmethod
    def usage(self, tenant: Tenant) -> dict[str, float]:
        """What the tenant's live sandboxes hold (sandboxes, cpu, memory_mb, disk_mb)."""

    @abc.abstractmethod
    def health(self) -> dict[str, Any]:
        """The /health body beyond `ok` and `version` (no auth: nothing about anyone's sandboxes)."""

    @abc.abstractmethod
    def gauges(self) -> dict[str, float]:
        """Prometheus gauges for /metrics."""

    def totals(self) -> dict[str, int]:
        """Prometheus counters for /metrics (each printed as shoal_<name>_total)."""
        return dict(self.counters)

    @abc.abstractmethod
    def remove_image(self, ref: str) -> None: ...

    @abc.abstractmethod
    def layers(self) -> list[dict[str, Any]]:
        """Every layer: digest, size, image_bytes, created, names, source."""
