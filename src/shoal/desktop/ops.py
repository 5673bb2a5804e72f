"""Desktop operations over any backend, through the contract: file reads for screenshots, commands
in the sandbox for input (xdotool) and for what needs the X server's or AT-SPI's view (the
in-sandbox helper `shoal-desktop`). The SDK (`sb.desktop`) and shoald's desktop routes both call
these, so the two behave the same."""
from __future__ import annotations

import json
import threading
import time

from pydantic import BaseModel

from ..core.contract import ExecRequest, ExecResult, SandboxBackend
from ..core.errors import CommandTimeout, DesktopUnavailable, FileOpError, InvalidArgument, NotSupported, SandboxError
from . import DEVTOOLS_PORT, FB_PATH, HELPER, HELPER_ARGV, STATE_DIR
from .actions import ActionResult, DesktopAction, xdotool_argv
from .screen import xwd_to_png

_PIDFILE = STATE_DIR + "/xvfb.pid"
# X is alive iff the pid in Xvfb's pid file is a process that is not a zombie (a killed server
# whose parent is gone may wait unreaped): one tiny shell, no Python start-up
_ALIVE = ["/bin/sh", "-c", f"exec 2>/dev/null; read p < {_PIDFILE}; [ -n \"$p\" ] || exit 1; "
          "read s < /proc/$p/stat || exit 1; case \"${s##*) }\" in Z*|X*|x*) exit 1;; esac"]
_sizes: dict[tuple[str, str], tuple[int, int]] = {}  # (backend address, sandbox) -> screen size
_lock = threading.Lock()


class Window(BaseModel):
    id: int
    title: str
    app: str  # the WM_CLASS class, lower case (e.g. "mousepad", "gnumeric")
    wm_class: str
    pid: int
    x: int
    y: int
    width: int
    height: int
    focused: bool


class A11yNode(BaseModel):
    role: str
    name: str
    bounds: list[int] | None = None  # x, y, width, height on the screen
    states: list[str] = []
    text: str | None = None
    truncated: bool = False
    children: list[A11yNode] = []


def _run(backend: SandboxBackend, sid: str, argv: list[str], timeout: float = 20.0,
         output_cap: int | None = None) -> ExecResult:
    return backend.exec(sid, ExecRequest(argv=argv, timeout=timeout, output_cap=output_cap))


def _helper(backend: SandboxBackend, sid: str, *args: str, timeout: float = 20.0) -> str:
    r = _run(backend, sid, [*HELPER_ARGV, *args], timeout, output_cap=16 << 20)
    if r.timed_out:
        raise CommandTimeout(f"shoal-desktop {args[0]} timed out after {timeout} s in {sid}", r)
    if r.exit_code == 3:
        raise DesktopUnavailable(f"sandbox {sid} has no running desktop: {r.stderr.strip()[-300:]}")
    if r.exit_code == 4:
        raise InvalidArgument(r.stderr.strip()[-500:])
    if r.exit_code == 127 or (r.exit_code == 2 and "can't open file" in r.stderr):
        raise DesktopUnavailable(f"sandbox {sid} is not a desktop sandbox (no {HELPER}; create it from "
                                 f"desktop:bookworm)")
    if r.exit_code != 0:
        raise SandboxError(f"shoal-desktop {args[0]} exited with {r.exit_code} in {sid}: {r.stderr.strip()[-500:]}")
    return r.stdout


def _parse_size(text: str) -> tuple[int, int]:
    w, _, h = text.strip().partition("x")
    return int(w), int(h)


def start(backend: SandboxBackend, sid: str) -> tuple[int, int]:
    """Start the desktop (X server, session bus, window manager) if it is not running; its size."""
    _guard_devtools(backend, sid)  # before any app starts: agent code never speaks to the browser's DevTools
    size = _parse_size(_helper(backend, sid, "start"))
    with _lock:
        _sizes[(backend.address, sid)] = size
    return size


def screen_size(backend: SandboxBackend, sid: str) -> tuple[int, int]:
    with _lock:
        size = _sizes.get((backend.address, sid))
    if size is None:
        size = _parse_size(_helper(backend, sid, "alive"))
        with _lock:
            _sizes[(backend.address, sid)] = size
    return size


