"""shoald's HTTP API (FastAPI). One daemon per host owns every sandbox on it.

Auth: `Authorization: Bearer <key>`. A tenant key sees only that tenant's sandboxes, snapshots and
images (others answer 404, never 403). The admin key manages tenants and sees everything.
Requests over the local Unix socket (root-only, mode 0600) are trusted as admin when they carry
no key, as with the Docker socket.

Errors: every Shoal error becomes `{"error": {"type", "message", "retryable"}}` with a 4xx status
(404 not found, 400 bad input, 409 in use, 429 refused for capacity / quota, 501 unavailable);
the SDK raises the same exception class on the client side.
"""
from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import secrets
import threading
import time
from typing import Any

from fastapi import Body, Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from pydantic import BaseModel, Field, ValidationError

from ..core import errors as E
from ..host import Host
from ..core.contract import MAX_SECONDS, ExecResult, FileEntry, Limits, SandboxInfo, SnapshotInfo
from ..sdk.sandbox import EMBEDDED, CommandHandle, Sandbox, Session
from .admission import Admission, AdmissionConfig
from .handles import HandleTable
from .state import ADMIN, DaemonState, Quotas, Tenant

log = logging.getLogger("shoald")

API_VERSION = "v1"

_STATUS = [
    ((E.SandboxNotFound, E.ImageNotFound, E.LayerNotFound, E.TenantNotFound), 404),
    ((E.QuotaExceeded, E.PoolExhausted), 429),
    ((E.LayerInUse,), 409),
    ((E.CommandTimeout,), 408),
    ((E.BackendUnavailable,), 501),
    ((E.InvalidArgument, E.CorruptArchive, E.FileOpError, E.SessionClosed), 400),
    ((E.Unauthorized,), 401),
]


def _unicode_message(exc: UnicodeError) -> str:
    # JSON may carry lone surrogates (\\udXXX) that no file name, command or byte string can hold
    return f"the request holds text that is not valid Unicode (e.g. a lone surrogate): {exc}"


def status_for(exc: E.ShoalError) -> int:
    for classes, code in _STATUS:
        if isinstance(exc, classes):
            return code
    return 500


# ------------------------------------------------------------------------------------------ models
class CreateRequest(BaseModel):
    image: str | None = None
    layers: list[str] | None = None
    from_snapshot: str | None = None
    cpu: float | None = Field(None, gt=0, description="cores; null = the host default")
    memory_mb: int | None = Field(None, gt=0)
    disk_mb: int | None = Field(None, gt=0)
    pids: int | None = Field(None, gt=0)
    ttl: float | None = Field(None, gt=0, le=MAX_SECONDS, description="absolute lifetime, seconds")
    idle_ttl: float | None = Field(None, gt=0, le=MAX_SECONDS, description="idle lifetime, seconds")
    env: dict[str, str] | None = None


class ExecBody(BaseModel):
    cmd: str | list[str]
    cwd: str | None = None
    env: dict[str, str] | None = None
    timeout: float | None = Field(60.0, gt=0, le=MAX_SECONDS)
    stdin: str | None = Field(None, description="text, or base64 when stdin_base64 is true")
    stdin_base64: bool = False
    output_cap: int | None = Field(None, gt=0, le=64 << 20)


class StartBody(BaseModel):
    cmd: str | list[str]
    cwd: str | None = None
    env: dict[str, str] | None = None
    timeout: float | None = Field(None, gt=0, le=MAX_SECONDS)


class SessionRunBody(BaseModel):
    cmd: str
    timeout: float | None = Field(60.0, gt=0, le=MAX_SECONDS)


class TimeoutBody(BaseModel):
    ttl: float | None = Field(None, gt=0, le=MAX_SECONDS, description="absolute seconds from now; null clears")
    idle_ttl: float | None = Field(None, gt=0, le=MAX_SECONDS, description="idle seconds; null clears")


class NetworkBody(BaseModel):
    allow: list[str] | None = Field(None, description="CIDR, IP, IP:port or host:port entries")
    presets: dict[str, bool] | None = Field(None, description='named rule sets, e.g. {"pypi": true}')


class SnapshotBody(BaseModel):
    exclude: list[str] | None = None


