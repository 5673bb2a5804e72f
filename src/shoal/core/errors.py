"""Typed errors. Every message names the thing that is wrong, so a user can act on it."""
from __future__ import annotations


class ShoalError(Exception):
    """Base class of every error Shoal raises on purpose."""

    retryable: bool = False


class InvalidArgument(ShoalError, ValueError):
    """A parameter is out of range or malformed (negative limit, bad path, bad spec...)."""


class LayerNotFound(ShoalError, LookupError):
    pass


class BadDigest(InvalidArgument):
    pass


class ImageNotFound(ShoalError, LookupError):
    pass


class LayerInUse(ShoalError):
    """The layer is referenced by an image or a live sandbox and cannot be removed."""


class CorruptArchive(ShoalError, ValueError):
    """A tar / docker-save / OCI archive could not be read or is unsafe."""


class BuildError(ShoalError):
    """mkfs.erofs (or another build tool) failed."""


class SandboxNotFound(ShoalError, LookupError):
    pass


class SandboxError(ShoalError):
    """The sandbox could not be created or an operation on it failed."""


class CommandTimeout(ShoalError, TimeoutError):
    def __init__(self, message: str, result: object | None = None):
        super().__init__(message)
        self.result = result


class QuotaExceeded(ShoalError):
    retryable = True


class BackendUnavailable(ShoalError):
    """The requested backend does not run on this host."""


class FileOpError(ShoalError, OSError):
    """A files API call failed inside the sandbox (missing file, not a directory...)."""


class PathOutsideSandbox(InvalidArgument):
    """A path tried to leave the sandbox root."""


class SessionClosed(ShoalError):
    """The persistent shell of a session exited."""


class PoolExhausted(ShoalError):
    retryable = True


class Unauthorized(ShoalError, PermissionError):
    """Missing or invalid API key, or an admin-only call made with a tenant key."""


class TenantNotFound(ShoalError, LookupError):
    pass


class TrajectoryDivergence(ShoalError):
    """On replay, a request differs from the one the trajectory log holds at that sequence number.

    Replay stops there: serving the old result for a different request (or re-running it on top of
    a state the log no longer describes) would silently mix two histories."""

    def __init__(self, message: str, stream: str = "", seq: int = -1):
        super().__init__(message)
        self.stream, self.seq = stream, seq


class UnknownOutcome(ShoalError):
    """The log holds an operation that was in flight when its writer died: it may or may not have
    taken effect, so it is never re-run blindly. Settle it (`Stream.settle`) to go on."""

    def __init__(self, message: str, stream: str = "", seq: int = -1, request: dict | None = None):
        super().__init__(message)
        self.stream, self.seq, self.request = stream, seq, request or {}


class LLMUnavailable(ShoalError):
    """The policy's chat endpoint kept failing after the bounded retries."""

    retryable = True
