"""The desktop action space: one JSON shape (`DesktopAction`), checked, turned into an xdotool argv.

Two more spellings arrive at the same actions:
- pyautogui code strings, as OSWorld agents emit them (`pyautogui.click(100, 200)`), read with
  `ast` into actions: only calls of known pyautogui functions with literal arguments (and
  `time.sleep`, `import pyautogui`) are accepted; nothing is ever executed on the host.
- E2B Desktop's method names (left_click, move_mouse, write, press, ...), on `sb.desktop`.
"""
from __future__ import annotations

import ast
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ..core.errors import InvalidArgument
from . import HELPER

MAX_TYPE_CHARS = 4096  # one type() call; longer text is an agent bug or an attempt to stall the X server
MAX_CLICKS = 10
MAX_SCROLL = 50

Kind = Literal["click", "double_click", "triple_click", "right_click", "middle_click", "move", "drag", "scroll",
               "type", "key", "key_down", "key_up", "mouse_down", "mouse_up", "wait"]
Button = Literal["left", "middle", "right"]
_BUTTON = {"left": "1", "middle": "2", "right": "3"}


class DesktopAction(BaseModel):
    """One input action (the JSON body of POST /sandboxes/{id}/desktop/actions)."""

    model_config = ConfigDict(extra="forbid")
    action: Kind
    x: int | None = None  # pointer target; None = where the pointer is
    y: int | None = None
    to_x: int | None = None  # drag end
    to_y: int | None = None
    button: Button = "left"
    clicks: int = Field(1, ge=1, le=MAX_CLICKS)
    direction: Literal["up", "down", "left", "right"] = "down"  # scroll
    amount: int = Field(1, ge=1, le=MAX_SCROLL)
    text: str | None = Field(None, max_length=MAX_TYPE_CHARS)  # type
    keys: str | None = Field(None, max_length=200)  # key / key_down / key_up: "ctrl+s"
    seconds: float = Field(0.0, ge=0, le=60)  # wait


class ActionResult(BaseModel):
    action: str
    ok: bool = True


# ------------------------------------------------------------------------------------------- keys
_MODS = {"ctrl": "ctrl", "control": "ctrl", "ctrlleft": "Control_L", "ctrlright": "Control_R", "alt": "alt",
         "altleft": "Alt_L", "altright": "Alt_R", "option": "alt", "shift": "shift", "shiftleft": "Shift_L",
         "shiftright": "Shift_R", "super": "super", "win": "super", "winleft": "Super_L", "winright": "Super_R",
         "cmd": "super", "command": "super", "meta": "super"}
_NAMED = {"enter": "Return", "return": "Return", "esc": "Escape", "escape": "Escape", "tab": "Tab",
          "space": "space", "backspace": "BackSpace", "delete": "Delete", "del": "Delete", "insert": "Insert",
          "home": "Home", "end": "End", "pageup": "Prior", "pgup": "Prior", "page_up": "Prior", "prior": "Prior",
          "pagedown": "Next", "pgdn": "Next", "page_down": "Next", "next": "Next", "up": "Up", "down": "Down",
          "left": "Left", "right": "Right", "capslock": "Caps_Lock", "numlock": "Num_Lock",
          "scrolllock": "Scroll_Lock", "printscreen": "Print", "prtsc": "Print", "print": "Print",
          "pause": "Pause", "menu": "Menu", "apps": "Menu", "clear": "Clear",
          "volumeup": "XF86AudioRaiseVolume", "volumedown": "XF86AudioLowerVolume", "volumemute": "XF86AudioMute"}
_PUNCT = {"/": "slash", ".": "period", ",": "comma", ";": "semicolon", ":": "colon", "'": "apostrophe",
          '"': "quotedbl", "[": "bracketleft", "]": "bracketright", "{": "braceleft", "}": "braceright",
          "\\": "backslash", "|": "bar", "-": "minus", "_": "underscore", "=": "equal", "+": "plus",
          "`": "grave", "~": "asciitilde", "!": "exclam", "@": "at", "#": "numbersign", "$": "dollar",
          "%": "percent", "^": "asciicircum", "&": "ampersand", "*": "asterisk", "(": "parenleft",
          ")": "parenright", "<": "less", ">": "greater", "?": "question", " ": "space", "\n": "Return",
          "\t": "Tab"}
