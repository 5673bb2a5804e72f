"""The sandbox contract: every model that crosses a boundary, and the one `SandboxBackend` ABC.

Everything a sandbox can do is a method of `SandboxBackend`. Backends are siblings that implement it
(`shoal.backends.container`, `.gvisor`, `.http`); the SDK (`shoal.sdk`) is written once over it, and
shoald (`shoal.server`) serves one. The pydantic models below are also the wire schema: the daemon
parses requests into them and the HTTP backend sends and reads exactly these, so there is no second
copy of the API's shapes anywhere.

Ownership of handles: `start()` and `open_session()` return live objects (`ProcessHandle`,
`SessionHandle`) that hold resources (pipes, buffers, a remote id). Close them when done; killing the
sandbox closes them too.
"""
from __future__ import annotations

import abc
import enum
import math
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .errors import InvalidArgument, NotSupported

if TYPE_CHECKING:
    from ..desktop.actions import ActionResult, DesktopAction

API_PREFIX = "/v1"  # every shoald route lives under it; the HTTP backend prefixes the same constant

# The longest TTL, idle TTL or command timeout: 7 days. They travel as milliseconds in 32-bit fields
# (init's protocol, epoll/poll timeouts: at most 24.8 days), so an unbounded float would overflow.
MAX_SECONDS = 7 * 24 * 3600.0
DEFAULT_READ_MAX = 64 << 20  # bytes a files.read returns at most unless asked for more
DEFAULT_DOWNLOAD_MAX = 1 << 30  # bytes of file content a tar download carries at most
MAX_OUTPUT_CAP = 64 << 20  # bytes of one stream a command's result may keep
PORT_CONNECT_TIMEOUT = 5.0  # seconds connect_port waits for a sandbox's listener


def check_port(port: object) -> int:
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise InvalidArgument(f"port must be an integer in 1..65535, not {port!r}")
    return port


def check_seconds(name: str, v: float | None) -> float | None:
    """A lifetime or timeout: None (none) or a finite number of seconds in (0, MAX_SECONDS]."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v <= MAX_SECONDS):
        raise InvalidArgument(f"{name} must be > 0 and <= {MAX_SECONDS:.0f} seconds (7 days) or null, got {v!r}")
    return float(v)


def to_ms(v: float | None) -> int:
    """Seconds -> whole milliseconds for init, never rounding a real duration down to 0 (= none)."""
    return 0 if v is None else max(1, math.ceil(v * 1000))


def _seconds(v: float | None, info) -> float | None:
    try:
        return check_seconds(info.field_name, v)
    except InvalidArgument as e:
        raise ValueError(str(e)) from None


class _Wire(BaseModel):
    """Base of every wire model: unknown fields are an error (a typo must not be ignored silently),
    and bytes travel as base64 in JSON."""

    model_config = ConfigDict(extra="forbid", ser_json_bytes="base64", val_json_bytes="base64")


# ------------------------------------------------------------------------------------ sandboxes
UpperKind = Literal["tmpfs", "disk"]
# what an OOM kill inside a sandbox (its own memory limit, or all sandboxes' together) ends: "command"
# (the killed command reports oom_killed, the sandbox lives on) or "sandbox" (it ends, tombstone oom)
OomKill = Literal["command", "sandbox"]
NetworkMode = Literal["none", "host"]
# "own": the sandbox has a memory cgroup of its own (a hard limit of memory_mb); "pooled": it shares one
# with up to [density] memory_pool_size others, limited to the sum of their memory_mb (docs/density.md,
# "Pooled memory cgroups"): for dense idle fleets, where a memory cgroup per sandbox costs kernel memory
# that grows with the number of sandboxes
MemoryCgroup = Literal["own", "pooled"]
_MEMORY_CGROUP = ("'own': a memory cgroup of its own, memory_mb a hard limit; 'pooled' (container backend): "
                  "a memory cgroup shared with up to the host's memory_pool_size sandboxes, limited to the sum "
                  "of their memory_mb (cheaper in kernel memory; no per-sandbox usage, reclaim or cap)")
# pooled sandboxes share a memory cgroup only with sandboxes of the same memory_pool key: a pool member
# can push its neighbours into an OOM kill, so shoald sets the key to the tenant (no cross-tenant pools)
MEMORY_POOL_PATTERN = r"^[A-Za-z0-9._:@-]{0,128}$"
_MEMORY_POOL = ("pooled sandboxes share a memory cgroup only with sandboxes of the same key; shoald sets it to "
                "the calling tenant (an admin's value is kept: a fleet gateway passes its tenant on)")
Priority = Literal["normal", "idle"]  # CPU class: "idle" runs only on CPU time nothing else wants

# Density options of a sandbox (docs/ksm-and-scheduling.md); the same descriptions on every model
_KSM = ("merge identical pages with other ksm sandboxes (prctl PR_SET_MEMORY_MERGE; Linux >= 6.4). "
        "Opt-in: merged pages are a timing side channel between the sandboxes that share them")
_ASLR = ("false: processes start with ASLR off (ADDR_NO_RANDOMIZE), so identical interpreters lay out "
         "identically and KSM merges far more of them; weaker exploit mitigation inside the sandbox")
_PRIORITY = "'normal', or 'idle': the sandbox's cgroup runs in the idle CPU class (cpu.idle), behind every normal one"


class Limits(BaseModel):
    """Resources of one sandbox. All must be positive."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    cpu: float = Field(1.0, description="CPU cores (CFS quota); fractional allowed")
    memory_mb: int = Field(512, description="memory limit, MiB (a tmpfs upper's pages count too)")
    disk_mb: int = Field(1024, description="size cap of the writable upper, MiB (ENOSPC past it)")
    pids: int = Field(512, description="maximum number of processes/threads")
    upper: UpperKind = Field(
        "tmpfs", description="where the writable upper lives: 'tmpfs' (memory-backed, size=disk_mb) or "
                             "'disk' (an ext4 file system of disk_mb on a loop device, on the Shoal root's disk)")
    oom_kill: OomKill = Field(
        "command", description="at the memory limit: 'command' (the OOM-killed command reports oom_killed, the "
                               "sandbox lives on) or 'sandbox' (the whole sandbox ends, reason oom)")
    memory_cgroup: MemoryCgroup = Field("own", description=_MEMORY_CGROUP)
    memory_pool: str = Field("", pattern=MEMORY_POOL_PATTERN, description=_MEMORY_POOL)

    @field_validator("cpu", "memory_mb", "disk_mb", "pids")
    @classmethod
    def _positive(cls, v, info):
        if v is None or v <= 0:
            raise ValueError(f"{info.field_name} must be > 0, got {v}")
        return v


