"""Desktop (computer-use) sandboxes: the screen as image/png, input actions as JSON, windows, the
accessibility tree, app launches (docs/desktop.md). All go through `shoal.desktop.ops` over the
served backend, as the SDK's do."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Query, Response
from pydantic import BaseModel, Field

from ...core.contract import API_PREFIX
from ...desktop import ops
from ...desktop.actions import ActionResult, DesktopAction, parse_pyautogui
from ..auth import Caller, caller

router = APIRouter(prefix=API_PREFIX + "/sandboxes/{sandbox_id}/desktop", tags=["desktop"])


class ScreenSize(BaseModel):
    width: int
    height: int


class LaunchRequest(BaseModel):
    app: str = Field(..., max_length=64)
    args: list[str] = Field(default_factory=list, max_length=64)


class PyautoguiRequest(BaseModel):
    code: str = Field(..., max_length=20_000)


@router.post("/start")
def start(sandbox_id: str, c: Caller = Depends(caller)) -> ScreenSize:
    w, h = ops.start(c.d.backend, c.sandbox(sandbox_id))
    return ScreenSize(width=w, height=h)


@router.get("/screenshot", response_class=Response, responses={200: {"content": {"image/png": {}}}})
def screenshot(sandbox_id: str, scale: float | None = Query(None, gt=0, le=1),
               c: Caller = Depends(caller)) -> Response:
    return Response(c.d.backend.desktop_screenshot(c.sandbox(sandbox_id), scale), media_type="image/png")


@router.post("/actions")
def action(sandbox_id: str, body: DesktopAction, c: Caller = Depends(caller)) -> ActionResult:
    return c.d.backend.desktop_action(c.sandbox(sandbox_id), body)


@router.post("/pyautogui")
def pyautogui(sandbox_id: str, body: PyautoguiRequest, c: Caller = Depends(caller)) -> list[ActionResult]:
    """OSWorld-style pyautogui code: parsed (never executed), each call run as an action; "DONE",
    "FAIL" and "WAIT" come back as results with that action name."""
    sid = c.sandbox(sandbox_id)
    out = []
    for a in parse_pyautogui(body.code):
        out.append(ActionResult(action=a) if isinstance(a, str) else c.d.backend.desktop_action(sid, a))
    return out


@router.get("/windows")
def windows(sandbox_id: str, c: Caller = Depends(caller)) -> list[ops.Window]:
    return ops.windows(c.d.backend, c.sandbox(sandbox_id))


@router.get("/accessibility")
def accessibility(sandbox_id: str, depth: int = Query(8, ge=1, le=50), max_nodes: int = Query(2000, ge=1, le=50_000),
                  c: Caller = Depends(caller)) -> ops.A11yNode:
    return ops.accessibility_tree(c.d.backend, c.sandbox(sandbox_id), depth, max_nodes)


@router.post("/launch")
def launch(sandbox_id: str, body: LaunchRequest, c: Caller = Depends(caller)) -> dict[str, int]:
    return {"pid": ops.launch(c.d.backend, c.sandbox(sandbox_id), body.app, body.args)}