def screenshot(backend: SandboxBackend, sid: str, scale: float | None = None) -> bytes:
    """A PNG of the screen: the X server's liveness checked (a stale framebuffer of a dead server
    is never returned), then its framebuffer file read and encoded here."""
    if scale is not None and not 0 < scale <= 1:
        raise InvalidArgument(f"scale must be in (0, 1], got {scale}")
    # the liveness check runs beside the read (both are waits on the sandbox), not before it
    box: dict[str, object] = {}

    def check() -> None:
        try:
            box["r"] = _run(backend, sid, _ALIVE, 10)
        except BaseException as e:  # re-raised below
            box["e"] = e

    t = threading.Thread(target=check, daemon=True)
    t.start()
    try:
        data = backend.read_file(sid, FB_PATH, 256 << 20)
    except FileOpError as e:
        t.join()
        raise DesktopUnavailable(f"sandbox {sid}: no framebuffer ({e})") from None
    finally:
        t.join()
    err = box.get("e")
    if isinstance(err, BaseException):
        raise err
    r = box["r"]
    assert isinstance(r, ExecResult)
    if r.exit_code != 0:
        raise DesktopUnavailable(f"sandbox {sid} has no running X server (start it with desktop.start())")
    return xwd_to_png(data, scale)


def act(backend: SandboxBackend, sid: str, action: DesktopAction) -> ActionResult:
    """Run one input action; coordinates are checked against the screen first."""
    argv = xdotool_argv(action, screen_size(backend, sid))
    if argv is None:  # wait
        time.sleep(action.seconds)
        return ActionResult(action=action.action)
    r = _run(backend, sid, argv, 30)
    if r.timed_out:
        raise CommandTimeout(f"desktop {action.action} timed out in {sid}", r)
    if r.exit_code != 0:
        if "open display" in r.stderr or "Can't open" in r.stderr or (argv[0] == HELPER and r.exit_code == 3):
            raise DesktopUnavailable(f"sandbox {sid} has no running X server")
        raise SandboxError(f"desktop {action.action} failed (xdotool exit {r.exit_code}): {r.stderr.strip()[-300:]}")
    return ActionResult(action=action.action)


def windows(backend: SandboxBackend, sid: str) -> list[Window]:
    return [Window.model_validate(w) for w in json.loads(_helper(backend, sid, "windows"))]


def accessibility_tree(backend: SandboxBackend, sid: str, depth: int = 8, max_nodes: int = 2000) -> A11yNode:
    if not 1 <= depth <= 50 or not 1 <= max_nodes <= 50_000:
        raise InvalidArgument("depth must be in 1..50 and max_nodes in 1..50000")
    return A11yNode.model_validate(json.loads(_helper(backend, sid, "a11y", str(depth), str(max_nodes),
                                                      timeout=60)))


def launch(backend: SandboxBackend, sid: str, app: str, args: list[str] | None = None) -> int:
    """Start an installed app (its toolkit layer's launcher entry) detached; its pid in the sandbox."""
    if not app or not app.replace("-", "").replace("_", "").isalnum():
        raise InvalidArgument(f"app names are short words (editor, spreadsheet, files, browser), got {app!r}")
    _guard_devtools(backend, sid)
    return int(_helper(backend, sid, "launch", app, *(args or [])).strip())


def _guard_devtools(backend: SandboxBackend, sid: str) -> None:
    """Only the host reaches the browser's DevTools port (the grader's way to the DOM); a backend that
    cannot guard it leaves it open, and a browser_dom check there fails closed (tasks/desktop/browser.py)."""
    try:
        backend.guard_port(sid, DEVTOOLS_PORT)
    except NotSupported:
        pass


def activate(backend: SandboxBackend, sid: str, title: str) -> None:
    """Raise and focus the window whose title contains `title` (InvalidArgument if there is none)."""
    if not title:
        raise InvalidArgument("activate needs a title")
    _helper(backend, sid, "activate", title)


def cursor(backend: SandboxBackend, sid: str) -> tuple[int, int]:
    r = _run(backend, sid, ["xdotool", "getmouselocation", "--shell"], 10)
    if r.exit_code != 0:
        raise DesktopUnavailable(f"sandbox {sid} has no running X server")
    vals = dict(line.split("=", 1) for line in r.stdout.split() if "=" in line)
    return int(vals["X"]), int(vals["Y"])
