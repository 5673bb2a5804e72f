"""The Shoal SDK (sync and async mirrors)."""
from .args import ContainerArgs, FnCallArgs, MicroVMArgs
from .async_sandbox import AsyncSandbox
from .pool import WarmPool
from .sandbox import BackgroundOutput, CommandHandle, ForkResult, OutputEvent, Sandbox, Session

__all__ = ["AsyncSandbox", "BackgroundOutput", "CommandHandle", "ContainerArgs", "FnCallArgs", "MicroVMArgs",
           "ForkResult", "OutputEvent", "Sandbox", "Session", "WarmPool"]
