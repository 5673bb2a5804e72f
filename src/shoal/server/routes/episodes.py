"""Episodes of the daemon's trajectory log: branch one at a step, show its tree (rollout.branch).

The log is the one named by $SHOAL_TRAJLOG or the config's `trajlog` (an SQLite path or a
postgresql:// URL, shared with the rollout workers); without one these routes answer 501.

Who may branch what: a log is written by clients, so shoald trusts no name in it. An episode is a
tenant's when every snapshot its steps took is that tenant's (shoald records who made each
snapshot), or when shoald made it as that tenant's branch. Anything else is 404, as for sandboxes.
The branch's sandbox is created as the caller's, through the same image checks, quotas and admission
as any create, so even a forged log yields nothing the caller could not create itself.
"""
from __future__ import annotations

import os
import threading
import weakref
from typing import Any

from fastapi import APIRouter, Depends

from ...core import errors as E
from ...core.contract import API_PREFIX, BranchReply, BranchRequest, CreateRequest, SandboxInfo
from ..auth import Caller, caller
from ..served import Served
from ..state import Tenant
from .sandboxes import check_images

router = APIRouter(prefix=API_PREFIX + "/episodes", tags=["episodes"])
_lock = threading.Lock()
_logs: weakref.WeakKeyDictionary[Served, Any] = weakref.WeakKeyDictionary()  # per served daemon, opened once


def episode_log(d: Served) -> Any:
    """The daemon's trajectory log (opened once), or BackendUnavailable when none is configured."""
    log = _logs.get(d)
    if log is not None:
        return log
    settings = getattr(d, "settings", None)
    where = os.environ.get("SHOAL_TRAJLOG") or (settings.extra.get("trajlog") if settings is not None else None)
    if not where:
        raise E.BackendUnavailable("this shoald has no trajectory log (set $SHOAL_TRAJLOG or `trajlog` in the config)")
    from ...trajlog import TrajectoryLog

    with _lock:
        if d not in _logs:
            _logs[d] = TrajectoryLog(str(where))
        return _logs[d]


def _episode(c: Caller, episode: str) -> Any:
    """The episode, if the caller may see it (else EpisodeNotFound)."""
    from ...rollout.branch import Episode

    try:
        ep = Episode(episode_log(c.d), episode, c.d.backend)
    except E.InvalidArgument:
        raise E.EpisodeNotFound(f"episode {episode!r} not found") from None
    if not ep.exists() or not _mine(c.d, c.t, ep):
        raise E.EpisodeNotFound(f"episode {episode!r} not found")
    return ep


def _mine(d: Served, t: Tenant, ep: Any) -> bool:
    if t.admin or d.state.owner("episode", ep.id) == t.name:
        return True
    snaps = ep.snapshots()
    return bool(snaps) and all(d.state.owner("image", f"snapshots/{s}:latest") == t.name for s in snaps)


@router.post("/{episode}/branch", status_code=201)
def branch(episode: str, body: BranchRequest, c: Caller = Depends(caller)) -> BranchReply:
    ep = _episode(c, episode)

    def create(req: CreateRequest) -> SandboxInfo:
        # the log is the clients' to write: the start layers it names are checked like any create's
        check_images(c, req)
        return c.d.create(c.t, req)

    b = ep.branch(body.step, strategy=body.strategy, episode_id=body.episode_id, ttl=body.ttl,
                  from_step=body.from_step, creator=create, address=body.address, node=body.node)
    c.d.state.own("episode", b.id, c.t.name)
    info = b.info
    return BranchReply(episode=b.id, parent=ep.id, step=info.step, strategy=info.strategy, from_step=info.from_step,
                       replayed_ops=info.replayed_ops, entries=info.entries, seconds=info.seconds,
                       sandbox=c.d.backend.info(info.sandbox))


@router.get("/{episode}/tree")
def tree(episode: str, c: Caller = Depends(caller)) -> dict:
    return _episode(c, episode).tree().to_dict()
