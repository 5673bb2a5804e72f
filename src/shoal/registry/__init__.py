"""Images through OCI registries: push and pull Shoal images, pull ordinary container images, and
read layer blobs by range for lazy loading (docs/registry.md)."""
from __future__ import annotations

from .auth import Credentials, find_credentials
from .client import RegistryClient
from .origin import RegistryOrigin, RemoteLayer
from .pull import PullResult, pull
from .push import PushResult, push
from .reference import Reference, parse_reference

__all__ = ["Credentials", "find_credentials", "RegistryClient", "RegistryOrigin", "RemoteLayer", "PullResult",
           "pull", "PushResult", "push", "Reference", "parse_reference"]
