"""Shoal: composable EROFS-layer sandboxes for agentic RL and agent evaluation."""
from __future__ import annotations

from .core import errors
from .core.errors import (BadDigest, CommandTimeout, CorruptArchive, ImageNotFound, InvalidArgument, LayerInUse,
                     LayerNotFound, QuotaExceeded, SandboxError, SandboxNotFound, SessionClosed, ShoalError)

TYPE_CHECKING = False  # not `typing.TYPE_CHECKING`: importing typing costs ~5 ms on the CLI's hot path
if TYPE_CHECKING:
    from typing import Any

    from .host import Host
    from .core.contract import ExecResult, Limits, SandboxInfo
    from .sdk import AsyncSandbox, Sandbox, WarmPool

__version__ = "0.1.0"
__all__ = ["AsyncSandbox", "BadDigest", "CommandTimeout", "CorruptArchive", "ExecResult",
           "Host", "ImageNotFound", "InvalidArgument", "LayerInUse", "LayerNotFound", "Limits",
           "QuotaExceeded", "Sandbox", "SandboxError", "SandboxInfo", "SandboxNotFound",
           "SessionClosed", "ShoalError", "WarmPool", "errors"]

# Imported on first use (PEP 562): `import shoal` must stay cheap so the CLI's hot path
# (shoal.cli_fast, which talks to shoald) does not pay for pydantic, the layer store and the SDK.
_LAZY = {"Host": ".host", "ExecResult": ".core.contract", "Limits": ".core.contract",
         "SandboxInfo": ".core.contract", "AsyncSandbox": ".sdk",
         "Sandbox": ".sdk", "WarmPool": ".sdk"}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'shoal' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