_KEYSYMS = set(_NAMED.values()) | set(_PUNCT.values()) | {"Control_L", "Control_R", "Alt_L", "Alt_R", "Shift_L",
                                                            "Shift_R", "Super_L", "Super_R", "Page_Up",
                                                            "Page_Down"}


def keysym(name: str) -> str:
    """One key's X keysym from a pyautogui / E2B / X name; unknown names are an InvalidArgument."""
    if len(name) == 1:
        if name.isascii() and name.isalnum():
            return name
        if name in _PUNCT:
            return _PUNCT[name]
        raise InvalidArgument(f"unknown key {name!r}")
    low = name.lower()
    if low in _MODS:
        return _MODS[low]
    if low in _NAMED:
        return _NAMED[low]
    if re.fullmatch(r"f([1-9]|1[0-9]|2[0-4])", low):
        return low.upper()
    if name in _KEYSYMS:
        return name
    raise InvalidArgument(f"unknown key {name!r} (names like ctrl, alt, shift, enter, esc, tab, f5, pagedown, "
                          f"a single character)")


def combo(keys: str | list[str]) -> str:
    """`"ctrl+s"` or `["ctrl", "s"]` -> xdotool's `ctrl+s`."""
    if isinstance(keys, str):
        if not keys:
            raise InvalidArgument("empty key")
        parts = [keys] if len(keys) == 1 else (keys[:-2].split("+") + ["+"] if keys.endswith("++")
                                                 else keys.split("+"))
    else:
        parts = list(keys)
    if not parts or any(not p for p in parts):
        raise InvalidArgument(f"malformed key combination {keys!r}")
    return "+".join(keysym(p) for p in parts)


# ------------------------------------------------------------------------------------------ argv
def check_point(x: int | None, y: int | None, size: tuple[int, int] | None, what: str = "") -> None:
    if (x is None) != (y is None):
        raise InvalidArgument(f"{what} needs both x and y (or neither, for the pointer's position)")
    if x is None or y is None or size is None:
        return
    w, h = size
    if not (0 <= x < w and 0 <= y < h):
        raise InvalidArgument(f"{what} at ({x}, {y}) is outside the {w}x{h} screen")


def xdotool_argv(a: DesktopAction, size: tuple[int, int] | None) -> list[str] | None:
    """The xdotool command for an action (None: nothing to run in the sandbox, e.g. wait)."""
    check_point(a.x, a.y, size, a.action)
    move = ["mousemove", str(a.x), str(a.y)] if a.x is not None else []
    btn = _BUTTON[a.button]
    k = a.action
    if k == "wait":
        return None
    if k in ("click", "double_click", "triple_click", "right_click", "middle_click"):
        n = {"double_click": 2, "triple_click": 3}.get(k, a.clicks)
        b = {"right_click": "3", "middle_click": "2"}.get(k, btn)
        return ["xdotool", *move, "click", "--repeat", str(n), "--delay", "60", b]
    if k == "move":
        if a.x is None:
            raise InvalidArgument("move needs x and y")
        return ["xdotool", *move]
    if k == "drag":
        check_point(a.to_x, a.to_y, size, "drag end")
        if a.to_x is None:
            raise InvalidArgument("drag needs an end point (to_x, to_y)")
        # intermediate motion and short pauses: toolkits only start a drag after seeing the pointer move
        return ["xdotool", *move, "mousedown", btn, "sleep", "0.05", "mousemove", str(a.to_x), str(a.to_y),
                "sleep", "0.05", "mouseup", btn]
    if k == "scroll":
        b = {"up": "4", "down": "5", "left": "6", "right": "7"}[a.direction]
        return ["xdotool", *move, "click", "--repeat", str(a.amount), "--delay", "20", b]
    if k in ("mouse_down", "mouse_up"):
        return ["xdotool", *move, k.replace("_", ""), btn]
    if k == "type":
        if a.text is None:
            raise InvalidArgument("type needs text")
        bad = [c for c in a.text if (ord(c) < 32 and c not in "\n\t") or ord(c) == 127]
        if bad:
            raise InvalidArgument(f"type: control character {bad[0]!r} cannot be typed (use key())")
        if not a.text.isascii():
            # the helper binds the characters to free keycodes before typing (docs/desktop.md)
            return [HELPER, "type", a.text]
        parts = re.split(r"(\n|\t)", a.text)
        if len(parts) == 1:
            return ["xdotool", "type", "--delay", "2", "--", a.text]
        # newlines and tabs as key presses (xdotool type drops them); the text stays out of the script:
        # it arrives as positional parameters, never parsed by the shell
        script, args = [], []
        for p in parts:
            if p in ("\n", "\t"):
                script.append(f"xdotool key {'Return' if p == chr(10) else 'Tab'} || exit")
            elif p:
                args.append(p)
                script.append(f'xdotool type --delay 2 -- "${len(args)}" || exit')
        return ["/bin/sh", "-c", "; ".join(script), "shoal-type", *args]
    if k in ("key", "key_down", "key_up"):
        if a.keys is None:
            raise InvalidArgument(f"{k} needs keys")
        # --delay 0: xdotool otherwise sleeps 12 ms after each key, most of a key press's round trip
        return ["xdotool", k.replace("_", ""), "--delay", "0", "--", combo(a.keys)]
    raise InvalidArgument(f"unknown action {k!r}")  # unreachable: the model's Literal