class CreateRequest(_Wire):
    """Create a sandbox from an image and/or layers composed on top of it, or from a snapshot.
    Limits left out (null) take the host's defaults."""

    image: str | None = Field(None, description="image reference name[:tag]")
    layers: list[str] | None = Field(None, description="layers or images composed on top, bottom -> top")
    from_snapshot: str | None = Field(None, description="restore this snapshot (snap-<12 hex>) as a new sandbox")
    backend: str | None = Field(None, description="isolation backend on the host ('container', 'gvisor'); "
                                                  "null = the host's default")
    cpu: float | None = Field(None, gt=0, description="cores; null = the host default")
    memory_mb: int | None = Field(None, gt=0)
    disk_mb: int | None = Field(None, gt=0)
    pids: int | None = Field(None, gt=0)
    upper: UpperKind | None = Field(None, description="'tmpfs' (default) or 'disk'")
    oom_kill: OomKill | None = Field(None, description="'command' or 'sandbox'; null = the host's default")
    memory_cgroup: MemoryCgroup | None = Field(None, description=_MEMORY_CGROUP + "; null = the host's default")
    memory_pool: str | None = Field(None, pattern=MEMORY_POOL_PATTERN, description=_MEMORY_POOL)
    ttl: float | None = Field(None, description="absolute lifetime in seconds from creation")
    idle_ttl: float | None = Field(None, description="seconds without any request before the sandbox ends")
    env: dict[str, str] | None = None
    hostname: str | None = Field(None, max_length=64)
    workdir: str | None = Field(None, description="default working directory; null = the image's")
    network: NetworkMode = Field("none", description="'none': own network namespace with only lo; "
                                                     "'host': the host's network (image builds only)")
    ksm: bool = Field(False, description=_KSM)
    aslr: bool = Field(True, description=_ASLR)
    priority: Priority = Field("normal", description=_PRIORITY)

    _ttl = field_validator("ttl", "idle_ttl")(_seconds)


class SandboxSpec(BaseModel):
    """A create request resolved by the host: what a local backend launches."""

    image: str = Field(description="image reference name[:tag] (or a layer-stack label)")
    layers: list[str] = Field(description="layer digests, bottom -> top")
    limits: Limits = Limits()
    ttl: float | None = Field(None, description="absolute lifetime in seconds from creation")
    idle_ttl: float | None = Field(None, description="seconds without any request before the sandbox ends")
    env: dict[str, str] = Field(default_factory=dict)
    base_env: dict[str, str] = Field(default_factory=dict, description="the part of env that came from the image")
    hostname: str | None = None
    workdir: str = Field("/", description="default working directory of commands")
    network: NetworkMode = "none"
    ksm: bool = Field(False, description=_KSM)
    aslr: bool = Field(True, description=_ASLR)
    priority: Priority = Field("normal", description=_PRIORITY)

    _ttl = field_validator("ttl", "idle_ttl")(_seconds)


