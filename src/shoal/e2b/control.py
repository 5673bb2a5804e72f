"""E2B's REST control plane over a Shoal backend: create, list (filters + `x-next-token` pages), info,
kill, timeout, pause and connect (resume). Auth: `X-API-KEY`, mapped to a tenant; a tenant sees only
the sandboxes its keys created. Errors: status + `{"code", "message"}`."""
from __future__ import annotations

import base64
import hashlib
import math
import secrets
import time
import urllib.parse
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Body, Request, Response

from ..core.contract import MAX_SECONDS, CreateRequest, TimeoutRequest
from ..core.errors import ImageNotFound, SandboxNotFound, ShoalError
from . import templates as tpl
from .front import ApiError, Front
from .ports import traffic_token
from .state import ENVD_VERSION, Box


def rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _parse_time(text: str) -> float:
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise ApiError(400, f"startedAfter must be an RFC 3339 time, got {text!r}") from None


def _timeout(v: Any, default: float) -> float:
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ApiError(400, f"timeout must be a number of seconds >= 0, got {v!r}")
    return float(min(max(v, 1), MAX_SECONDS))


def _str_map(v: Any, name: str) -> dict[str, str]:
    if v is None:
        return {}
    if not isinstance(v, dict) or not all(isinstance(k, str) and isinstance(x, str) for k, x in v.items()):
        raise ApiError(400, f"{name} must be an object of strings")
    return dict(v)


def sandbox_json(box: Box, access_token: bool = True, domain: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"templateID": box.template, "sandboxID": box.id, "clientID": "shoal",
                           "envdVersion": ENVD_VERSION}
    if domain:  # the SDK's get_host builds PORT-ID.<this> (over its own domain option) when it is given
        out["domain"] = domain
    if access_token:
        out["envdAccessToken"] = box.token
        out["trafficAccessToken"] = traffic_token(box)  # the key to its ports (ports.py)
    return out


def listed_json(box: Box, domain: str | None = None) -> dict[str, Any]:
    end = box.end if not box.paused else time.time() + box.paused_left
    return {**sandbox_json(box, access_token=False, domain=domain), "startedAt": rfc3339(box.started),
            "endAt": rfc3339(end), "cpuCount": box.cpu, "memoryMB": box.memory_mb, "diskSizeMB": box.disk_mb,
            "state": box.state, "metadata": box.metadata}


