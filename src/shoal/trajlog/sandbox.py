"""A sandbox whose every operation goes through a trajectory-log stream, and deterministic replay.

Operations and what the log keeps of them:

    exec      {cmd, cwd, env, timeout}     -> ExecResult fields
    write     {path, data | data_b64, mode} -> {bytes}
    read      {path}                        -> {data | data_b64}
    list      {path}                        -> {entries: [...]}
    snapshot  {exclude}                     -> SnapshotInfo fields

`replay()` re-runs a recorded stream into a fresh sandbox built from the same layers and compares
each result with the logged one; `restore()` re-applies a stream's effects to a new sandbox when the
original is gone (its host was lost), so the episode can go on elsewhere.
"""
from __future__ import annotations

import base64
import builtins
import time
from dataclasses import dataclass, field

from .. import errors
from ..core.contract import ExecResult
from ..sdk.sandbox import Sandbox
from .log import Outcome, Stream, TrajectoryLog
from .store import DONE, ModelResult

EFFECTFUL = ("exec", "write", "snapshot")  # kinds that change the sandbox; read/list do not
_COMPARED = {"exec": ("exit_code", "stdout", "stderr", "timed_out"), "read": ("data", "data_b64"),
             "write": ("bytes",), "list": ("entries",)}


def _raise_logged(result: dict) -> None:
    err = result.get("__error__")
    if err:
        cls = getattr(errors, err.get("type", ""), None)
        if not (isinstance(cls, type) and issubclass(cls, Exception)):
            cls = errors.SandboxError
        try:
            raise cls(err.get("message", ""))
        except TypeError:
            raise errors.SandboxError(f"{err.get('type')}: {err.get('message', '')}") from None


def _encode(data: str | bytes) -> dict:
    if isinstance(data, str):
        return {"data": data}
    try:
        return {"data": data.decode("utf-8")}
    except UnicodeDecodeError:
        return {"data_b64": base64.b64encode(data).decode()}


def _decode(d: dict) -> bytes:
    return base64.b64decode(d["data_b64"]) if "data_b64" in d else d["data"].encode("utf-8", "surrogateescape")


def apply(sb: Sandbox, kind: str, req: dict, lazy: bool = False) -> dict:
    """Run one logged request against a sandbox; the result as the log stores it. `lazy`: an exec's
    result stays an ExecResult (`ModelResult`), serialized once, when it is logged."""
    if kind == "exec":
        r = sb.commands.run(req["cmd"], cwd=req.get("cwd"), env=req.get("env") or None, timeout=req.get("timeout"))
        return ModelResult(r) if lazy else r.model_dump()
    if kind == "write":
        return {"bytes": sb.files.write(req["path"], _decode(req), mode=req.get("mode", 0o644))}
    if kind == "read":
        return _encode(sb.files.read_bytes(req["path"]))
    if kind == "list":
        return {"entries": sorted(e.name for e in sb.files.list(req["path"]))}
    if kind == "snapshot":
        return sb.snapshot(exclude=req.get("exclude")).model_dump()
    raise errors.InvalidArgument(f"unknown trajectory operation kind {kind!r}")


