"""`sb.desktop`: drive a desktop (computer-use) sandbox: screenshots, mouse, keyboard, windows,
the accessibility tree, app launches (docs/desktop.md).

    with Sandbox.create("desktop:bookworm", layers=["desktop-app/editor:1"]) as sb:
        sb.desktop.start()
        sb.desktop.launch("editor")
        sb.desktop.wait_for_window("Mousepad")
        sb.desktop.type("héllo ✓"); sb.desktop.key("ctrl+s")
        png = sb.desktop.screenshot()

Three spellings of the same actions: these methods; E2B Desktop's names (left_click, move_mouse,
write, press, get_screen_size, ...); and OSWorld's pyautogui code strings (`run_pyautogui`), which
are parsed, never executed. Screenshots and actions are single calls of the backend contract
(`desktop_screenshot`, `desktop_action`), so through shoald each is one HTTP request."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..core.errors import CommandTimeout, InvalidArgument
from ..desktop import ops
from ..desktop.actions import ActionResult, Button, DesktopAction, _mk, combo, parse_pyautogui
from ..desktop.ops import A11yNode, Window

if TYPE_CHECKING:
    from .sandbox import Sandbox

Point = tuple[int, int]


class Desktop:
    def __init__(self, sb: Sandbox):
        self._sb = sb

    def _act(self, **kw: object) -> ActionResult:
        return self._sb._backend.desktop_action(self._sb.id, _mk(**kw))

    # ------------------------------------------------------------------ lifecycle, screen
    def start(self) -> Point:
        """Start the X server, session bus and window manager if they are not running; the screen size."""
        return ops.start(self._sb._backend, self._sb.id)

    def screenshot(self, scale: float | None = None) -> bytes:
        """The screen as PNG bytes, nearest-neighbour scaled by `scale` in (0, 1]. DesktopUnavailable
        if the sandbox's X server is not running."""
        return self._sb._backend.desktop_screenshot(self._sb.id, scale)

    def get_screen_size(self) -> Point:
        return ops.screen_size(self._sb._backend, self._sb.id)

    def get_cursor_position(self) -> Point:
        return ops.cursor(self._sb._backend, self._sb.id)

    # ------------------------------------------------------------------ mouse
    def click(self, x: int | None = None, y: int | None = None, button: Button = "left",
              clicks: int = 1) -> ActionResult:
        """Click at (x, y), or where the pointer is when both are None."""
        return self._act(action="click", x=x, y=y, button=button, clicks=clicks)

    def double_click(self, x: int | None = None, y: int | None = None) -> ActionResult:
        return self._act(action="double_click", x=x, y=y)

    def right_click(self, x: int | None = None, y: int | None = None) -> ActionResult:
        return self._act(action="right_click", x=x, y=y)

    def middle_click(self, x: int | None = None, y: int | None = None) -> ActionResult:
        return self._act(action="middle_click", x=x, y=y)

    def left_click(self, x: int | None = None, y: int | None = None) -> ActionResult:
        """E2B Desktop's name for click."""
        return self.click(x, y)

    def move(self, x: int, y: int) -> ActionResult:
        return self._act(action="move", x=x, y=y)

    def move_mouse(self, x: int, y: int) -> ActionResult:
        """E2B Desktop's name for move."""
        return self.move(x, y)

    def drag(self, fr: Point, to: Point, button: Button = "left") -> ActionResult:
        """Press at `fr`, move to `to`, release (E2B's signature)."""
        return self._act(action="drag", x=fr[0], y=fr[1], to_x=to[0], to_y=to[1], button=button)

    def scroll(self, direction: str = "down", amount: int = 1, x: int | None = None,
               y: int | None = None) -> ActionResult:
        """Scroll `amount` wheel clicks up / down / left / right, at (x, y) if given."""
        return self._act(action="scroll", direction=direction, amount=amount, x=x, y=y)

    def mouse_press(self, button: Button = "left") -> ActionResult:
        return self._act(action="mouse_down", button=button)

    def mouse_release(self, button: Button = "left") -> ActionResult:
        return self._act(action="mouse_up", button=button)

    # ------------------------------------------------------------------ keyboard
    def type(self, text: str) -> ActionResult:
        """Type text (any Unicode; newlines press Return). At most 4096 characters per call."""
        return self._act(action="type", text=text)

    def write(self, text: str) -> ActionResult:
        """E2B Desktop's name for type."""
        return self.type(text)

    def key(self, keys: str) -> ActionResult:
        """Press a key or combination: "enter", "ctrl+s", "ctrl+shift+t", "f5"."""
        return self._act(action="key", keys=keys)

    def press(self, key: str | list[str]) -> ActionResult:
        """E2B Desktop's press: a key name, or a list of keys pressed together."""
        return self._act(action="key", keys=combo(key))

    def act(self, action: DesktopAction | dict) -> ActionResult:
        """One action in its JSON form ({"action": "click", "x": 10, "y": 20}, ...)."""
        a = action if isinstance(action, DesktopAction) else _mk(**action)
        return self._sb._backend.desktop_action(self._sb.id, a)

    def run_pyautogui(self, code: str) -> list[ActionResult]:
        """OSWorld-style pyautogui code, parsed with `ast` (never executed) and run call by call.
        "DONE" / "FAIL" / "WAIT" come back as results named so."""
        out = []
        for a in parse_pyautogui(code):
            out.append(ActionResult(action=a) if isinstance(a, str) else
                       self._sb._backend.desktop_action(self._sb.id, a))
        return out

    def wait(self, ms: int) -> None:
        """E2B Desktop's wait, in milliseconds."""
        time.sleep(ms / 1000)

    # ------------------------------------------------------------------ windows, accessibility, apps
    def windows(self) -> list[Window]:
        """Managed windows: title, app (WM class), geometry, focused."""
        return ops.windows(self._sb._backend, self._sb.id)

    def accessibility_tree(self, depth: int = 8, max_nodes: int = 2000) -> A11yNode:
        """The AT-SPI tree from the desktop root: role, name, bounds, states (and text of text
        widgets), at most `depth` levels and `max_nodes` nodes (cut branches say truncated)."""
        return ops.accessibility_tree(self._sb._backend, self._sb.id, depth, max_nodes)

    def activate(self, title: str) -> None:
        """Raise and focus the window whose title contains `title`."""
        ops.activate(self._sb._backend, self._sb.id, title)

    def launch(self, app: str, args: list[str] | str | None = None) -> int:
        """Start an installed app ("editor", "spreadsheet", "files", "browser": its toolkit layer must
        be composed into the sandbox), detached; its pid. A string `args` is one argument (E2B's uri)."""
        argv = [args] if isinstance(args, str) else list(args or [])
        return ops.launch(self._sb._backend, self._sb.id, app, argv)

    def wait_for_window(self, title: str, timeout: float = 15.0) -> Window:
        """The first window whose title contains `title` (case-insensitive); CommandTimeout after `timeout` s."""
        if not title:
            raise InvalidArgument("wait_for_window needs a title")
        deadline = time.monotonic() + timeout
        while True:
            seen = self.windows()
            for w in seen:
                if title.lower() in w.title.lower():
                    return w
            if time.monotonic() > deadline:
                raise CommandTimeout(f"no window titled like {title!r} within {timeout} s in {self._sb.id} "
                                     f"(windows: {[w.title for w in seen]})")
            time.sleep(0.1)
