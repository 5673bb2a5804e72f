"""One process's handle on the local Shoal host: the layer store plus the runtime backends.

Everything is embedded (SQLite + files under the root); no daemon is needed for single-host use.
"""
from __future__ import annotations

import threading
from pathlib import Path

from pydantic import ValidationError

from .config import Settings, load_settings
from .errors import BackendUnavailable, InvalidArgument
from .layers.store import LayerStore
from .runtime.abstract import Limits, SandboxInfo, SandboxSpec

_hosts: dict[Path, "Host"] = {}
_hosts_lock = threading.Lock()


class Host:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.store = LayerStore(settings)
        self._runtime = None
        self._runtime_lock = threading.Lock()

    @classmethod
    def get(cls, root: str | Path | None = None) -> "Host":
        """The shared Host for a root (one per process and root)."""
        settings = load_settings(root)
        with _hosts_lock:
            host = _hosts.get(settings.root)
            if host is None:
                host = _hosts[settings.root] = cls(settings)
            return host

    @property
    def runtime(self):
        """The container runtime; created (and orphans swept) on first use."""
        with self._runtime_lock:
            if self._runtime is None:
                from .runtime.container.backend import ContainerRuntime

                rt = ContainerRuntime(self.settings)
                rt.sweep()
                self._runtime = rt
            return self._runtime

    def backend(self, name: str):
        if name == "container":
            return self.runtime
        if name in ("fncall", "microvm"):
            raise BackendUnavailable(f"backend {name!r} is not available on this host yet; use backend='container'")
        raise InvalidArgument(f"unknown backend {name!r}; choose one of: container, fncall, microvm")

    def resolve_layers(self, image: str | None, layers: list[str] | None) -> tuple[str, list[str]]:
        """An image name[:tag] and/or extra layers (composed on top at creation) -> (label, digests)."""
        digests: list[str] = []
        label_parts = []
        if image:
            info = self.store.get_image(image)
            digests += info.layers
            label_parts.append(info.ref)
        if layers:
            extra = [self.store.resolve(l) for l in layers]
            digests += extra
            label_parts += [d.split(":")[1][:12] for d in extra]
        if not digests:
            raise InvalidArgument("give an image (name[:tag]) or a list of layers to create a sandbox")
        return "+".join(label_parts), digests

    def create_sandbox(self, image: str | None, layers: list[str] | None, limits: Limits,
                       ttl: float | None = None, idle_ttl: float | None = None,
                       env: dict[str, str] | None = None, hostname: str | None = None,
                       backend: str = "container") -> SandboxInfo:
        rt = self.backend(backend)
        label, digests = self.resolve_layers(image, layers)
        mounts = self.store.ensure_mounted(digests)
        try:
            spec = SandboxSpec(image=label, layers=digests, limits=limits, ttl=ttl, idle_ttl=idle_ttl,
                               env=env or {}, hostname=hostname)
        except ValidationError as e:
            raise InvalidArgument(_describe(e)) from None
        return rt.create(spec, mounts)

    def gc(self) -> dict:
        reaped = self.runtime.sweep()
        result = self.store.gc(live=self.runtime.live_layers())
        result["sandboxes_reaped"] = reaped
        return result

    def remove_layer(self, ref: str):
        return self.store.remove_layer(ref, live=self.runtime.live_layers())


def _describe(e: ValidationError) -> str:
    """One line per problem, naming the field: 'ttl: must be > 0 seconds, got -1'."""
    return "; ".join(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg'].removeprefix('Value error, ')}"
                     for err in e.errors())
