"""E2B's snapshots and fork over Shoal's pack_diff snapshots (`SandboxBackend.snapshot` / `fork`).

- `POST /sandboxes/{id}/snapshots` {name?, memory?} -> 201 {snapshotID, names}: a Shoal snapshot of the
  sandbox's filesystem (its writable upper as a layer; running processes and memory are not kept).
- `GET /snapshots` (?sandboxID, ?name, ?limit, ?nextToken; `x-next-token`): the tenant's, newest first.
- `Sandbox.create(template=snapshotID or a name)` restores one (control.py asks `find`).
- `DELETE /templates/{snapshotID}`: forgets it and removes its image (the layer goes at the host's layer GC).
- `POST /sandboxes/{id}/fork` {timeout?, count?} -> 201 [{sandbox} | {error: {code, message}}]: count
  children restored from one snapshot, each with the source's env, template and metadata.
The index is written through to the front's SQLite state (`--state`), like its sandboxes.
"""
from __future__ import annotations

import math
import secrets
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Body, Request, Response

from ..core.contract import ForkRequest, SnapshotRequest
from ..core.errors import QuotaExceeded, ShoalError
from .front import ApiError
from .state import Box, BoxStore

if TYPE_CHECKING:
    from .front import Front

MAX_FORKS = 20  # children of one fork call (the SDK's own bound)
MAX_SNAPSHOTS = 100  # snapshots one tenant keeps in the index
_NAME_OK = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:/")


@dataclass
class Snap:
    id: str
    tenant: str
    sandbox_id: str
    names: list[str]
    template: str
    metadata: dict[str, str]
    home: str
    has_home: bool
    created: float


@dataclass
class SnapshotIndex:
    store: BoxStore | None = None  # written through to the front's SQLite state, when it has one
    _snaps: dict[str, Snap] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def load(self) -> None:
        if self.store is not None:
            for d in self.store.load_snapshots():
                self._snaps[d["id"]] = Snap(**d)

    def check_room(self, tenant: str, replacing: str | None = None) -> None:
        """429 when the tenant is at its cap; asked before the backend takes the snapshot, so a
        refused one leaves no image behind (`replacing`: a name whose snapshot the new one replaces)."""
        with self._lock:
            mine = [x for x in self._snaps.values() if x.tenant == tenant]
        if len(mine) >= MAX_SNAPSHOTS and not (replacing and self.find(tenant, replacing)):
            raise ApiError(429, f"this API key's tenant has {MAX_SNAPSHOTS} snapshots: delete some first")

    def add(self, s: Snap) -> None:
        with self._lock:
            mine = [x for x in self._snaps.values() if x.tenant == s.tenant]
            if len(mine) >= MAX_SNAPSHOTS:
                raise ApiError(429, f"this API key's tenant has {MAX_SNAPSHOTS} snapshots: delete some first")
            self._snaps[s.id] = s
        if self.store is not None:
            self.store.save_snapshot(s.id, asdict(s))

    def find(self, tenant: str, ref: str) -> Snap | None:
        """The tenant's snapshot named `ref` (its id or one of its names, with or without `:default`)."""
        bare = ref[:-len(":default")] if ref.endswith(":default") else ref
        with self._lock:
            for s in self._snaps.values():
                if s.tenant == tenant and (bare == s.id or ref in s.names or bare in s.names):
                    return s
        return None

    def list(self, tenant: str) -> list[Snap]:
        with self._lock:
            return sorted((s for s in self._snaps.values() if s.tenant == tenant), key=lambda s: -s.created)

    def remove(self, tenant: str, ref: str) -> Snap | None:
        s = self.find(tenant, ref)
        if s is None:
            return None
        with self._lock:
            self._snaps.pop(s.id, None)
        if self.store is not None:
            self.store.delete_snapshot(s.id)
        return s


def _status(type_name: str) -> int:
    return {"QuotaExceeded": 429, "ImageNotFound": 404, "SandboxNotFound": 404, "InvalidArgument": 400}.get(
        type_name, 500)