class SandboxState(enum.StrEnum):
    RUNNING = "running"
    PAUSED = "paused"
    DEAD = "dead"
    LOST = "lost"  # a fleet's directory: its host stopped heartbeating (see docs/fleet.md)


class SandboxInfo(BaseModel):
    id: str
    image: str
    layers: list[str]
    limits: Limits
    state: SandboxState
    created: float
    backend: str = "container"
    ttl: float | None = None
    idle_ttl: float | None = None
    init_pid: int | None = None
    memory_bytes: int | None = None
    env: dict[str, str] = Field(default_factory=dict)
    base_env: dict[str, str] = Field(default_factory=dict)
    workdir: str = "/"
    network: str = "none"
    ksm: bool = False
    aslr: bool = True
    priority: Priority = "normal"


class TimeoutRequest(_Wire):
    """Replaces both lifetimes: a field left out is cleared, not kept."""

    ttl: float | None = Field(None, description="absolute seconds from now; null clears")
    idle_ttl: float | None = Field(None, description="idle seconds; null clears")

    _ttl = field_validator("ttl", "idle_ttl")(_seconds)


# ------------------------------------------------------------------------------------ commands
MAX_XATTRS = 64


def check_xattrs(attrs: dict[str, str]) -> dict[str, str]:
    """The contract's limits on set_xattrs (InvalidArgument otherwise)."""
    if not isinstance(attrs, dict) or len(attrs) > MAX_XATTRS:
        raise InvalidArgument(f"at most {MAX_XATTRS} extended attributes at once")
    for k, v in attrs.items():
        if not (isinstance(k, str) and k.startswith("user.") and 5 < len(k) <= 205 and "\0" not in k):
            raise InvalidArgument(f"extended attribute names are user.<1-200 chars>, got {k!r}")
        if not isinstance(v, str) or len(v.encode()) > 4096 or "\0" in v:
            raise InvalidArgument(f"extended attribute {k!r}: the value must be a string of at most 4 KiB")
    return attrs


def _check_argv(v: list[str]) -> list[str]:
    if not v or not v[0]:
        raise ValueError("argv must name a program")
    if any("\0" in a for a in v):
        raise ValueError("argv may not contain NUL bytes")
    return v


_USER = ("run as this user: a name in the sandbox's /etc/passwd (its uid, primary gid, the groups /etc/group "
         "lists it in, and HOME/USER/LOGNAME unless env sets them), or numeric 'uid' / 'uid:gid'; "
         "null = the sandbox's root. Backends that cannot switch users raise NotSupported")


def _check_user(v: str | None) -> str | None:
    if v is not None and (not v or len(v) > 64 or any(ch in v for ch in "\0\n/")):
        raise ValueError(f"user must be a user name or uid[:gid], got {v!r}")
    return v


class PtySize(_Wire):
    """The size of a pseudo-terminal, in character cells."""

    rows: int = Field(24, ge=1, le=1000)
    cols: int = Field(80, ge=1, le=1000)


class ExecRequest(_Wire):
    argv: list[str]
    user: str | None = Field(None, description=_USER)
    cwd: str | None = Field(None, description="working directory; null = the sandbox's workdir")
    env: dict[str, str] = Field(default_factory=dict)
    stdin: bytes | None = Field(None, description="bytes fed to the command's stdin (base64 in JSON)")
    timeout: float | None = Field(60.0, description="seconds; the process group is killed on expiry")
    output_cap: int | None = Field(None, gt=0, le=MAX_OUTPUT_CAP,
                                   description="bytes kept per stream (the rest is counted, not kept); "
                                               "null = the host default")

    _argv = field_validator("argv")(classmethod(lambda cls, v: _check_argv(v)))
    _timeout = field_validator("timeout")(_seconds)
    _user = field_validator("user")(classmethod(lambda cls, v: _check_user(v)))


class ExecResult(BaseModel):
    exit_code: int = Field(description="exit status; 128+N when killed by signal N")
    stdout: str
    stderr: str
    stdout_bytes: int = Field(description="bytes the command wrote to stdout (kept or not)")
    stderr_bytes: int
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    timed_out: bool = False
    duration_s: float
    signal: int | None = None
    oom_killed: bool = Field(False, description="the kernel's OOM killer ended the command (the sandbox's memory "
                                                "limit, or all sandboxes' together); exit_code is then 137")

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


