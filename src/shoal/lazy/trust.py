"""Which registries may hand this host native EROFS layers that the host kernel parses unchecked.

A Shoal image's layers are EROFS images built by whoever pushed them. Pulled eagerly, each passes
`fsck.erofs --extract` (userspace) before the kernel mounts it; pulled lazily, its bytes arrive on
demand while the kernel already reads the mounted image, so no whole image exists to check first.
A tenant who can push to a registry this host pulls from would reach the kernel's EROFS parser with
crafted metadata (docs/security.md). So lazy layers are taken only from registries (or repository
prefixes in them) the operator names here; an image from any other registry is pulled eagerly and
checked (`PullResult.note` says so), and a lazy layer whose registry is not trusted (any more) is
not mounted (`UntrustedRegistry`). Ordinary tar+gzip/zstd layers are unaffected: Shoal extracts and
builds their EROFS images itself.

Entries, from `trusted_registries = [...]` in the config file and from $SHOAL_TRUSTED_REGISTRIES
(comma- or space-separated), are matched against the pull's registry and repository:

    "registry.corp"              any port of that host (case-insensitive)
    "registry.corp:5000"         that port only
    "registry.corp:5000/team"    repositories `team` and `team/...` there only

Nothing is trusted by default."""
from __future__ import annotations

import os
from collections.abc import Iterable

from ..core.errors import InvalidArgument, UntrustedRegistry

ENV = "SHOAL_TRUSTED_REGISTRIES"
DOCKER_HUB = "registry-1.docker.io"  # shoal.registry.reference.DOCKER_HUB (not imported: config loads this)
_HUB_ALIASES = {"docker.io", "index.docker.io", DOCKER_HUB}


def _host_port(registry: str) -> tuple[str, str]:
    reg = registry.strip().lower()
    if reg in _HUB_ALIASES:
        reg = DOCKER_HUB
    if reg.startswith("["):  # [v6 address]:port
        host, _, rest = reg.partition("]")
        return host + "]", rest.removeprefix(":")
    host, _, port = reg.partition(":")
    return host, port


def check_entry(entry: str) -> str:
    """`entry` stripped, or InvalidArgument when it cannot name a registry."""
    e = entry.strip().rstrip("/")
    if not e or any(c.isspace() for c in e) or "://" in e or "@" in e or e.startswith("/"):
        raise InvalidArgument(f"trusted_registries: {entry!r} is not host[:port][/repository-prefix]")
    return e


def entries(configured: Iterable[str] = ()) -> list[str]:
    """The configured entries, then those of $SHOAL_TRUSTED_REGISTRIES (read now: a test or a daemon
    may set it after import)."""
    env = os.environ.get(ENV, "").replace(",", " ").split()
    return [check_entry(e) for e in [*configured, *env]]


def is_trusted(registry: str, repository: str, configured: Iterable[str] = ()) -> bool:
    host, port = _host_port(registry)
    repo = repository.strip("/")
    for e in entries(configured):
        where, _, prefix = e.partition("/")
        e_host, e_port = _host_port(where)
        if e_host != host or (e_port and e_port != port):
            continue
        if not prefix or repo == prefix or repo.startswith(prefix + "/"):
            return True
    return False


def check_lazy_layer(digest: str, spec: dict, configured: Iterable[str] = ()) -> None:
    """Refuse to mount lazy layer `digest` (origin `spec`) when its registry is not trusted. Origins
    of other kinds (a plain HTTP server or bucket, `register_http_layer`) are named one layer at a time
    by the operator and pass."""
    if spec.get("kind") != "registry":
        return
    registry = str(spec.get("registry") or "")
    repo = str(spec.get("key") or "").rpartition("@")[0]
    if not is_trusted(registry, repo, configured):
        raise UntrustedRegistry(
            f"lazy layer {digest} comes from {registry}/{repo}, which is not in trusted_registries: its EROFS "
            f"image would reach the host kernel unchecked, so it is not mounted. Trust that registry (config "
            f"trusted_registries or ${ENV}), or `shoal layer rm` it and pull the image without --lazy "
            f"(checked by fsck.erofs first)")
