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


class SandboxLost(SandboxNotFound):
    """The sandbox's host stopped answering the fleet (its lease ran out) or was cut off from it:
    the fleet's directory marks the sandbox LOST, with the reason, and it is never served again
    (the host kills it when it comes back). A SandboxNotFound, so cleanup code that tolerates a
    gone sandbox tolerates a lost one."""


class SandboxOutOfMemory(SandboxNotFound):
    """The sandbox ended because it ran out of memory (its own limit, or the limit on all of a host's
    sandboxes together) and its oom_kill policy is "sandbox", or the OOM killer took its init."""


class SandboxError(ShoalError):
    """The sandbox could not be created or an operation on it failed."""


class HostUnavailable(SandboxError):
    """A fleet gateway could not reach the host that holds a sandbox (it may be restarting, or
    about to be declared lost); the call may be retried."""

    retryable = True


class PortClosed(SandboxError):
    """Nothing in the sandbox accepts connections on that port (yet): the sandbox is there, the
    server inside is not. A 409, retryable: a server that is still starting will accept later."""

    retryable = True


class DesktopUnavailable(SandboxError):
    """The sandbox has no running desktop: no X server (never started, or a process in the sandbox
    killed it), so screenshots and input cannot work. `sb.desktop.start()` starts it again."""


class CommandTimeout(ShoalError, TimeoutError):
    def __init__(self, message: str, result: object | None = None):
        super().__init__(message)
        self.result = result


class QuotaExceeded(ShoalError):
    retryable = True


class BackendUnavailable(ShoalError):
    """The requested backend does not run on this host."""


class NotSupported(BackendUnavailable):
    """This backend cannot do that (e.g. memory reclaim on a backend without per-sandbox cgroups)."""


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


class EpisodeNotFound(ShoalError, LookupError):
    """No episode of that id in the trajectory log (or none the caller may see)."""


class BadBranchStep(InvalidArgument):
    """A branch point outside the episode: steps are counted from 1 to the episode's length."""


class BranchNotExact(ShoalError):
    """A branch could not be restored exactly: a fast-forwarded effect gave a different result than
    the logged one (a nondeterministic command), or the snapshot asked for does not exist."""


class LLMUnavailable(ShoalError):
    """The policy's chat endpoint kept failing after the bounded retries."""

    retryable = True


class OriginUnavailable(ShoalError):
    """A registry or blob origin did not answer in time, refused, or failed; the read may be retried."""

    retryable = True


class CorruptChunk(ShoalError):
    """Bytes from an origin do not match their published digest; they were not kept."""

    retryable = True


class RegistryError(ShoalError):
    """An OCI registry answered with an error (auth, unknown repository or manifest, bad request)."""


class UntrustedRegistry(RegistryError):
    """A lazy layer's registry is not in the operator's trusted_registries: its EROFS image would
    reach the host kernel unchecked (shoal.lazy.trust)."""


class DatabaseUnavailable(ShoalError):
    """The shared state database (PostgreSQL) did not answer, or the connection broke mid-statement:
    that statement happened once or not at all. Retry after a pause."""

    retryable = True


class InternalError(ShoalError):
    """A bug on the serving side (logged there with its traceback)."""


# ------------------------------------------------------------------------------------ on the wire
# Every error crosses HTTP as {"error": {"type", "message", "retryable"}}; the client raises the same
# class. Only ShoalError subclasses defined here can be named, so a body cannot make a client
# instantiate anything else.
_HTTP_STATUS: list[tuple[tuple[type[ShoalError], ...], int]] = [
    ((SandboxLost,), 410),
    ((HostUnavailable,), 503),
    ((SandboxNotFound, ImageNotFound, LayerNotFound, TenantNotFound, EpisodeNotFound), 404),
    ((QuotaExceeded, PoolExhausted), 429),
    ((LayerInUse, BranchNotExact, DesktopUnavailable, PortClosed), 409),
    ((CommandTimeout,), 408),
    ((BackendUnavailable,), 501),
    ((OriginUnavailable, CorruptChunk, RegistryError), 502),
    ((DatabaseUnavailable,), 503),
    ((InvalidArgument, CorruptArchive, FileOpError, SessionClosed), 400),
    ((Unauthorized,), 401),
]


def http_status(exc: ShoalError) -> int:
    for classes, code in _HTTP_STATUS:
        if isinstance(exc, classes):
            return code
    return 500


def to_wire(exc: ShoalError) -> dict:
    """The error body's inner object."""
    return {"type": type(exc).__name__, "message": str(exc), "retryable": exc.retryable}


def from_wire(err: dict | object, fallback: str = "") -> ShoalError:
    """The exception a client raises for an error body's inner object (unknown types: ShoalError)."""
    if not isinstance(err, dict):
        return ShoalError(fallback or repr(err))
    cls = globals().get(str(err.get("type", "")))
    if not (isinstance(cls, type) and issubclass(cls, ShoalError)):
        cls = ShoalError
    exc = cls(str(err.get("message", fallback)))
    if err.get("retryable") and not exc.retryable:
        exc.retryable = True
    return exc
