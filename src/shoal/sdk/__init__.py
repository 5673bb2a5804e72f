"""The Shoal SDK: `Sandbox` over any backend, and its generated asyncio twin `AsyncSandbox`."""
from ..core.contract import OutputEvent, ProcessHandle, ProcessOutput, SessionHandle
from .sandbox import ForkResult, Sandbox

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .async_sandbox import AsyncSandbox
    from .pool import WarmPool

__all__ = ["AsyncSandbox", "ForkResult", "OutputEvent", "ProcessHandle", "ProcessOutput", "Sandbox", "SessionHandle",
           "WarmPool"]


def __getattr__(name: str):
    # imported on first use: asyncio (AsyncSandbox) is ~20% of the sync SDK's import time
    if name == "AsyncSandbox":
        from .async_sandbox import AsyncSandbox

        return AsyncSandbox
    if name == "WarmPool":
        from .pool import WarmPool

        return WarmPool
    raise AttributeError(f"module 'shoal.sdk' has no attribute {name!r}")
