"""The backends: siblings behind `shoal.core.contract.SandboxBackend`.

  container  namespaces + cgroups + overlayfs over EROFS layers, with a small C init (this host, root)
  gvisor     the same layer stacks under gVisor's user-space kernel, runsc (this host, root)
  http       a client of shoald: any of the above on this or another host, as a normal user

`open_backend()` picks where sandboxes run: in this process (`url="local"`, the host's local
backends) or through shoald (the default).
"""
from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..core.contract import SandboxBackend
    from .local import LocalBackend

# name -> (sandbox id prefix, "module:class"); the host routes requests by the id prefix
LOCAL_BACKENDS: dict[str, tuple[str, str]] = {
    "container": ("sb", "shoal.backends.container.backend:ContainerBackend"),
    "gvisor": ("gv", "shoal.backends.gvisor.backend:GvisorBackend"),
}

LOCAL = "local"  # url value: run sandboxes in this process (needs root), not through shoald


def load_local_backend(name: str) -> type[LocalBackend]:
    module, _, cls = LOCAL_BACKENDS[name][1].partition(":")
    return getattr(importlib.import_module(module), cls)


def open_backend(url: str | None = None, api_key: str | None = None,
                 root: str | os.PathLike | None = None) -> SandboxBackend:
    """url "local": this host in-process (root only). Otherwise shoald at `url`, $SHOAL_URL, or the
    host's default socket. Clients are shared per (url, key, root): one connection pool each."""
    url = url or os.environ.get("SHOAL_URL")
    if url == LOCAL:
        from ..host import Host

        return Host.get(root)
    from .http import client_for

    return client_for(url, api_key, root)
