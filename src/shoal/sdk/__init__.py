"""The Shoal SDK (sync and async mirrors)."""
from .args import ContainerArgs, FnCallArgs, MicroVMArgs
from .sandbox import BackgroundOutput, CommandHandle, ForkResult, OutputEvent, Sandbox, Session

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .async_sandbox import AsyncSandbox
    from .pool import WarmPool

__all__ = ["AsyncSandbox", "BackgroundOutput", "CommandHandle", "ContainerArgs", "FnCallArgs", "MicroVMArgs",
           "ForkResult", "OutputEvent", "Sandbox", "Session", "WarmPool"]


def __getattr__(name: str):
    # imported on first use: asyncio (AsyncSandbox) is ~20% of the sync SDK's import time, which the
    # CLI's in-process path (`shoal run` with no daemon) pays on every call
    if name == "AsyncSandbox":
        from .async_sandbox import AsyncSandbox

        return AsyncSandbox
    if name == "WarmPool":
        from .pool import WarmPool

        return WarmPool
    raise AttributeError(f"module 'shoal.sdk' has no attribute {name!r}")
