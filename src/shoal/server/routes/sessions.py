"""Sessions: long-lived shells whose `SessionHandle`s the daemon keeps under ids it issues."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Response

from ...core.contract import (
    API_PREFIX,
    ExecResult,
    SessionInfo,
    SessionRequest,
    SessionRunRequest,
)
from ..auth import Caller, caller

router = APIRouter(prefix=API_PREFIX + "/sandboxes/{sandbox_id}/sessions", tags=["sessions"])


@router.post("", status_code=201)
def open_session(sandbox_id: str, body: SessionRequest | None = None, c: Caller = Depends(caller)) -> SessionInfo:
    sid = c.sandbox(sandbox_id)
    s = c.d.backend.open_session(sid, body or SessionRequest())
    return SessionInfo(id=c.d.keep(c.d.sessions, sid, s), shell=s.shell)


@router.post("/{session_id}/run")
def run(sandbox_id: str, session_id: str, body: SessionRunRequest, c: Caller = Depends(caller)) -> ExecResult:
    return c.d.lookup(c.d.sessions, c.t, sandbox_id, session_id).run(body.cmd, timeout=body.timeout)


@router.delete("/{session_id}", status_code=204)
def close(sandbox_id: str, session_id: str, c: Caller = Depends(caller)) -> Response:
    c.d.lookup(c.d.sessions, c.t, sandbox_id, session_id)  # 404 unless visible
    c.d.sessions.pop(sandbox_id, session_id)
    return Response(status_code=204)
