"""Sandboxes that operator tools (image builds, task generation, grading) open on this host, in-process.

These tools run as root next to the layer store, so they talk to the `Host` directly rather than
through shoald. This is the one place where they turn a host create into an SDK `Sandbox`.
"""
from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from ..core.contract import CreateRequest
from ..core.errors import InvalidArgument
from ..host import Host, describe
from ..sdk.sandbox import Sandbox


def create_request(image: str | None, layers: list[str] | None = None, **fields: Any) -> CreateRequest:
    """A CreateRequest; an unknown or invalid field is an InvalidArgument naming it."""
    try:
        return CreateRequest(image=image, layers=layers, **fields)
    except ValidationError as e:
        raise InvalidArgument(describe(e)) from None


def open_sandbox(host: Host, image: str | None, layers: list[str] | None = None, **fields: Any) -> Sandbox:
    """A new sandbox of `image` + `layers` on `host` (fields: cpu, memory_mb, ttl, env, ... as in
    CreateRequest), as an SDK object bound to the host."""
    info = host.create(create_request(image, layers, **fields))
    return Sandbox(host, info)


def attach(host: Host, sandbox_id: str) -> Sandbox:
    """An existing sandbox on `host` as an SDK object (SandboxNotFound if it is gone)."""
    return Sandbox(host, host.info(sandbox_id))
