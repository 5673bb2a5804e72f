"""What every route shares: the served backend, tenants and ownership, admission, live handles, metrics.

shoald serves a `SandboxBackend`: in practice this host (`shoal.host.Host`), which also offers the
housekeeping a daemon needs (`ServedBackend`). The daemon never goes through the SDK.
"""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ..config import Settings
from ..core import errors as E
from ..core.contract import Limits, SandboxBackend, SandboxInfo
from .admission import Admission, AdmissionConfig
from .handles import HandleTable
from .quotas import QuotaBook
from .state import DaemonState, Tenant

log = logging.getLogger("shoald")


@runtime_checkable
class Housekeeping(Protocol):
    """What shoald needs beyond the contract: cheap views of what holds resources, and the reaper."""

    settings: Settings
    store: Any  # shoal.layers.store.LayerStore: images and layers

    def sweep(self) -> list[str]: ...

    def live_ids(self) -> set[str]: ...

    def committed(self) -> list[Limits]: ...

    def live_layers(self) -> set[str]: ...


class Daemon:
    def __init__(self, backend: Any, admission: AdmissionConfig | None = None, admin_key: str | None = None,
                 state_path: Path | None = None, reap_every_s: float = 5.0):
        if not (isinstance(backend, SandboxBackend) and isinstance(backend, Housekeeping)):
            raise E.InvalidArgument(f"shoald serves a SandboxBackend that keeps house (sweep, live_ids, committed, "
                                    f"live_layers, settings, store), such as Host; got {type(backend).__name__}")
        self.backend = backend
        self.settings: Settings = backend.settings
        self.state = DaemonState(state_path or self.settings.root / "shoald.db")
        self.admission = Admission(admission)
        self.admin_key = admin_key
        cfg = self.admission.cfg
        # the backend's live ProcessHandle / SessionHandle objects, under ids this daemon issues
        self.commands = HandleTable("cmd", "background command", cfg.commands_per_sandbox,
                                    finished=lambda h: h.poll() is not None)
        self.sessions = HandleTable("ses", "session", cfg.sessions_per_sandbox)
        self.quotas = QuotaBook(self)
        self.counters = {"requests": 0, "creates": 0, "execs": 0, "errors_4xx": 0, "errors_5xx": 0}
        self.started = time.time()
        self._start_backends()
        threading.Thread(target=self._reap, args=(reap_every_s,), name="shoald-reaper", daemon=True).start()

    def _start_backends(self) -> None:
        """Sweep orphans and reattach to the live sandboxes of every local backend before serving."""
        starter = getattr(self.backend, "backend", None)
        if starter is None:
            return
        from ..backends import LOCAL_BACKENDS

        for name in LOCAL_BACKENDS:
            try:
                starter(name)
            except Exception as e:  # e.g. gVisor not installed: its sandboxes cannot exist either
                log.warning("backend %s not started: %s", name, e)

    def _reap(self, every_s: float) -> None:
        """Close the sessions and commands of sandboxes that ended on their own (TTL, OOM, crash)."""
        while True:
            time.sleep(every_s)
            try:
                self.backend.sweep()  # state of sandboxes whose supervising processes are both gone
                live = self.backend.live_ids()
                self.commands.prune(live)
                self.sessions.prune(live)
            except Exception as e:  # keep reaping; a failed round is retried in a few seconds
                log.warning("handle reaper: %s", e)

    # ---------------------------------------------------------------- visibility
    def visible(self, tenant: Tenant, sandbox_id: str) -> str:
        """The id, if the tenant may see that sandbox; SandboxNotFound (404, never 403) otherwise."""
        if not tenant.admin and self.state.owner("sandbox", sandbox_id) != tenant.name:
            raise E.SandboxNotFound(f"sandbox {sandbox_id} not found")
        return sandbox_id

    def info(self, tenant: Tenant, sandbox_id: str) -> SandboxInfo:
        return self.backend.info(self.visible(tenant, sandbox_id))

    def keep(self, table: HandleTable, sandbox_id: str, obj: Any) -> str:
        """Keep a live handle under a fresh id, within the per-sandbox cap."""
        table.prune(self.backend.live_ids())  # forget what sandboxes that ended on their own held
        return table.add(sandbox_id, obj)

    def lookup(self, table: HandleTable, tenant: Tenant, sandbox_id: str, key: str) -> Any:
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
