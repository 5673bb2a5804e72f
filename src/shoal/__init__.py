"""Shoal: composable EROFS-layer sandboxes for agentic RL and agent evaluation."""
from . import errors
from .errors import (BadDigest, CommandTimeout, CorruptArchive, ImageNotFound, InvalidArgument, LayerInUse,
                     LayerNotFound, QuotaExceeded, SandboxError, SandboxNotFound, SessionClosed, ShoalError)
from .host import Host
from .runtime.abstract import ExecResult, Limits, SandboxInfo
from .sdk import (AsyncSandbox, ContainerArgs, FnCallArgs, MicroVMArgs, Sandbox, WarmPool)

__version__ = "0.1.0"
__all__ = ["AsyncSandbox", "BadDigest", "CommandTimeout", "ContainerArgs", "CorruptArchive", "ExecResult",
           "FnCallArgs", "Host", "ImageNotFound", "InvalidArgument", "LayerInUse", "LayerNotFound", "Limits",
           "MicroVMArgs", "QuotaExceeded", "Sandbox", "SandboxError", "SandboxInfo", "SandboxNotFound",
           "SessionClosed", "ShoalError", "WarmPool", "errors"]