def router(front: Front) -> APIRouter:
    from .control import _json, _timeout, sandbox_json

    r = APIRouter()

    tenant_of, owned = front.tenant_of, front.owned

    def forget_image(s: Snap | None) -> None:
        """The backend's image of a snapshot the index forgot (else each create+delete would keep a
        layer on the host for good); sandboxes restored from it keep their mounted layers."""
        remove = getattr(front.backend, "remove_image", None) or getattr(
            getattr(front.backend, "store", None), "remove_image", None)
        if s is None or remove is None:
            return
        try:
            remove(f"snapshots/{s.id}:latest")
        except (ShoalError, LookupError):
            pass  # gone already

    @r.post("/sandboxes/{sandbox_id}/snapshots")
    def create_snapshot(request: Request, sandbox_id: str, body: dict = Body(default_factory=dict)) -> Response:
        box = owned(request, sandbox_id)
        name = body.get("name")
        if name is not None and (not isinstance(name, str) or not 0 < len(name) <= 128 or set(name) - _NAME_OK):
            raise ApiError(400, "name must be 1-128 characters of letters, digits and -_.:/")
        front.snapshots.check_room(box.tenant, name)
        try:
            info = front.backend.snapshot(box.id, SnapshotRequest())
        except QuotaExceeded as e:
            raise ApiError(429, str(e)) from None
        names = [f"{name}:default"] if name else [f"{info.id}:default"]
        if name:  # E2B: a name in use gets the new snapshot (a new build of that template)
            forget_image(front.snapshots.remove(box.tenant, name))
        snap = Snap(id=info.id, tenant=box.tenant, sandbox_id=box.id, names=names, template=box.template,
                    metadata=dict(box.metadata), home=box.home, has_home=box.has_home, created=time.time())
        try:
            front.snapshots.add(snap)
        except ApiError:  # concurrent creates filled the cap meanwhile: the image taken is not kept
            forget_image(snap)
            raise
        return _json(201, {"snapshotID": names[0], "names": names})

    @r.get("/snapshots")
    def list_snapshots(request: Request, sandboxID: str | None = None, name: str | None = None,  # noqa: N803
                       limit: int = 100, nextToken: str | None = None) -> Response:  # noqa: N803
        tenant = tenant_of(request)
        if not 1 <= limit <= 1000:
            raise ApiError(400, "limit must be in 1..1000")
        snaps = [s for s in front.snapshots.list(tenant)
                 if (sandboxID is None or s.sandbox_id == sandboxID)
                 and (name is None or name in s.names or f"{name}:default" in s.names)]
        start = 0
        if nextToken:
            try:
                start = int(nextToken)
            except ValueError:
                raise ApiError(400, "bad nextToken") from None
        page = snaps[start:start + limit]
        headers = {"x-next-token": str(start + limit)} if start + limit < len(snaps) else None
        return _json(200, [{"snapshotID": s.names[0], "names": s.names} for s in page], headers)

    @r.delete("/templates/{ref:path}")
    def delete_snapshot(request: Request, ref: str) -> Response:
        tenant = tenant_of(request)
        gone = front.snapshots.remove(tenant, ref)
        if gone is None:
            raise ApiError(404, f"snapshot or template {ref!r} not found")
        forget_image(gone)
        return Response(status_code=204)

    @r.post("/sandboxes/{sandbox_id}/fork")
    def fork(request: Request, sandbox_id: str, body: dict = Body(default_factory=dict)) -> Response:
        box = owned(request, sandbox_id)
        count = body.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_FORKS:
            raise ApiError(400, f"count must be an integer in 1..{MAX_FORKS}")
        timeout = _timeout(body.get("timeout"), front.default_timeout)
        cap = front.limits.sandboxes
        held = 0  # the children's places, held while the fork is in flight (as creates hold theirs)
        if cap:  # the children count against the tenant's sandboxes like creates do
            def live() -> int:
                return sum(1 for b in front.boxes.all() if b.tenant == box.tenant)

            while held < count and front.creating.take_room(box.tenant, cap, live):
                held += 1
            if held < count:
                for _ in range(held):
                    front.creating.give(box.tenant)
                raise ApiError(429, f"this API key's tenant has {cap} sandboxes at most (the front's limit): "
                                    f"no room for {count} forks")
        try:
            return _fork(box, count, timeout)
        finally:
            for _ in range(held):
                front.creating.give(box.tenant)

    def _fork(box: Box, count: int, timeout: float) -> Response:
        try:
            reply = front.backend.fork(box.id, ForkRequest(n=count, copy_env=True, ttl=timeout))
        except QuotaExceeded as e:
            raise ApiError(429, str(e)) from None
        out: list[dict[str, Any]] = []
        made = iter(reply.sandboxes)
        failed = {f.index: f for f in reply.failed}
        now = time.time()
        for i in range(count):
            if i in failed:
                f = failed[i]
                out.append({"error": {"code": _status(f.type), "message": f"{f.type}: {f.message}"}})
                continue
            try:
                info = next(made)
            except StopIteration:
                out.append({"error": {"code": 500, "message": "the fork made fewer sandboxes than asked"}})
                continue
            child = Box(id=info.id, tenant=box.tenant, template=box.template, token=secrets.token_urlsafe(24),
                        metadata=dict(box.metadata), started=now, end=now + timeout,
                        cpu=max(1, math.ceil(info.limits.cpu)), memory_mb=info.limits.memory_mb,
                        disk_mb=info.limits.disk_mb, home=box.home, has_home=box.has_home)
            front.boxes.add(child)
            out.append({"sandbox": sandbox_json(child, domain=front.domain)})
        return _json(201, out)

    return r

