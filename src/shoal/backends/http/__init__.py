"""The `http` backend: a client of shoald implementing the whole contract with the same models.

    backend = client_for("unix:///run/shoal/shoald.sock")      # this host's daemon (the default)
    backend = client_for("https://host:8443", api_key="sk-…")   # another host, TLS ($SHOAL_CA_CERT)
"""
from __future__ import annotations

from .backend import (
    HttpBackend,
    HttpProcessHandle,
    HttpSessionHandle,
    client_for,
    close_clients,
    default_url,
)

__all__ = ["HttpBackend", "HttpProcessHandle", "HttpSessionHandle", "client_for", "close_clients", "default_url"]
