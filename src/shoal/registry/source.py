"""Image sources for rollout workers and fleets (`pull_from`): another host's root, or a registry.

`pull_from="oci://REGISTRY/PREFIX"` (or any `REGISTRY/PREFIX` whose first part is a host, when it
is not a local directory) makes a worker pull image `NAME:TAG` from `REGISTRY/PREFIX/NAME:TAG`,
verified and fetching only the layers its host lacks, instead of hard-linking from a shared root.
An operator publishes images there with `shoal push NAME:TAG REGISTRY/PREFIX/NAME:TAG`.
`oci://REGISTRY/PREFIX?lazy` (or `RegistrySource(prefix, lazy=True)`) pulls lazily: the worker's
host registers the Shoal layers it lacks to be read on demand (docs/registry.md, "Lazy pull")."""
from __future__ import annotations

import os
from pathlib import Path

from ..config import load_settings
from ..core.errors import InvalidArgument
from ..layers.store import ImageInfo, ImageSource, LayerStore
from .pull import pull
from .reference import DOCKER_HUB, parse_reference


class RegistrySource:
    """Images under one registry prefix; credentials and CA as for `shoal pull` (env, Docker config,
    SHOAL_REGISTRY_CA)."""

    def __init__(self, prefix: str, ca: str | None = None, insecure: bool = False, lazy: bool = False):
        prefix, _, query = prefix.partition("?")
        self.prefix = prefix.removeprefix("oci://").rstrip("/")
        self.ca, self.insecure = ca, insecure
        self.lazy = lazy or query.split("=")[0] == "lazy" and query.partition("=")[2] in ("", "1", "true")

    def remote(self, ref: str) -> str:
        name, _, tag = ref.partition(":")
        return f"{self.prefix}/{name}:{tag or 'latest'}"

    def pull_into(self, store: LayerStore, ref: str) -> ImageInfo:
        return pull(store, self.remote(ref), ref, ca=self.ca, insecure=self.insecure, lazy=self.lazy).image

    def __repr__(self) -> str:
        return f"RegistrySource({self.prefix!r}{', lazy' if self.lazy else ''})"


def open_image_source(spec: str | os.PathLike) -> ImageSource:
    """A Shoal root (a directory) or `oci://REGISTRY/PREFIX` -> an ImageSource."""
    text = str(spec)
    if text.startswith("oci://"):
        return RegistrySource(text)
    if Path(text).is_dir():
        return LayerStore(load_settings(text))
    try:
        ref = parse_reference(text + "/x")
    except InvalidArgument:
        ref = None
    if ref is not None and ref.registry != DOCKER_HUB:
        return RegistrySource(text)
    raise InvalidArgument(f"pull_from {text!r}: neither a Shoal root directory nor oci://REGISTRY/PREFIX")