# ------------------------------------------------------------------------------------ pyautogui
# OSWorld's special actions: not input, the agent's verdict about the episode
SPECIAL = ("WAIT", "DONE", "FAIL")


def _lit(node: ast.expr, what: str) -> object:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise InvalidArgument(f"{what}: only literal arguments are accepted, got {ast.unparse(node)[:80]!r}") \
            from None


def _bind(fn: str, params: list[str], call: ast.Call) -> dict[str, object]:
    out: dict[str, object] = {}
    if len(call.args) > len(params):
        raise InvalidArgument(f"pyautogui.{fn}: too many arguments")
    for name, node in zip(params, call.args, strict=False):
        if isinstance(node, ast.Starred):
            raise InvalidArgument(f"pyautogui.{fn}: *args is not accepted")
        out[name] = _lit(node, f"pyautogui.{fn}")
    for kw in call.keywords:
        if kw.arg is None:
            raise InvalidArgument(f"pyautogui.{fn}: **kwargs is not accepted")
        out[kw.arg] = _lit(kw.value, f"pyautogui.{fn}")
    return out


def _xy(args: dict[str, object], fn: str) -> dict[str, object]:
    x, y = args.get("x"), args.get("y")
    if isinstance(x, (tuple, list)) and len(x) == 2 and y is None:  # click((x, y))
        x, y = x
    for v in (x, y):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise InvalidArgument(f"pyautogui.{fn}: coordinates must be numbers, got {v!r}")
    fx = None if x is None else round(float(x))  # type: ignore[arg-type]  # checked numeric just above
    fy = None if y is None else round(float(y))  # type: ignore[arg-type]  # checked numeric just above
    return {"x": fx, "y": fy}


def _mk(**kw: object) -> DesktopAction:
    from pydantic import ValidationError

    from ..host import describe

    try:
        return DesktopAction(**kw)
    except ValidationError as e:
        raise InvalidArgument(describe(e)) from None