class OutputEvent(BaseModel):
    """A piece of a running command's output (streamed exec)."""

    stream: Literal["stdout", "stderr"]
    text: str


class StartRequest(_Wire):
    """Start a background process; its output is kept in a ring buffer of `ring_bytes` per stream."""

    argv: list[str]
    cwd: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    timeout: float | None = Field(None, description="seconds; null = runs until it exits or is killed")
    ring_bytes: int = Field(1 << 20, gt=0, le=MAX_OUTPUT_CAP)
    stdin: bool = Field(False, description="keep a pipe to its stdin open (write_stdin / close_stdin); "
                                           "false = stdin is /dev/null")
    user: str | None = Field(None, description=_USER)
    pty: PtySize | None = Field(None, description="run it on a new pseudo-terminal of this size (its controlling "
                                                  "terminal and stdin/stdout/stderr; output arrives as stdout, "
                                                  "write_stdin types, resize() changes the size); null = pipes. "
                                                  "Backends without PTYs raise NotSupported")

    _argv = field_validator("argv")(classmethod(lambda cls, v: _check_argv(v)))
    _timeout = field_validator("timeout")(_seconds)
    _user = field_validator("user")(classmethod(lambda cls, v: _check_user(v)))


class ProcessInfo(BaseModel):
    id: str = Field(description="handle id, unique within the sandbox")
    pid: int | None = Field(description="pid inside the sandbox")


Cursor = tuple[int, int]


class ProcessOutput(BaseModel):
    """Output of a background process since a cursor."""

    stdout: str
    stderr: str
    cursor: Cursor = Field(description="pass back as `since` to get only newer output")
    lost_bytes: int = Field(description="output that fell out of the ring buffer before it was read")
    exit_code: int | None = Field(None, description="null while running")


class SessionRequest(_Wire):
    shell: str | None = Field(None, description="shell binary; null = /bin/bash if present, else /bin/sh")
    cwd: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    output_cap: int | None = Field(None, gt=0, le=MAX_OUTPUT_CAP)


class SessionInfo(BaseModel):
    id: str
    shell: str


class SessionRunRequest(_Wire):
    cmd: str
    timeout: float | None = 60.0

    _timeout = field_validator("timeout")(_seconds)


# ------------------------------------------------------------------------------------ files
FileType = Literal["file", "dir", "symlink", "other"]


class FileEntry(BaseModel):
    name: str
    path: str
    type: FileType
    size: int
    mode: int
    mtime: float
    uid: int | None = Field(None, description="owner's uid inside the sandbox; null where the backend cannot tell")
    gid: int | None = Field(None, description="owner's gid inside the sandbox")
    xattrs: dict[str, str] | None = Field(None, description="the file's `user.*` extended attributes (name -> "
                                                            "value, UTF-8); null when it has none or the backend "
                                                            "cannot tell")
    ctime: float | None = Field(None, description="the inode's last status change (seconds since the epoch): "
                                "unlike mtime, nothing in the sandbox can set it back; null where the backend "
                                "cannot tell (and in directory listings)")


# ------------------------------------------------------------------------------------ snapshots
class SnapshotRequest(_Wire):
    exclude: list[str] | None = Field(None, description="sandbox paths left out of the layer; null = host default")
    max_depth: int | None = Field(None, gt=0, description="fold the stack to at most this many layers")


class SnapshotInfo(BaseModel):
    """A pack_diff snapshot: the source sandbox's writable upper as a layer on top of its stack."""

    id: str
    image: str = Field(description="image ref holding the full stack: snapshots/<id>:latest")
    layers: list[str] = Field(description="full stack, bottom -> top (possibly folded)")
    layer: str = Field(description="the layer captured from the writable upper")
    source_sandbox: str
    created: float
    size: int = Field(description="bytes of file content in the captured layer")


class ForkRequest(_Wire):
    """n children restored from one snapshot of the source. Limits default to the source's; env and
    TTLs are the source's only when asked (copy_env, inherit_ttl)."""

    n: int = Field(gt=0, le=1000)
    copy_env: bool = False
    inherit_ttl: bool = False
    exclude: list[str] | None = None
    cpu: float | None = Field(None, gt=0)
    memory_mb: int | None = Field(None, gt=0)
    disk_mb: int | None = Field(None, gt=0)
    pids: int | None = Field(None, gt=0)
    upper: UpperKind | None = Field(None, description="null = the source's")
    ttl: float | None = None
    idle_ttl: float | None = None
    env: dict[str, str] | None = None

    _ttl = field_validator("ttl", "idle_ttl")(_seconds)


