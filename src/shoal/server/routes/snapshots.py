"""Snapshots (the writable upper as a layer) and fork (n children of one snapshot)."""
from __future__ import annotations

from fastapi import APIRouter, Depends

from ...core.contract import (
    API_PREFIX,
    ForkReply,
    ForkRequest,
    Limits,
    SnapshotInfo,
    SnapshotRequest,
)
from ..auth import Caller, caller

router = APIRouter(prefix=API_PREFIX + "/sandboxes/{sandbox_id}", tags=["snapshots"])


@router.post("/snapshot", status_code=201)
def snapshot(sandbox_id: str, body: SnapshotRequest | None = None, c: Caller = Depends(caller)) -> SnapshotInfo:
    snap = c.d.backend.snapshot(c.sandbox(sandbox_id), body or SnapshotRequest())
    c.d.state.own("image", snap.image, c.t.name)
    return snap


@router.post("/fork", status_code=201)
def fork(sandbox_id: str, body: ForkRequest, c: Caller = Depends(caller)) -> ForkReply:
    src = c.d.backend.info(c.sandbox(sandbox_id)).limits
    child = Limits(cpu=body.cpu or src.cpu, memory_mb=body.memory_mb or src.memory_mb,
                   disk_mb=body.disk_mb or src.disk_mb, pids=body.pids or src.pids,
                   upper=getattr(body, "upper", None) or src.upper)  # children: the source's limits unless given
    with c.d.quotas.reserve(c.t, [child] * body.n):
        reply = c.d.backend.fork(sandbox_id, body)
        c.d.state.own("image", reply.snapshot.image, c.t.name)
        for sb in reply.sandboxes:
            c.d.state.own("sandbox", sb.id, c.t.name)
    c.d.counters["creates"] += len(reply.sandboxes)
    return reply