class ForkBody(BaseModel):
    n: int = Field(gt=0, le=1000)
    copy_env: bool = False
    inherit_ttl: bool = False


class TenantBody(BaseModel):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$", description="lowercase letters, digits, _ and -")
    quotas: dict[str, float] | None = None


class HandleOutput(BaseModel):
    stdout: str
    stderr: str
    cursor: list[int]
    lost_bytes: int
    exit_code: int | None


# ------------------------------------------------------------------------------------------ app
class Daemon:
    """Everything the API handlers share: the host, tenants, admission, live handles, metrics."""

    def __init__(self, host: Host, admission: AdmissionConfig | None = None, admin_key: str | None = None):
        self.host = host
        self.state = DaemonState(host.settings.root / "shoald.db")
        self.admission = Admission(admission)
        self.admin_key = admin_key
        cfg = self.admission.cfg
        self.handles = HandleTable("cmd", "background command", cfg.commands_per_sandbox,
                                   finished=lambda h: h.poll() is not None)
        self.sessions = HandleTable("ses", "session", cfg.sessions_per_sandbox)
        self._quota_lock = threading.Lock()
        self._pending: dict[str, dict[str, float]] = {}  # tenant -> resources of creates in flight
        self.counters = {"requests": 0, "creates": 0, "execs": 0, "errors_4xx": 0, "errors_5xx": 0}
        self.started = time.time()
        host.runtime  # sweep orphans and reattach to live sandboxes before serving
        threading.Thread(target=self._reap_handles, name="shoald-reaper", daemon=True).start()

    def _reap_handles(self, every_s: float = 5.0) -> None:
        """Close the sessions and commands of sandboxes that ended on their own (TTL, OOM, crash)."""
        while True:
            time.sleep(every_s)
            try:
                self.host.runtime.sweep()  # state dirs of sandboxes whose init and supervisor are both gone
                live = self.host.runtime.live_ids()
                self.handles.prune(live)
                self.sessions.prune(live)
            except Exception as e:  # keep reaping; a failed round is retried in a few seconds
                log.warning("handle reaper: %s", e)

    # ---------------------------------------------------------------- visibility
    def sandbox(self, tenant: Tenant, sandbox_id: str) -> Sandbox:
        owner = self.state.owner("sandbox", sandbox_id)
        if not tenant.admin and owner != tenant.name:
            raise E.SandboxNotFound(f"sandbox {sandbox_id} not found")
        return Sandbox.connect(sandbox_id, root=self.host.settings.root, url=EMBEDDED)

    def keep(self, table: HandleTable, sandbox_id: str, obj) -> str:
        """Keep a live handle (background command, session) under a fresh id, within the per-sandbox cap."""
        table.prune(self.host.runtime.live_ids())  # forget what sandboxes that ended on their own held
        return table.add(sandbox_id, obj)

    def lookup(self, table: HandleTable, tenant: Tenant, sandbox_id: str, key: str):
        """The handle `key` of a sandbox the tenant may see; 404 otherwise."""
        self.sandbox(tenant, sandbox_id)
        return table.get(sandbox_id, key)

    def check_image(self, tenant: Tenant, ref: str) -> None:
        from ..layers.store import split_ref

        name, tag = split_ref(ref)
        owner = self.state.owner("image", f"{name}:{tag}")
        if owner is not None and not tenant.admin and owner != tenant.name:
            raise E.ImageNotFound(f"image {name}:{tag} not found (see `shoal image ls`)")

    @contextlib.contextmanager
    def reserve(self, tenant: Tenant, new: list[Limits]):
        """Check `new` sandboxes against the tenant's quotas and hold them as pending until the block
        ends (by then they are owned, so counted as live): concurrent creates cannot both slip in."""
        if tenant.admin:
            yield
            return
        want = {"sandboxes": len(new), "cpu": sum(x.cpu for x in new),
                "memory_mb": sum(x.memory_mb for x in new), "disk_mb": sum(x.disk_mb for x in new)}
        with self._quota_lock:
            use = self.tenant_usage(tenant)
            pending = self._pending.setdefault(tenant.name, {k: 0.0 for k in want})
            for name, cap in (("sandboxes", tenant.quotas.sandboxes), ("cpu", tenant.quotas.cpu),
                              ("memory_mb", tenant.quotas.memory_mb), ("disk_mb", tenant.quotas.disk_mb)):
                have = use[name] + pending[name]
                if have + want[name] > cap:
                    raise E.QuotaExceeded(f"tenant {tenant.name} quota {name}={cap:g} would be exceeded "
                                          f"(in use {have:g}, asked {want[name]:g})")
            for k, v in want.items():
                pending[k] += v
        try:
            yield
        finally:
            with self._quota_lock:
                for k, v in want.items():
                    pending[k] -= v

    def tenant_usage(self, tenant: Tenant) -> dict[str, float]:
        rt = self.host.runtime
        live = rt.live_ids()
        mine = []
        for sid in self.state.owned("sandbox", tenant.name):
            if sid in live:
                try:
                    mine.append(Limits(**rt._load(sid)["limits"]))
                except E.ShoalError:
                    continue
        return {"sandboxes": len(mine), "cpu": sum(x.cpu for x in mine),
                "memory_mb": sum(x.memory_mb for x in mine), "disk_mb": sum(x.disk_mb for x in mine)}