class ForkFailure(BaseModel):
    index: int
    type: str = Field(description="error class name, as in the error body")
    message: str


class ForkReply(BaseModel):
    snapshot: SnapshotInfo
    sandboxes: list[SandboxInfo]
    failed: list[ForkFailure] = Field(default_factory=list)


# ------------------------------------------------------------------------------------ episodes
class BranchRequest(_Wire):
    """Branch an episode of the daemon's trajectory log at a step (rollout.branch, docs/flare.md)."""

    step: int = Field(strict=True, description="the branch holds steps 1..step; counted from 1")
    strategy: Literal["auto", "snapshot", "fastforward"] = "auto"
    from_step: int | None = Field(None, strict=True, ge=0, description="fastforward from this step's snapshot "
                                                                       "(0: the start)")
    episode_id: str | None = Field(None, min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:@-]+$",
                                   description="the new episode's id; default: <parent>.b<step>.<random>")
    ttl: float | None = Field(3600.0, gt=0, allow_inf_nan=False, description="the branch's sandbox's TTL, seconds")
    address: str | None = Field(None, max_length=500, description="the backend address the client runs the branch "
                                                                 "through (run_episode reattaches its sandbox there)")
    node: str | None = Field(None, max_length=200, description="the client's node name, for the same")


class BranchReply(BaseModel):
    episode: str
    parent: str
    step: int
    strategy: str = Field(description="the one used: snapshot or fastforward")
    from_step: int
    replayed_ops: int
    entries: int
    seconds: float
    sandbox: SandboxInfo


# ------------------------------------------------------------------------------------ network
class NetworkRequest(_Wire):
    """Replaces the egress rules: fields left out are cleared, never merged."""

    allow: list[str] | None = Field(None, description="CIDR, IP, IP:port or host:port entries")
    presets: dict[str, bool] | None = Field(None, description='named rule sets, e.g. {"pypi": true}')


class NetworkPolicy(BaseModel):
    allow: list[str] = Field(default_factory=list)
    presets: dict[str, bool] = Field(default_factory=dict)
    resolved: list[str] = Field(default_factory=list, description="the rules as enforced")
    subnet: str | None = None


# ------------------------------------------------------------------------------------ file watching
# create/write/remove/rename/chmod: a change in the watched tree. A rename inside the tree is a `rename`
# of the old path (`dest` = the new one when both ends were seen together) followed by a `create` of the
# new path, as fsnotify reports it. overflow: events were lost (a queue filled, or a cap stopped the
# watch from following a new subdirectory; `detail` says which). end: the watch is over (the directory
# or the sandbox went away, or the watch was closed); no event follows it.
WatchEventType = Literal["create", "write", "remove", "rename", "chmod", "overflow", "end"]
WATCH_QUEUE = 4096  # events a watch holds for its reader at most before it reports an overflow


class PortSocket(BaseModel):
    """A TCP socket of a sandbox's network namespace on a given local port, and who holds it (what a
    grader asks before trusting a server in the sandbox: tasks/desktop/browser.py)."""

    state: Literal["listen", "established", "other"]
    pids: list[int] = Field(description="host pids of the sandbox's processes holding it (empty: none of them)")
    exes: list[str] = Field(description="each holder's program, as a path inside the sandbox ('' when unknown)")
    exes_from_image: list[bool] = Field(description="each holder's program is a file of the sandbox's image "
                                                    "layers, not one written (or replaced) inside the sandbox")
    cmdlines: list[list[str]] = Field(default_factory=list, description="each holder's argv, read from the host "
                                      "(what a grader compares with the flags it started the server with)")
    starts: list[int] = Field(default_factory=list, description="each holder's start time in clock ticks after "
                              "boot: with its pid, names one process instance (a restarted server differs)")
    code_from_image: list[bool] = Field(default_factory=list, description="every file each holder maps as code "
                                        "(its program, its libraries) is a file of the image layers: no library "
                                        "written in the sandbox (LD_PRELOAD, LD_LIBRARY_PATH, a replaced .so)")


class WatchEvent(BaseModel):
    type: WatchEventType
    path: str = Field("", description="absolute path inside the sandbox; empty for overflow and end")
    name: str = Field("", description="the same path relative to the watched directory")
    dest: str | None = Field(None, description="rename: the new absolute path when it stayed in the watched tree")
    is_dir: bool = False
    detail: str | None = Field(None, description="overflow and end: why")


# ------------------------------------------------------------------------------------ handles
OutputCallback = Callable[[str], None]