class LoggedSandbox:
    """`Sandbox` operations through a stream: persisted before they return, fast-forwarded on replay.

    While the stream is replaying, no sandbox is touched; `sandbox` may even be None until the first
    live operation (then `attach` must have been given one)."""

    def __init__(self, sandbox: Sandbox | None, stream: Stream):
        self.sandbox, self.stream = sandbox, stream
        self.effects = 0  # exec and write calls so far (live or replayed): a step without any changed nothing
        if sandbox is not None:
            stream.set_sandbox(sandbox.id)

    def attach(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox
        self.stream.set_sandbox(sandbox.id)

    def _call(self, kind: str, req: dict, idempotent: bool = False) -> Outcome:
        if kind in ("exec", "write"):
            self.effects += 1

        def run() -> dict:
            if self.sandbox is None:
                raise errors.SandboxError(f"stream {self.stream.name} has no sandbox attached for live operations")
            return apply(self.sandbox, kind, req, lazy=True)

        try:
            out = self.stream.call(kind, req, run)
        except errors.UnknownOutcome:
            if not idempotent:
                raise
            out = self.stream.settle(run())  # safe to run again: settle with what it gives now
        if out.replayed:
            _raise_logged(out.result)
        return out

    def exec(self, cmd: str | list[str], *, cwd: str | None = None, env: dict[str, str] | None = None,
             timeout: float | None = 60.0, idempotent: bool = False) -> ExecResult:
        """`idempotent=True`: if the log says this command was in flight when its writer died, run it
        again instead of raising UnknownOutcome (for commands whose repetition is harmless)."""
        out = self._call("exec", {"cmd": cmd, "cwd": cwd, "env": env or {}, "timeout": timeout}, idempotent)
        if isinstance(out.result, ModelResult):  # ran live just now
            return out.result.model
        if out.unknown and "exit_code" not in out.result:
            return ExecResult(exit_code=-1, stdout="", stderr=out.result.get("note", "outcome unknown"),
                              stdout_bytes=0, stderr_bytes=0, duration_s=0.0)
        return ExecResult.model_validate(out.result)

    def write(self, path: str, data: str | bytes, mode: int = 0o644) -> int:
        return self._call("write", {"path": path, "mode": mode, **_encode(data)}).result.get("bytes", 0)

    # reads change nothing: one in flight when its writer died is simply read again (never UNKNOWN)
    def read(self, path: str) -> str:
        return _decode(self._call("read", {"path": path}, idempotent=True).result).decode("utf-8", "replace")

    def list(self, path: str) -> builtins.list[str]:  # builtins: `list` here is this method
        return self._call("list", {"path": path}, idempotent=True).result["entries"]

    def snapshot(self, exclude: builtins.list[str] | None = None) -> dict:
        return self._call("snapshot", {"exclude": exclude}).result


@dataclass
class ReplayReport:
    stream: str
    sandbox: str
    ops: int = 0
    matched: int = 0
    skipped: int = 0  # UNKNOWN entries (never re-run) and, when restoring, reads
    mismatches: list[dict] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def identical(self) -> bool:
        return not self.mismatches


def _compare(kind: str, logged: dict, now: dict) -> dict | None:
    if "__error__" in logged:
        return None if "__error__" in now else {"field": "__error__", "logged": logged["__error__"], "replayed": None}
    for f in _COMPARED.get(kind, ()):
        if logged.get(f) != now.get(f):
            return {"field": f, "logged": logged.get(f), "replayed": now.get(f)}
    return None


def _run_into(log: TrajectoryLog, name: str, sb: Sandbox, effects_only: bool, start: int = 0,
              stop: int | None = None, kinds: tuple[str, ...] = EFFECTFUL) -> ReplayReport:
    rep = ReplayReport(stream=name, sandbox=sb.id)
    t0 = time.perf_counter()
    for e in log.history(name):
        if e.seq < start or (stop is not None and e.seq >= stop):
            continue
        if e.status != DONE or (effects_only and e.kind not in kinds):
            rep.skipped += 1
            continue
        rep.ops += 1
        try:
            now = apply(sb, e.kind, e.request)
        except errors.ShoalError as exc:
            now = {"__error__": {"type": type(exc).__name__, "message": str(exc)}}
        diff = _compare(e.kind, e.result or {}, now)
        if diff is None:
            rep.matched += 1
        else:
            rep.mismatches.append({"seq": e.seq, "kind": e.kind, **diff})
    rep.seconds = time.perf_counter() - t0
    return rep


def replay(log: TrajectoryLog, name: str, *, root=None, url: str | None = None, memory_mb: int | None = None,
           keep: bool = False) -> tuple[ReplayReport, Sandbox | None]:
    """Re-run a recorded stream into a fresh sandbox from the same layers; compare every result.
    The sandbox is made where `Sandbox.create(url=, root=)` makes it: shoald by default, "local" in-process."""
    info = log.info(name)
    if info is None:
        raise errors.InvalidArgument(f"no trajectory stream named {name!r}")
    if not info.layers and not info.image:
        raise errors.InvalidArgument(f"stream {name!r} recorded no image or layers to replay into")
    sb = Sandbox.create(None if info.layers else info.image, layers=info.layers or None, root=root, url=url,
                        memory_mb=memory_mb)
    try:
        rep = _run_into(log, name, sb, effects_only=False)
    except BaseException:
        sb.kill()
        raise
    if not keep:
        sb.kill()
        return rep, None
    return rep, sb


def fast_forward(log: TrajectoryLog, name: str, sb: Sandbox, *, start: int = 0,
                 stop: int | None = None) -> ReplayReport:
    """Re-apply the effects (exec, write) logged at seq `start` <= seq < `stop` to `sb`, which must hold
    the state before `start`, comparing each result with the logged one: a mismatch (a command whose
    output is not reproducible) is in `mismatches`. Snapshot entries are not retaken (they change
    nothing in the sandbox); UNKNOWN entries are skipped and counted."""
    return _run_into(log, name, sb, effects_only=True, start=start, stop=stop, kinds=("exec", "write"))


def restore(log: TrajectoryLog, name: str, sb: Sandbox) -> ReplayReport:
    """Re-apply a stream's effects (exec, write, snapshot) to `sb`, e.g. when the sandbox it ran in was
    lost with its host. Entries whose outcome is UNKNOWN are skipped, never re-run."""
    return _run_into(log, name, sb, effects_only=True)