def _pyautogui_call(fn: str, call: ast.Call) -> list[DesktopAction]:
    P = {"click": ["x", "y", "clicks", "interval", "button"], "doubleClick": ["x", "y", "interval", "button"],
         "tripleClick": ["x", "y", "interval", "button"], "rightClick": ["x", "y"], "middleClick": ["x", "y"],
         "moveTo": ["x", "y", "duration"], "dragTo": ["x", "y", "duration", "button"],
         "scroll": ["clicks", "x", "y"], "hscroll": ["clicks", "x", "y"], "vscroll": ["clicks", "x", "y"],
         "write": ["message", "interval"], "typewrite": ["message", "interval"], "press": ["keys", "presses"],
         "keyDown": ["key"], "keyUp": ["key"], "mouseDown": ["x", "y", "button"], "mouseUp": ["x", "y", "button"]}
    if fn == "hotkey":
        keys = [_lit(a, "pyautogui.hotkey") for a in call.args]
        if not keys or not all(isinstance(k, str) for k in keys):
            raise InvalidArgument("pyautogui.hotkey takes key names")
        return [_mk(action="key", keys="+".join(keysym(str(k)) for k in keys))]
    if fn not in P:
        raise InvalidArgument(f"pyautogui.{fn} is not in the action space ({', '.join(sorted(P) + ['hotkey'])})")
    a = _bind(fn, P[fn], call)
    btn = str(a.get("button", "left"))
    if fn in ("click", "doubleClick", "tripleClick", "rightClick", "middleClick"):
        kind = {"click": "click", "doubleClick": "double_click", "tripleClick": "triple_click",
                "rightClick": "right_click", "middleClick": "middle_click"}[fn]
        if kind == "click" and btn in ("right", "middle"):
            kind = f"{btn}_click"
        return [_mk(action=kind, clicks=a.get("clicks", 1), button=btn if btn in _BUTTON else "left",
                    **_xy(a, fn))]
    if fn == "moveTo":
        return [_mk(action="move", **_xy(a, fn))]
    if fn == "dragTo":
        end = _xy(a, fn)
        return [_mk(action="drag", to_x=end["x"], to_y=end["y"], button=btn)]
    if fn in ("scroll", "vscroll", "hscroll"):
        n = a.get("clicks")
        if isinstance(n, bool) or not isinstance(n, (int, float)):
            raise InvalidArgument(f"pyautogui.{fn} needs a number of clicks")
        horiz = fn == "hscroll"
        direction = ("right" if n > 0 else "left") if horiz else ("up" if n > 0 else "down")
        return [_mk(action="scroll", direction=direction, amount=max(1, min(MAX_SCROLL, abs(round(n)))),
                    **_xy(a, fn))] if n else []
    if fn in ("write", "typewrite"):
        msg = a.get("message")
        if isinstance(msg, list):  # typewrite(['a', 'enter']) presses keys
            return [_mk(action="key", keys=keysym(str(k))) for k in msg]
        if not isinstance(msg, str):
            raise InvalidArgument(f"pyautogui.{fn} needs a string")
        return [_mk(action="type", text=msg)]
    if fn == "press":
        given = a.get("keys")
        names: list[object] = list(given) if isinstance(given, list) else [given]
        presses = a.get("presses", 1)
        if not all(isinstance(k, str) for k in names) or not isinstance(presses, int) or not 1 <= presses <= 100:
            raise InvalidArgument("pyautogui.press takes key names and 1..100 presses")
        return [_mk(action="key", keys=keysym(str(k))) for _ in range(presses) for k in names]
    if fn in ("keyDown", "keyUp"):
        return [_mk(action="key_down" if fn == "keyDown" else "key_up", keys=keysym(str(a.get("key"))))]
    # mouseDown / mouseUp
    return [_mk(action="mouse_down" if fn == "mouseDown" else "mouse_up", button=btn, **_xy(a, fn))]


def parse_pyautogui(code: str, max_len: int = 20_000) -> list[DesktopAction | str]:
    """pyautogui code -> actions (and "WAIT" / "DONE" / "FAIL" as strings). Parsed, never run: any
    statement other than `pyautogui.<fn>(literals)`, `time.sleep(n)` or `import pyautogui|time`
    is an InvalidArgument naming it."""
    if not isinstance(code, str):
        raise InvalidArgument("an action string must be a str")
    if len(code) > max_len:
        raise InvalidArgument(f"action string of {len(code)} characters (at most {max_len})")
    stripped = code.strip()
    if stripped in SPECIAL:
        return [stripped]
    try:
        tree = ast.parse(stripped, mode="exec")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
        raise InvalidArgument(f"action string is not valid Python: {e}") from None
    out: list[DesktopAction | str] = []
    for stmt in tree.body:
        if isinstance(stmt, ast.Import) and all(a.name in ("pyautogui", "time") and a.asname is None
                                                for a in stmt.names):
            continue
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Name) and stmt.value.id in SPECIAL:
            out.append(stmt.value.id)
            continue
        call = stmt.value if isinstance(stmt, ast.Expr) else None
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                and isinstance(call.func.value, ast.Name) and call.func.value.id in ("pyautogui", "time")):
            raise InvalidArgument(f"line {stmt.lineno}: only pyautogui.<action>(...) calls are accepted, "
                                  f"got {ast.unparse(stmt)[:100]!r}")
        mod, fn = call.func.value.id, call.func.attr
        if mod == "time":
            if fn != "sleep" or len(call.args) != 1 or call.keywords:
                raise InvalidArgument(f"line {stmt.lineno}: only time.sleep(seconds) is accepted")
            secs = _lit(call.args[0], "time.sleep")
            if isinstance(secs, bool) or not isinstance(secs, (int, float)):
                raise InvalidArgument("time.sleep needs a number")
            out.append(_mk(action="wait", seconds=float(secs)))
            continue
        out.extend(_pyautogui_call(fn, call))
    return out