def router(front: Front) -> APIRouter:
    r = APIRouter()

    tenant_of, owned = front.tenant_of, front.owned

    def create(request: Request, body: dict = Body(...)) -> Response:
        tenant = tenant_of(request)
        cap = front.limits.sandboxes
        if cap:  # creates in flight hold a slot too: a burst of concurrent creates cannot pass the cap
            live = lambda: sum(1 for b in front.boxes.all() if b.tenant == tenant)  # noqa: E731
            if not front.creating.take_room(tenant, cap, live):
                raise ApiError(429, f"this API key's tenant has {cap} sandboxes (the front's limit): kill some first")
        try:
            return _create(request, tenant, body)
        finally:
            if cap:
                front.creating.give(tenant)

    def _create(request: Request, tenant: str, body: dict) -> Response:
        template = body.get("templateID")
        if not isinstance(template, str) or not template:
            raise ApiError(400, "templateID is required")
        snap = front.snapshots.find(tenant, template)  # a snapshot of this tenant's (snapshots.py)
        image = None
        if snap is None:
            try:
                image = tpl.resolve(front.templates, template)
            except LookupError:
                raise ApiError(404, f"template {template!r} not found (known: {sorted(front.templates)})") from None
        timeout = _timeout(body.get("timeout"), front.default_timeout)
        metadata = _str_map(body.get("metadata"), "metadata")
        env = _str_map(body.get("envVars"), "envVars")
        # pooled memory cgroups (a host's [density] default) never mix this front's tenants
        pool = "e2b:" + hashlib.sha256(tenant.encode()).hexdigest()[:32]
        try:
            if snap is not None:
                info = front.backend.create(CreateRequest(from_snapshot=snap.id, ttl=timeout, env=env,
                                                          memory_pool=pool))
            else:
                info = front.backend.create(CreateRequest(image=image, ttl=timeout, env=env, memory_pool=pool,
                                                          backend=front.sandbox_backend))
        except ImageNotFound as e:
            raise ApiError(404, f"template {template!r}: {e}") from None
        try:
            has_home = front.backend.stat_file(info.id, front.home).type == "dir"
        except ShoalError:
            has_home = False
        now = time.time()
        box = Box(id=info.id, tenant=tenant, template=template, token=secrets.token_urlsafe(24), metadata=metadata,
                  started=now, end=now + timeout, cpu=max(1, math.ceil(info.limits.cpu)),
                  memory_mb=info.limits.memory_mb, disk_mb=info.limits.disk_mb,
                  home=front.home if has_home else info.workdir or "/", has_home=has_home)
        front.boxes.add(box)
        front.starts.run(front, info.id)  # the template's start command, if it has one (ports.py)
        return _json(201, sandbox_json(box, domain=front.domain))

    r.add_api_route("/sandboxes", create, methods=["POST"])
    r.add_api_route("/v2/sandboxes", create, methods=["POST"])

    @r.get("/v2/sandboxes")
    def list_v2(request: Request, metadata: str | None = None, state: str | None = None,
                template: str | None = None, startedAfter: str | None = None,  # noqa: N803 (E2B's names)
                order: str | None = None, limit: int | None = None, nextToken: str | None = None) -> Response:  # noqa: N803
        tenant = tenant_of(request)
        # the SDK quotes keys and values, then url-encodes the pairs: undo both
        want_meta = {urllib.parse.unquote(k): urllib.parse.unquote(v)
                     for k, v in urllib.parse.parse_qsl(metadata or "", keep_blank_values=True)}
        states = {s for part in (state or "running,paused").split(",") if (s := part.strip())}
        bad = states - {"running", "paused"}
        if bad:
            raise ApiError(400, f"unknown state {sorted(bad)}; known: running, paused")
        after = _parse_time(startedAfter) if startedAfter else None
        if limit is not None and not (1 <= limit <= 1000):
            raise ApiError(400, f"limit must be 1..1000, got {limit}")
        boxes = [b for b in front.boxes.all() if b.tenant == tenant and b.state in states
                 and all(b.metadata.get(k) == v for k, v in want_meta.items())
                 and (template is None or b.template == template) and (after is None or b.started >= after)]
        asc = (order or "desc").lower() == "asc"
        boxes.sort(key=lambda b: (b.started, b.id), reverse=not asc)
        if nextToken:
            cursor = _untoken(nextToken)
            boxes = [b for b in boxes if ((b.started, b.id) > cursor if asc else (b.started, b.id) < cursor)]
        page = boxes[:limit] if limit else boxes
        headers = {}
        if limit and len(boxes) > limit:
            headers["x-next-token"] = _token(page[-1])
        return _json(200, [listed_json(b, front.domain) for b in page], headers)

    @r.get("/sandboxes")
    def list_v1(request: Request) -> Response:
        tenant = tenant_of(request)
        return _json(200, [listed_json(b, front.domain) for b in front.boxes.all() if b.tenant == tenant])

    @r.get("/sandboxes/{sandbox_id}")
    def get_info(request: Request, sandbox_id: str) -> Response:
        box = owned(request, sandbox_id)
        return _json(200, {**listed_json(box, front.domain), "envdAccessToken": box.token})

    @r.delete("/sandboxes/{sandbox_id}")
    def kill(request: Request, sandbox_id: str) -> Response:
        box = owned(request, sandbox_id)
        front.boxes.pop(sandbox_id)
        for proc in list(box.procs.values()):
            proc.handle.close()
        front.starts.forget(sandbox_id)
        try:
            front.backend.kill(sandbox_id)
        except SandboxNotFound:
            raise ApiError(404, f"sandbox {sandbox_id!r} not found") from None
        return Response(status_code=204)

    @r.post("/sandboxes/{sandbox_id}/timeout")
    def set_timeout(request: Request, sandbox_id: str, body: dict = Body(...)) -> Response:
        box = owned(request, sandbox_id)
        timeout = _timeout(body.get("timeout"), front.default_timeout)
        with box.lock:
            if box.paused:
                box.paused_left = timeout  # applies from the resume
                front.boxes.save(box)
            else:
                _set_ttl(front, box, timeout)
        return Response(status_code=204)

    @r.post("/sandboxes/{sandbox_id}/pause")
    def pause(request: Request, sandbox_id: str) -> Response:
        box = owned(request, sandbox_id)
        with box.lock:
            if box.paused:
                raise ApiError(409, f"sandbox {sandbox_id!r} is already paused")
            # the lifetime stops while paused (E2B keeps paused sandboxes); cleared first, since
            # changing it would thaw the sandbox again
            left = max(1.0, box.end - time.time())
            try:
                front.backend.set_ttl(sandbox_id, TimeoutRequest(ttl=None))
                front.backend.pause(sandbox_id)
            except SandboxNotFound:
                front.boxes.pop(sandbox_id)
                raise ApiError(404, f"sandbox {sandbox_id!r} not found") from None
            box.paused, box.paused_left = True, left
            front.boxes.save(box)
        return Response(status_code=204)

    def connect(request: Request, sandbox_id: str, body: dict = Body(default_factory=dict)) -> Response:
        box = owned(request, sandbox_id)
        timeout = _timeout(body.get("timeout"), front.default_timeout)
        with box.lock:
            if box.paused:
                try:
                    front.backend.resume(sandbox_id)
                except SandboxNotFound:
                    front.boxes.pop(sandbox_id)
                    raise ApiError(404, f"sandbox {sandbox_id!r} not found") from None
                box.paused = False
                box.end = time.time() + box.paused_left
                status = 201  # resumed
            else:
                status = 200
            # connect extends the end time, never shortens it
            _set_ttl(front, box, max(timeout, box.end - time.time()))
        return _json(status, sandbox_json(box, domain=front.domain))

    r.add_api_route("/sandboxes/{sandbox_id}/connect", connect, methods=["POST"])
    r.add_api_route("/v2/sandboxes/{sandbox_id}/connect", connect, methods=["POST"])
    r.add_api_route("/sandboxes/{sandbox_id}/resume", connect, methods=["POST"])

    @r.get("/sandboxes/{sandbox_id}/metrics")
    def metrics(request: Request, sandbox_id: str) -> Response:
        """One sample, now: memory from the backend's info (no history is kept; CPU and disk use are
        not in the contract's info, so they read 0)."""
        box = owned(request, sandbox_id)
        try:
            info = front.backend.info(sandbox_id)
        except SandboxNotFound:
            raise ApiError(404, f"sandbox {sandbox_id!r} not found") from None
        now = time.time()
        return _json(200, [{"timestamp": rfc3339(now), "timestampUnix": int(now), "cpuCount": box.cpu,
                            "cpuUsedPct": 0.0, "memUsed": info.memory_bytes or 0,
                            "memTotal": info.limits.memory_mb << 20, "memCache": 0, "diskUsed": 0,
                            "diskTotal": info.limits.disk_mb << 20}])

    return r


def _set_ttl(front: Front, box: Box, timeout: float) -> None:
    try:
        front.backend.set_ttl(box.id, TimeoutRequest(ttl=timeout))
    except SandboxNotFound:
        front.boxes.pop(box.id)
        raise ApiError(404, f"sandbox {box.id!r} not found") from None
    box.end = time.time() + timeout
    front.boxes.save(box)


def _token(box: Box) -> str:
    return base64.urlsafe_b64encode(f"{box.started!r} {box.id}".encode()).decode()


def _untoken(token: str) -> tuple[float, str]:
    try:
        started, sid = base64.urlsafe_b64decode(token.encode()).decode().split(" ", 1)
        return float(started), sid
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "nextToken is not a token this server gave out") from None


def _json(status: int, body: Any, headers: dict[str, str] | None = None) -> Response:
    import json

    return Response(json.dumps(body), status_code=status, media_type="application/json", headers=headers)


def error_body(e: ApiError | ShoalError) -> dict[str, Any]:
    return {"code": getattr(e, "status", 500), "message": getattr(e, "message", str(e))}
