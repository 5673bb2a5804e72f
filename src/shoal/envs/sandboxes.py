"""Opening a sandbox on any backend as an SDK `Sandbox`, from the loose keywords that task and
image-building code passes around (cpu=, memory_mb=, ttl=, env=, ...).

Operator tools (image builds, task generation) pass the `Host` (in-process, root); rollouts pass
whatever backend they run on, shoald by default.
"""
from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from ..core.contract import CreateRequest, SandboxBackend
from ..core.errors import InvalidArgument
from ..host import describe
from ..sdk.sandbox import Sandbox


def create_request(image: str | None, layers: list[str] | None = None, **fields: Any) -> CreateRequest:
    """A CreateRequest; an unknown or invalid field is an InvalidArgument naming it."""
    try:
        return CreateRequest(image=image, layers=layers, **fields)
    except ValidationError as e:
        raise InvalidArgument(describe(e)) from None


def open_sandbox(backend: SandboxBackend, image: str | None, layers: list[str] | None = None,
                 **fields: Any) -> Sandbox:
    """A new sandbox of `image` + `layers` on `backend` (fields: cpu, memory_mb, ttl, env, ... as in
    CreateRequest), as an SDK object bound to it."""
    return Sandbox(backend, backend.create(create_request(image, layers, **fields)))


def attach(backend: SandboxBackend, sandbox_id: str) -> Sandbox:
    """An existing sandbox on `backend` as an SDK object (SandboxNotFound if it is gone)."""
    return Sandbox(backend, backend.info(sandbox_id))