class ProcessHandle(abc.ABC):
    """A background process: read its output since a cursor, wait for it, signal it."""

    id: str
    pid: int | None
    argv: list[str]

    @abc.abstractmethod
    def output(self, since: Cursor = (0, 0)) -> ProcessOutput:
        """Output since `since` and the exit code (None while running)."""

    def poll(self) -> int | None:
        """Exit code, or None while running."""
        return self.output((1 << 62, 1 << 62)).exit_code

    @abc.abstractmethod
    def wait(self, timeout: float | None = None) -> ExecResult:
        """Block until it exits; CommandTimeout if still running after `timeout` seconds."""

    @abc.abstractmethod
    def kill(self, signal: int = 9) -> None: ...

    @abc.abstractmethod
    def close(self) -> None:
        """Stop tracking it and free its buffers; kills it if still running."""

    def wait_output(self, since: Cursor, timeout: float) -> ProcessOutput:
        """Output since `since`, waiting up to `timeout` seconds for some (or for the exit) when there is
        none yet: what a streaming front calls in a loop. Backends that can be woken override the poll."""
        deadline = time.monotonic() + timeout
        while True:
            out = self.output(since)
            if out.stdout or out.stderr or out.exit_code is not None or time.monotonic() >= deadline:
                return out
            time.sleep(0.005)

    def write_stdin(self, data: bytes) -> None:
        """Feed its stdin (started with stdin=True)."""
        raise InvalidArgument(f"this backend's processes take no stdin ({type(self).__name__})")

    def close_stdin(self) -> None:
        """End of input for its stdin."""
        raise InvalidArgument(f"this backend's processes take no stdin ({type(self).__name__})")

    def resize(self, rows: int, cols: int) -> None:
        """Set the size of its PTY (started with pty=...); the process gets SIGWINCH."""
        raise NotSupported(f"this backend's processes have no PTY ({type(self).__name__})")


class SessionHandle(abc.ABC):
    """A long-lived shell: cwd, env and shell variables persist between run() calls."""

    id: str
    shell: str
    closed: bool

    @abc.abstractmethod
    def run(self, cmd: str, timeout: float | None = 60.0) -> ExecResult: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> SessionHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class WatchHandle(abc.ABC):
    """A watch on a directory inside a sandbox (`SandboxBackend.watch_dir`). Holds kernel resources
    until closed; the sandbox's end ends it too."""

    path: str
    recursive: bool

    @abc.abstractmethod
    def read(self, timeout: float = 1.0, max_events: int = 1024) -> list[WatchEvent]:
        """The events since the last read, waiting up to `timeout` seconds for the first one; [] when
        none came. After the `end` event every read answers [] at once."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop watching and free the watch (idempotent; a read blocked in another thread returns)."""

    @property
    @abc.abstractmethod
    def ended(self) -> bool:
        """True once the `end` event was read (or the handle was closed)."""

    def __enter__(self) -> WatchHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------------------------ memory reclaim
class ReclaimRequest(_Wire):
    """Push a sandbox's cold memory out to (compressed) swap. `target` is the fraction of its
    anonymous memory (process memory and its tmpfs upper) to push out: 0.75 = three quarters."""

    target: float = Field(0.75, gt=0, le=1, description="fraction of anonymous memory to push out, in (0, 1]")

    @field_validator("target", mode="before")
    @classmethod
    def _number(cls, v):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"target must be a number in (0, 1], got {v!r}")
        return v


class ReclaimResult(BaseModel):
    """What one reclaim did, measured from the sandbox's cgroup before and after."""

    sandbox_id: str
    target: float
    memory_before: int = Field(description="bytes charged to the sandbox's cgroup before")
    memory_after: int = Field(description="bytes charged after (what it holds in RAM)")
    anon_before: int = Field(description="anonymous + shmem (tmpfs) bytes before")
    anon_after: int
    swapped: int = Field(description="bytes the sandbox has in swap afterwards")
    duration_s: float
    paused: bool = Field(description="whether the sandbox was paused while (and after) reclaiming")

    @property
    def reclaimed(self) -> int:
        return max(0, self.memory_before - self.memory_after)


# ------------------------------------------------------------------------------------ images
class ImageSummary(BaseModel):
    """An image a caller may start sandboxes from: its own, or a shared one (owner null)."""

    ref: str = Field(description="name:tag")
    layers: list[str] = Field(description="layer digests, bottom -> top")
    created: float
    config: dict[str, Any] = Field(default_factory=dict)
    owner: str | None = Field(None, description="the tenant that made it; null = shared by the host")


