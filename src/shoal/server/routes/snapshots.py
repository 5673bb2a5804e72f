"""Snapshots (the writable upper as a layer) and fork (n children of one snapshot)."""
from __future__ import annotations

from fastapi import APIRouter, Depends

from ...core.contract import (
    API_PREFIX,
    ForkReply,
    ForkRequest,
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
    return c.d.fork(c.t, sandbox_id, body)