def create_app(daemon: Daemon) -> FastAPI:
    app = FastAPI(title="shoald", version="0.1.0",
                  description="Shoal host daemon: sandboxes, exec, files, snapshots, tenants.")
    d = daemon
    app.state.daemon = d

    # ---------------------------------------------------------------- errors and auth
    def error_response(kind: str, message: str, code: int, retryable: bool = False) -> JSONResponse:
        """Every error has one shape: {"error": {"type", "message", "retryable"}}."""
        d.counters["errors_4xx" if code < 500 else "errors_5xx"] += 1
        return JSONResponse({"error": {"type": kind, "message": message, "retryable": retryable}},
                            status_code=code, headers={"Retry-After": "1"} if retryable else None)

    def fields_message(errors: list[dict]) -> str:
        return "; ".join(f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in errors)

    @app.exception_handler(E.ShoalError)
    async def shoal_error(_: Request, exc: E.ShoalError):
        return error_response(type(exc).__name__, str(exc), status_for(exc), exc.retryable)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError):
        return error_response("InvalidArgument", fields_message(exc.errors()), 422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        return error_response("NotFound" if exc.status_code == 404 else "HTTPError", str(exc.detail), exc.status_code)

    @app.exception_handler(ValidationError)
    async def model_error(_: Request, exc: ValidationError):
        # a model built inside a handler (e.g. Limits) rejected the client's values
        return error_response("InvalidArgument", fields_message(exc.errors()), 400)

    @app.exception_handler(UnicodeError)
    async def unicode_error(_: Request, exc: UnicodeError):
        return error_response("InvalidArgument", _unicode_message(exc), 400)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        # a bug: log it with its traceback; the client gets the usual error shape, never a bare 500
        log.error("internal error on %s %s", request.method, request.url.path, exc_info=exc)
        return error_response("InternalError", f"internal error ({type(exc).__name__}); see the shoald log", 500)

    def tenant(request: Request) -> Tenant:
        d.counters["requests"] += 1
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        if not key:
            if request.scope.get("client") in (None, ("", 0)) and request.scope.get("type") == "http" and \
                    getattr(request.app.state, "trust_local", False):
                return ADMIN
            raise E.Unauthorized("missing API key (Authorization: Bearer <key>)")
        if d.admin_key and secrets.compare_digest(key, d.admin_key):
            return ADMIN
        t = d.state.tenant_for_key(key)
        if t is None:
            raise E.Unauthorized("invalid API key")
        return t

    def admin(t: Tenant = Depends(tenant)) -> Tenant:
        if not t.admin:
            raise E.Unauthorized("this endpoint needs the admin key")
        return t

    # ---------------------------------------------------------------- health and metrics
    @app.get("/v1/health")
    def health() -> dict:
        return {"ok": True, "host": d.host.settings.host_tag, "version": "0.1.0",
                "sandboxes": len(d.host.runtime.list()), "uptime_s": round(time.time() - d.started, 1)}

    @app.get("/metrics", response_class=PlainTextResponse)
    def metrics() -> str:
        live = d.host.runtime.list()
        lines = ["# TYPE shoal_sandboxes gauge", f"shoal_sandboxes {len(live)}",
                 "# TYPE shoal_sandboxes_starting gauge", f"shoal_sandboxes_starting {d.admission.starting}",
                 "# TYPE shoal_admission_refusals_total counter",
                 f"shoal_admission_refusals_total {d.admission.refusals}",
                 "# TYPE shoal_sandbox_memory_bytes gauge",
                 f"shoal_sandbox_memory_bytes {sum(i.memory_bytes or 0 for i in live)}",
                 "# TYPE shoal_background_commands gauge", f"shoal_background_commands {d.handles.count()}",
                 "# TYPE shoal_sessions gauge", f"shoal_sessions {d.sessions.count()}",
                 "# TYPE shoal_open_fds gauge", f"shoal_open_fds {len(os.listdir('/proc/self/fd'))}"]
        for k, v in d.counters.items():
            lines += [f"# TYPE shoal_{k}_total counter", f"shoal_{k}_total {v}"]
        return "\n".join(lines) + "\n"

    # ---------------------------------------------------------------- sandboxes
    @app.post("/v1/sandboxes", status_code=201)
    def create(body: CreateRequest, t: Tenant = Depends(tenant)) -> SandboxInfo:
        if body.from_snapshot:
            d.check_image(t, f"snapshots/{body.from_snapshot}:latest")
        for ref in [body.image] + [x for x in body.layers or [] if ":" in x and not x.startswith("sha256:")]:
            if ref:
                d.check_image(t, ref)
        s = d.host.settings
        limits = Limits(cpu=body.cpu or s.default_cpu, memory_mb=body.memory_mb or s.default_memory_mb,
                        disk_mb=body.disk_mb or s.default_disk_mb, pids=body.pids or s.default_pids)
        with d.reserve(t, [limits]):
            committed = d.host.runtime.committed()
            with d.admission.creating(len(committed), sum(x.memory_mb for x in committed), limits.memory_mb):
                sb = Sandbox.create(body.image, layers=body.layers, from_snapshot=body.from_snapshot, cpu=limits.cpu,
                                    memory_mb=limits.memory_mb, disk_mb=limits.disk_mb, pids=limits.pids,
                                    ttl=body.ttl, idle_ttl=body.idle_ttl, env=body.env, root=d.host.settings.root,
                                    url=EMBEDDED)
            d.state.own("sandbox", sb.id, t.name)
        d.counters["creates"] += 1
        return sb.info()

    @app.get("/v1/sandboxes")
    def list_sandboxes(t: Tenant = Depends(tenant)) -> list[SandboxInfo]:
        infos = d.host.runtime.list()
        if t.admin:
            return infos
        mine = set(d.state.owned("sandbox", t.name))
        return [i for i in infos if i.id in mine]

    @app.get("/v1/sandboxes/{sandbox_id}")
    def get_sandbox(sandbox_id: str, t: Tenant = Depends(tenant)) -> SandboxInfo:
        return d.sandbox(t, sandbox_id).info()

    @app.delete("/v1/sandboxes/{sandbox_id}", status_code=204)
    def kill(sandbox_id: str, t: Tenant = Depends(tenant)) -> Response:
        d.sandbox(t, sandbox_id).kill()
        d.state.disown("sandbox", sandbox_id)
        for table in (d.handles, d.sessions):
            table.drop_sandbox(sandbox_id)
        return Response(status_code=204)

    @app.post("/v1/sandboxes/{sandbox_id}/pause", status_code=204)
    def pause(sandbox_id: str, t: Tenant = Depends(tenant)) -> Response:
        d.sandbox(t, sandbox_id).pause()
        return Response(status_code=204)

    @app.post("/v1/sandboxes/{sandbox_id}/resume", status_code=204)
    def resume(sandbox_id: str, t: Tenant = Depends(tenant)) -> Response:
        d.sandbox(t, sandbox_id).resume()
        return Response(status_code=204)

    @app.put("/v1/sandboxes/{sandbox_id}/timeout")
    def set_timeout(sandbox_id: str, body: TimeoutBody, t: Tenant = Depends(tenant)) -> SandboxInfo:
        """Replaces both lifetimes: a field left out is cleared, not kept."""
        sb = d.sandbox(t, sandbox_id)
        sb.set_timeout(body.ttl, body.idle_ttl)
        return sb.info()

    @app.put("/v1/sandboxes/{sandbox_id}/network")
    def set_network(sandbox_id: str, body: NetworkBody, t: Tenant = Depends(tenant)) -> dict:
        """Replaces the egress rules: fields left out are cleared, never merged."""
        return d.sandbox(t, sandbox_id).set_network(body.allow, body.presets)

    @app.get("/v1/sandboxes/{sandbox_id}/network")
    def get_network(sandbox_id: str, t: Tenant = Depends(tenant)) -> dict:
        return d.sandbox(t, sandbox_id).get_network()

    # ---------------------------------------------------------------- exec
    def _stdin(body: ExecBody) -> bytes | None:
        if body.stdin is None:
            return None
        if body.stdin_base64:
            try:
                return base64.b64decode(body.stdin, validate=True)
            except ValueError as e:
                raise E.InvalidArgument(f"stdin is not valid base64: {e}") from None
        return body.stdin.encode()

    @app.post("/v1/sandboxes/{sandbox_id}/exec")
    def exec_(sandbox_id: str, body: ExecBody, stream: bool = Query(False), t: Tenant = Depends(tenant)):
        sb = d.sandbox(t, sandbox_id)
        d.counters["execs"] += 1
        kw: dict[str, Any] = dict(cwd=body.cwd, env=body.env, timeout=body.timeout, stdin=_stdin(body),
                                  output_cap=body.output_cap)
        if not stream:
            return sb.commands.run(body.cmd, **kw)

        def events():
            try:
                for ev in sb.commands.stream(body.cmd, **kw):
                    if isinstance(ev, ExecResult):
                        yield f"event: result\ndata: {ev.model_dump_json()}\n\n"
                    else:
                        yield f"event: {ev.stream}\ndata: {json.dumps(ev.text)}\n\n"
            except E.ShoalError as e:
                err = {"type": type(e).__name__, "message": str(e), "retryable": e.retryable}
                yield f"event: error\ndata: {json.dumps(err)}\n\n"
            except UnicodeError as e:
                err = {"type": "InvalidArgument", "message": _unicode_message(e), "retryable": False}
                yield f"event: error\ndata: {json.dumps(err)}\n\n"
            except Exception as e:  # headers are sent: end the stream with an error event, not a torn connection
                log.error("internal error in exec stream", exc_info=e)
                err = {"type": "InternalError", "message": f"internal error ({type(e).__name__})", "retryable": False}
                yield f"event: error\ndata: {json.dumps(err)}\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/sandboxes/{sandbox_id}/commands", status_code=201)
    def start(sandbox_id: str, body: StartBody, t: Tenant = Depends(tenant)) -> dict:
        sb = d.sandbox(t, sandbox_id)
        h = sb.commands.start(body.cmd, cwd=body.cwd, env=body.env, timeout=body.timeout)
        return {"id": d.keep(d.handles, sandbox_id, h), "pid": h.pid}

    def _handle(t: Tenant, sandbox_id: str, hid: str) -> CommandHandle:
        return d.lookup(d.handles, t, sandbox_id, hid)

    @app.get("/v1/sandboxes/{sandbox_id}/commands/{hid}")
    def poll(sandbox_id: str, hid: str, since_out: int = Query(0, ge=0), since_err: int = Query(0, ge=0),
             t: Tenant = Depends(tenant)) -> HandleOutput:
        h = _handle(t, sandbox_id, hid)
        code = h.poll()
        out = h.output((since_out, since_err))
        return HandleOutput(stdout=out.stdout, stderr=out.stderr, cursor=list(out.cursor), lost_bytes=out.lost_bytes,
                            exit_code=code)

    @app.post("/v1/sandboxes/{sandbox_id}/commands/{hid}/kill", status_code=204)
    def kill_command(sandbox_id: str, hid: str, signal: int = Query(9, ge=1, le=64),
                     t: Tenant = Depends(tenant)) -> Response:
        _handle(t, sandbox_id, hid).kill(signal)
        return Response(status_code=204)

    @app.delete("/v1/sandboxes/{sandbox_id}/commands/{hid}", status_code=204)
    def forget_command(sandbox_id: str, hid: str, t: Tenant = Depends(tenant)) -> Response:
        """Stop tracking a background command and free what it holds (kills it if still running)."""
        _handle(t, sandbox_id, hid)  # 404 unless visible
        d.handles.pop(sandbox_id, hid)
        return Response(status_code=204)

    # ---------------------------------------------------------------- sessions
    @app.post("/v1/sandboxes/{sandbox_id}/sessions", status_code=201)
    def new_session(sandbox_id: str, cwd: str | None = None, t: Tenant = Depends(tenant)) -> dict:
        s = d.sandbox(t, sandbox_id).sessions.create(cwd=cwd)
        return {"id": d.keep(d.sessions, sandbox_id, s), "shell": s.shell}

    def _session(t: Tenant, sandbox_id: str, sid: str) -> Session:
        return d.lookup(d.sessions, t, sandbox_id, sid)

    @app.post("/v1/sandboxes/{sandbox_id}/sessions/{sid}/run")
    def session_run(sandbox_id: str, sid: str, body: SessionRunBody, t: Tenant = Depends(tenant)) -> ExecResult:
        return _session(t, sandbox_id, sid).run(body.cmd, timeout=body.timeout)

    @app.delete("/v1/sandboxes/{sandbox_id}/sessions/{sid}", status_code=204)
    def session_close(sandbox_id: str, sid: str, t: Tenant = Depends(tenant)) -> Response:
        _session(t, sandbox_id, sid)  # 404 unless visible
        d.sessions.pop(sandbox_id, sid)
        return Response(status_code=204)

    # ---------------------------------------------------------------- files
    @app.get("/v1/sandboxes/{sandbox_id}/files")
    def read_file(sandbox_id: str, path: str, t: Tenant = Depends(tenant)) -> Response:
        data = d.sandbox(t, sandbox_id).files.read_bytes(path)
        return Response(data, media_type="application/octet-stream")

    @app.put("/v1/sandboxes/{sandbox_id}/files")
    def write_file(sandbox_id: str, path: str, request_body: bytes = Body(b"", media_type="application/octet-stream"),
                   mode: int = Query(0o644, ge=0, le=0o7777), t: Tenant = Depends(tenant)) -> dict:
        return {"bytes": d.sandbox(t, sandbox_id).files.write(path, request_body, mode=mode)}

    @app.delete("/v1/sandboxes/{sandbox_id}/files", status_code=204)
    def remove_file(sandbox_id: str, path: str, t: Tenant = Depends(tenant)) -> Response:
        d.sandbox(t, sandbox_id).files.remove(path)
        return Response(status_code=204)

    @app.post("/v1/sandboxes/{sandbox_id}/files/mkdir", status_code=204)
    def mkdir(sandbox_id: str, path: str, t: Tenant = Depends(tenant)) -> Response:
        d.sandbox(t, sandbox_id).files.mkdir(path)
        return Response(status_code=204)

    @app.get("/v1/sandboxes/{sandbox_id}/files/list")
    def list_files(sandbox_id: str, path: str = "/", t: Tenant = Depends(tenant)) -> list[FileEntry]:
        return d.sandbox(t, sandbox_id).files.list(path)

    @app.get("/v1/sandboxes/{sandbox_id}/files/stat")
    def stat_file(sandbox_id: str, path: str, t: Tenant = Depends(tenant)) -> FileEntry:
        return d.sandbox(t, sandbox_id).files.stat(path)

    @app.post("/v1/sandboxes/{sandbox_id}/files/upload")
    def upload(sandbox_id: str, dest: str, request_body: bytes = Body(..., media_type="application/x-tar"),
               t: Tenant = Depends(tenant)) -> dict:
        return {"entries": d.sandbox(t, sandbox_id).files.upload(dest, request_body)}

    @app.get("/v1/sandboxes/{sandbox_id}/files/download")
    def download(sandbox_id: str, path: str, t: Tenant = Depends(tenant)) -> Response:
        return Response(d.sandbox(t, sandbox_id).files.download(path), media_type="application/x-tar")

    # ---------------------------------------------------------------- snapshots and fork
    @app.post("/v1/sandboxes/{sandbox_id}/snapshot", status_code=201)
    def snapshot(sandbox_id: str, body: SnapshotBody, t: Tenant = Depends(tenant)) -> SnapshotInfo:
        snap = d.sandbox(t, sandbox_id).snapshot(exclude=body.exclude)
        d.state.own("image", f"snapshots/{snap.id}:latest", t.name)
        return snap

    @app.post("/v1/sandboxes/{sandbox_id}/fork", status_code=201)
    def fork(sandbox_id: str, body: ForkBody, t: Tenant = Depends(tenant)) -> dict:
        sb = d.sandbox(t, sandbox_id)
        with d.reserve(t, [sb.info().limits] * body.n):  # children get the parent's limits
            res = sb.fork(body.n, copy_env=body.copy_env, inherit_ttl=body.inherit_ttl)
            d.state.own("image", f"snapshots/{res.snapshot.id}:latest", t.name)
            for child in res.sandboxes:
                d.state.own("sandbox", child.id, t.name)
        return {"snapshot": res.snapshot.model_dump(), "sandboxes": [c.info().model_dump() for c in res.sandboxes],
                "failed": [{"index": i, "type": type(e).__name__, "message": str(e)} for i, e in res.failed]}

    # ---------------------------------------------------------------- layers and images
    @app.get("/v1/images")
    def images(t: Tenant = Depends(tenant)) -> list[dict]:
        out = []
        for img in d.host.store.list_images():
            owner = d.state.owner("image", img.ref)
            if t.admin or owner in (None, t.name):
                out.append({"ref": img.ref, "layers": list(img.layers), "created": img.created,
                            "config": img.config, "owner": owner})
        return out

    @app.delete("/v1/images/{ref:path}", status_code=204)
    def remove_image(ref: str, t: Tenant = Depends(tenant)) -> Response:
        d.check_image(t, ref)
        owner = d.state.owner("image", ref)
        if owner is None and not t.admin:
            raise E.Unauthorized(f"image {ref} is shared; only the admin may remove it")
        d.host.store.remove_image(ref)
        d.state.disown("image", ref)
        return Response(status_code=204)

    @app.get("/v1/layers")
    def layers(t: Tenant = Depends(tenant)) -> list[dict]:
        visible = {l for img in images(t) for l in img["layers"]} if not t.admin else None
        return [{"digest": l.digest, "size": l.size, "image_bytes": l.image_bytes, "created": l.created,
                 "names": list(l.names), **({"source": l.source} if t.admin else {})}
                for l in d.host.store.list() if visible is None or l.digest in visible]

    # ---------------------------------------------------------------- tenants (admin)
    @app.post("/v1/tenants", status_code=201)
    def create_tenant(body: TenantBody, _: Tenant = Depends(admin)) -> dict:
        try:
            quotas = Quotas(**body.quotas) if body.quotas else None
        except TypeError as e:  # an unknown field name: the caller's error, not a 500
            raise E.InvalidArgument(f"unknown quota field: {e}") from None
        tnt, key = d.state.create_tenant(body.name, quotas)
        return {"name": tnt.name, "quotas": tnt.quotas.__dict__, "api_key": key}

    @app.get("/v1/tenants")
    def list_tenants(_: Tenant = Depends(admin)) -> list[dict]:
        return [{"name": x.name, "quotas": x.quotas.__dict__, "created": x.created,
                 "usage": d.tenant_usage(x)} for x in d.state.list_tenants()]

    @app.put("/v1/tenants/{name}/quotas")
    def set_quotas(name: str, quotas: dict[str, float], _: Tenant = Depends(admin)) -> dict:
        try:
            q = Quotas(**quotas)
        except TypeError as e:
            raise E.InvalidArgument(f"unknown quota field: {e}") from None
        return {"name": name, "quotas": d.state.set_quotas(name, q).quotas.__dict__}

    @app.delete("/v1/tenants/{name}", status_code=204)
    def delete_tenant(name: str, _: Tenant = Depends(admin)) -> Response:
        d.state.delete_tenant(name)
        return Response(status_code=204)

    return app
