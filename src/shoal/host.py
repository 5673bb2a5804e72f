"""One process's handle on the local Shoal host: the layer store plus the runtime backends.

Everything is embedded (SQLite + files under the root); no daemon is needed for single-host use.
"""
from __future__ import annotations

import threading
from pathlib import Path

from pydantic import ValidationError

from .config import Settings, load_settings
from .core.errors import BackendUnavailable, ImageNotFound, InvalidArgument, LayerNotFound
from .layers.store import LayerStore
from .core.contract import Limits, SandboxInfo, SandboxSpec, SnapshotInfo

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
                from .backends.container.backend import ContainerRuntime

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

    def resolve_layers(self, image: str | None, layers: list[str] | None) -> tuple[str, list[str], dict]:
        """An image name[:tag] and/or extra layers (composed on top at creation)
        -> (label, digests bottom -> top, image config)."""
        digests: list[str] = []
        label_parts = []
        config: dict = {}
        if image:
            info = self.store.get_image(image)
            digests += info.layers
            label_parts.append(info.ref)
            config = info.config
        for ref in layers or []:
            # a layer (digest, prefix or name), or an image whose layers compose on top (workspace, toolkit)
            try:
                digests.append(self.store.resolve(ref))
                label_parts.append(digests[-1].split(":")[1][:12])
                continue
            except LayerNotFound:
                pass
            try:
                img = self.store.get_image(ref)
            except (ImageNotFound, InvalidArgument):
                raise LayerNotFound(f"{ref!r} is neither a layer nor an image") from None
            digests += img.layers
            label_parts.append(img.ref)
            config = {"env": {**config.get("env", {}), **img.config.get("env", {})},
                      "workdir": img.config.get("workdir") if img.config.get("workdir", "/") != "/"
                      else config.get("workdir", "/")}
        if not digests:
            raise InvalidArgument("give an image (name[:tag]) or a list of layers to create a sandbox")
        return "+".join(label_parts), digests, config

    def create_sandbox(self, image: str | None, layers: list[str] | None, limits: Limits,
                       ttl: float | None = None, idle_ttl: float | None = None,
                       env: dict[str, str] | None = None, hostname: str | None = None,
                       backend: str = "container", workdir: str | None = None,
                       network: str = "none") -> SandboxInfo:
        rt = self.backend(backend)
        label, digests, config = self.resolve_layers(image, layers)
        mounts = self.store.ensure_mounted(digests)
        try:
            spec = SandboxSpec(image=label, layers=digests, limits=limits, ttl=ttl, idle_ttl=idle_ttl,
                               env={**config.get("env", {}), **(env or {})}, base_env=config.get("env", {}),
                               hostname=hostname,
                               workdir=workdir or config.get("workdir", "/"), network=network)
        except ValidationError as e:
            raise InvalidArgument(_describe(e)) from None
        return rt.create(spec, mounts)

    # ------------------------------------------------------------------ pack_diff snapshots
    def snapshot(self, sandbox_id: str, exclude: list[str] | None = None, max_depth: int | None = None) -> "SnapshotInfo":
        """Turn a sandbox's writable upper into a layer on top of its stack, registered as the image
        `snapshots/<id>`. Its processes are frozen while the layer is captured, so the snapshot is
        consistent; `exclude` lists paths (e.g. build residue) left out of the layer."""
        import secrets

        rt = self.runtime
        info = rt.info(sandbox_id)
        exclude = list(self.settings.snapshot_exclude if exclude is None else exclude)
        for path in exclude:
            if not isinstance(path, str) or not path.strip("/") or "\0" in path:
                raise InvalidArgument(f"snapshot exclude entries are non-empty sandbox paths without NUL, got {path!r}")
        was_paused = info.state.value == "paused"
        if not was_paused:
            rt.pause(sandbox_id)
        try:
            layer = self.store.build_from_dir(rt.upper_dir(sandbox_id), source=f"snapshot:{sandbox_id}",
                                              exclude=exclude)
        finally:
            if not was_paused:
                rt.resume(sandbox_id)
        stack = list(info.layers) + [layer.digest]
        depth = max_depth or self.settings.max_stack_depth
        if len(stack) > depth:
            stack = self.store.fold_to_depth(stack, depth)
        snap_id = "snap-" + secrets.token_hex(6)
        img = self.store.create_image(f"snapshots/{snap_id}", stack,
                                      config={"env": info.base_env, "workdir": info.workdir,
                                              "source_sandbox": sandbox_id, "parent_layers": list(info.layers)})
        return SnapshotInfo(id=snap_id, image=img.ref, layers=list(img.layers), layer=layer.digest,
                            source_sandbox=sandbox_id, created=img.created, size=layer.size)

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
