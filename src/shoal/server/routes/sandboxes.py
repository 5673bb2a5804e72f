"""Sandboxes: create (quotas, admission, ownership: the served side's `create`; idempotent with a key),
list, info, kill, pause, resume, TTLs, network."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Header, Response

from ...config import KsmConfig
from ...core import errors as E
from ...core.contract import (
    API_PREFIX,
    CreateRequest,
    NetworkPolicy,
    NetworkRequest,
    ReclaimRequest,
    ReclaimResult,
    SandboxInfo,
    TimeoutRequest,
)
from ..auth import Caller, caller

router = APIRouter(prefix=API_PREFIX + "/sandboxes", tags=["sandboxes"])


@router.post("", status_code=201)
def create(body: CreateRequest, c: Caller = Depends(caller),
           idempotency_key: str | None = Header(None, max_length=200, pattern=r"^[\x21-\x7e]+$",
                                                description="a retried create with the same key (by the same "
                                                            "tenant) answers the sandbox the first one made")
           ) -> SandboxInfo:
    d, t = c.d, c.t
    if body.network == "host" and not t.admin:
        raise E.Unauthorized("network='host' (the host's network, for image builds) is for the admin only")
    if body.ksm and not t.admin and not _tenants_may_merge(d):
        raise E.Unauthorized("ksm=True (pages merged with every other ksm sandbox on the host: a side channel) "
                             "is for the admin only unless the host's config sets [ksm] tenants = true")
    check_images(c, body)
    return d.create(t, body, idempotency_key)


def check_images(c: Caller, req: CreateRequest) -> None:
    """Every image a create names (its image, its snapshot, each named layer) is one the caller may
    use: the one check of a create's references, for every route that creates (branching too)."""
    refs = [f"snapshots/{req.from_snapshot}:latest"] if req.from_snapshot else []
    refs += [x for x in [req.image] + [x for x in req.layers or [] if ":" in x and not x.startswith("sha256:")]
             if x]
    c.d.check_create_images(c.t, refs)


def _tenants_may_merge(d: object) -> bool:
    settings = getattr(d, "settings", None)  # a fleet gateway has none: its hosts decide, refuse here
    return settings is not None and KsmConfig.from_settings(settings.extra).tenants


@router.get("")
def list_sandboxes(c: Caller = Depends(caller)) -> list[SandboxInfo]:
    return c.d.list_sandboxes(c.t)


@router.get("/{sandbox_id}")
def info(sandbox_id: str, c: Caller = Depends(caller)) -> SandboxInfo:
    return c.d.backend.info(c.sandbox(sandbox_id))


@router.delete("/{sandbox_id}", status_code=204)
def kill(sandbox_id: str, c: Caller = Depends(caller)) -> Response:
    try:
        c.d.backend.kill(c.sandbox(sandbox_id))
    except E.SandboxNotFound:
        if c.t.admin or c.d.state.owner("sandbox", sandbox_id) == c.t.name:
            c.d.forget(sandbox_id)  # it ended on its own: its record and handles go too
        raise
    c.d.forget(sandbox_id)
    return Response(status_code=204)


@router.post("/{sandbox_id}/pause", status_code=204)
def pause(sandbox_id: str, c: Caller = Depends(caller)) -> Response:
    c.d.backend.pause(c.sandbox(sandbox_id))
    return Response(status_code=204)


@router.post("/{sandbox_id}/resume", status_code=204)
def resume(sandbox_id: str, c: Caller = Depends(caller)) -> Response:
    c.d.backend.resume(c.sandbox(sandbox_id))
    return Response(status_code=204)


@router.post("/{sandbox_id}/reclaim")
def reclaim(sandbox_id: str, body: ReclaimRequest, c: Caller = Depends(caller)) -> ReclaimResult:
    """Push `target` of the sandbox's anonymous memory to swap (zram); a paused sandbox stays paused."""
    result = c.d.backend.reclaim(c.sandbox(sandbox_id), body)
    counters = c.d.counters  # a fleet gateway counts what passed through it too
    counters["reclaims"] = counters.get("reclaims", 0) + 1
    counters["reclaimed_bytes"] = counters.get("reclaimed_bytes", 0) + result.reclaimed
    return result


@router.put("/{sandbox_id}/timeout")
def set_ttl(sandbox_id: str, body: TimeoutRequest, c: Caller = Depends(caller)) -> SandboxInfo:
    """Replaces both lifetimes: a field left out is cleared, not kept."""
    return c.d.backend.set_ttl(c.sandbox(sandbox_id), body)


@router.get("/{sandbox_id}/network")
def get_network(sandbox_id: str, c: Caller = Depends(caller)) -> NetworkPolicy:
    return c.d.backend.get_network(c.sandbox(sandbox_id))


@router.put("/{sandbox_id}/network")
def set_network(sandbox_id: str, body: NetworkRequest, c: Caller = Depends(caller)) -> NetworkPolicy:
    """Replaces the egress rules: fields left out are cleared, never merged."""
    return c.d.backend.set_network(c.sandbox(sandbox_id), body)