# ------------------------------------------------------------------------------------ the contract
class SandboxBackend(abc.ABC):
    """Everything a sandbox can do. Sandbox ids are strings unique within a fleet (they carry the
    host's tag). Errors are the classes of `shoal.core.errors`, on every backend."""

    name: ClassVar[str]

    # ---------------------------------------------------------------- lifecycle
    @abc.abstractmethod
    def create(self, req: CreateRequest) -> SandboxInfo: ...

    @abc.abstractmethod
    def info(self, sandbox_id: str) -> SandboxInfo: ...

    @abc.abstractmethod
    def kill(self, sandbox_id: str) -> None: ...

    @abc.abstractmethod
    def pause(self, sandbox_id: str) -> None:
        """Freeze every process. Any later request resumes the sandbox transparently."""

    @abc.abstractmethod
    def resume(self, sandbox_id: str) -> None: ...

    @abc.abstractmethod
    def set_ttl(self, sandbox_id: str, req: TimeoutRequest) -> SandboxInfo:
        """Replace both lifetimes (ttl counts from now; None clears)."""

    # ---------------------------------------------------------------- commands
    @abc.abstractmethod
    def exec(self, sandbox_id: str, req: ExecRequest, on_stdout: OutputCallback | None = None,
             on_stderr: OutputCallback | None = None) -> ExecResult:
        """Run to completion; output is also passed to the callbacks as it arrives."""

    @abc.abstractmethod
    def start(self, sandbox_id: str, req: StartRequest) -> ProcessHandle: ...

    @abc.abstractmethod
    def open_session(self, sandbox_id: str, req: SessionRequest) -> SessionHandle: ...

    # ---------------------------------------------------------------- files
    # Paths are resolved inside the sandbox root: `..` and symlinks cannot reach the host.
    @abc.abstractmethod
    def read_file(self, sandbox_id: str, path: str, max_bytes: int = DEFAULT_READ_MAX) -> bytes: ...

    @abc.abstractmethod
    def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> int:
        """Write (parents created); returns the number of bytes written."""

    @abc.abstractmethod
    def list_files(self, sandbox_id: str, path: str = "/") -> list[FileEntry]: ...

    @abc.abstractmethod
    def stat_file(self, sandbox_id: str, path: str) -> FileEntry: ...

    @abc.abstractmethod
    def mkdir(self, sandbox_id: str, path: str) -> None:
        """Create a directory and its parents (no error if it exists)."""

    @abc.abstractmethod
    def remove_file(self, sandbox_id: str, path: str) -> None:
        """Remove a file or a directory tree."""

    def set_xattrs(self, sandbox_id: str, path: str, attrs: dict[str, str]) -> None:
        """Set extended attributes of a regular file or directory. Only the `user.` namespace (names
        `user.<1-200 chars>`, values up to 4 KiB, at most 64): others (trusted., security.) carry
        meaning to the kernel and overlayfs. Backends that cannot raise NotSupported."""
        raise NotSupported(f"the {self.name} backend cannot set extended attributes")

    def chown(self, sandbox_id: str, path: str, uid: int, gid: int) -> None:
        """Set the owner of a file or directory (a symlink itself, never its target). Backends whose
        files API cannot raise NotSupported."""
        raise NotSupported(f"the {self.name} backend cannot change a file's owner")

    @abc.abstractmethod
    def upload_tar(self, sandbox_id: str, dest_dir: str, tar: bytes) -> int:
        """Extract a tar into dest_dir; returns the number of entries written."""

    @abc.abstractmethod
    def download_tar(self, sandbox_id: str, path: str, max_bytes: int = DEFAULT_DOWNLOAD_MAX) -> bytes:
        """A tar of `path` holding at most max_bytes of file content."""

    # ---------------------------------------------------------------- snapshots
    @abc.abstractmethod
    def snapshot(self, sandbox_id: str, req: SnapshotRequest) -> SnapshotInfo:
        """pack_diff: the writable upper (processes frozen meanwhile) as a new layer on top of the
        sandbox's stack. Filesystem state only: running processes are not captured."""

    @abc.abstractmethod
    def fork(self, sandbox_id: str, req: ForkRequest) -> ForkReply:
        """n new sandboxes sharing one snapshot of this one; failures are per child."""

    # ---------------------------------------------------------------- network
    @abc.abstractmethod
    def get_network(self, sandbox_id: str) -> NetworkPolicy: ...

    @abc.abstractmethod
    def set_network(self, sandbox_id: str, req: NetworkRequest) -> NetworkPolicy:
        """Replace the egress allow rules; with no rules the sandbox has no egress."""

    # ---------------------------------------------------------------- ports
    def connect_port(self, sandbox_id: str, port: int, timeout: float = PORT_CONNECT_TIMEOUT) -> socket.socket:
        """A stream socket connected to 127.0.0.1:`port` inside the sandbox's own network namespace
        (the sandbox needs no network for it): the caller owns it and closes it. A port nothing
        listens on is a PortClosed (409); backends that cannot reach into a sandbox raise NotSupported."""
        raise NotSupported(f"the {self.name} backend cannot connect to a port inside a sandbox")

    def port_sockets(self, sandbox_id: str, port: int) -> list[PortSocket]:
        """The TCP sockets (IPv4 and IPv6) of the sandbox's own network namespace whose local port is
        `port` that some process holds (listening, and connections it accepted), each with its holders
        in the sandbox. Backends that cannot see into a sandbox's processes raise NotSupported."""
        raise NotSupported(f"the {self.name} backend cannot tell who holds a port inside a sandbox")

    def guard_port(self, sandbox_id: str, port: int) -> None:
        """From now on only `connect_port` (the host side) reaches 127.0.0.1:`port` in the sandbox: a
        connection from a process in the sandbox is reset (a grader's server, e.g. Chromium's DevTools,
        that agent code must not speak to). Idempotent. Backends that cannot raise NotSupported."""
        raise NotSupported(f"the {self.name} backend cannot guard a port inside a sandbox")

    def port_guarded(self, sandbox_id: str, port: int) -> bool:
        """Whether `guard_port(port)` is in force in the sandbox (a grader fails closed without it)."""
        raise NotSupported(f"the {self.name} backend cannot guard a port inside a sandbox")

    def written_under(self, sandbox_id: str, paths: list[str], limit: int = 20) -> list[str]:
        """Paths at or below each of `paths` (absolute; a last component ending in `*` matches every name
        with that prefix) that the sandbox itself wrote, replaced or removed, i.e. that are no longer its
        image's: at most `limit`. A grader asks this before trusting a program in the sandbox (the
        agent is root there). Backends that cannot tell raise NotSupported."""
        raise NotSupported(f"the {self.name} backend cannot tell what a sandbox wrote")

    # ---------------------------------------------------------------- file watching
    def watch_dir(self, sandbox_id: str, path: str, recursive: bool = False) -> WatchHandle:
        """Watch a directory inside the sandbox (and, `recursive`, every directory below it): typed
        events with sandbox paths as they happen. The path is resolved inside the sandbox root like the
        files API's; symlinks below it are not followed. Watches per sandbox, directories per watch and
        queued events are capped (QuotaExceeded, or an `overflow` event). Backends that cannot watch
        raise NotSupported."""
        raise NotSupported(f"the {self.name} backend cannot watch files inside a sandbox")

    # ---------------------------------------------------------------- memory
    def reclaim(self, sandbox_id: str, req: ReclaimRequest) -> ReclaimResult:
        """Push `req.target` of the sandbox's anonymous memory out to swap (zram where the operator
        enabled it). The sandbox keeps its state: pages come back on demand when it next runs.
        Backends without per-sandbox memory control raise NotSupported."""
        raise NotSupported(f"the {self.name} backend cannot reclaim a sandbox's memory")

    # ---------------------------------------------------------------- desktop (computer use)
    # Over the rest of the contract (a file read, a command) by default; the http backend sends
    # them to shoald's desktop routes instead (one request each, PNG bytes on the wire).
    def desktop_screenshot(self, sandbox_id: str, scale: float | None = None) -> bytes:
        """A PNG of a desktop sandbox's screen, nearest-neighbour scaled by `scale` in (0, 1];
        DesktopUnavailable when its X server is not running."""
        from ..desktop import ops

        return ops.screenshot(self, sandbox_id, scale)

    def desktop_action(self, sandbox_id: str, action: DesktopAction) -> ActionResult:
        """One mouse / keyboard action (shoal.desktop.actions.DesktopAction) in a desktop sandbox."""
        from ..desktop import ops

        return ops.act(self, sandbox_id, action)

    # ---------------------------------------------------------------- images
    @abc.abstractmethod
    def images(self) -> list[ImageSummary]:
        """The images this caller may start sandboxes from (its own and the shared ones)."""

    # ---------------------------------------------------------------- resources
    @property
    def address(self) -> str:
        """Where this backend's sandboxes live, named the same from any process (a daemon's URL,
        `local:<root>`): a sandbox id recorded with it can be looked up again through it."""
        return self.name

    def close(self) -> None:
        """Release what this backend object holds (connections); sandboxes keep running."""
        return None  # a local backend holds nothing that outlives the process

    # last in the class body: a method named `list` shadows the builtin in the annotations after it
    @abc.abstractmethod
    def list(self) -> list[SandboxInfo]:
        """Live sandboxes (paused included)."""
