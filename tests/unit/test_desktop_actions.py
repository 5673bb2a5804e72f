"""The desktop action space without a sandbox: pyautogui strings parsed (never run), key names,
xdotool argvs, and the framebuffer -> PNG encoder against hand-made XWD data."""
from __future__ import annotations

import struct
import zlib

import pytest

from shoal.core.errors import DesktopUnavailable, InvalidArgument
from shoal.desktop.actions import DesktopAction, combo, keysym, parse_pyautogui, xdotool_argv
from shoal.desktop.screen import png_size, xwd_to_png


def test_pyautogui_calls_become_actions():
    acts = parse_pyautogui("import pyautogui\nimport time\npyautogui.click(100, 200)\n"
                           "pyautogui.doubleClick(x=5, y=6)\npyautogui.click(7, 8, button='right')\n"
                           "pyautogui.typewrite('héllo')\npyautogui.hotkey('ctrl', 's')\ntime.sleep(0.5)\n"
                           "pyautogui.scroll(-3)\npyautogui.press('enter', presses=2)\npyautogui.dragTo(30, 40)\n"
                           "pyautogui.moveTo(1.6, 2.4)")
    got = [(a.action, a.x, a.y) if isinstance(a, DesktopAction) else a for a in acts]
    assert got == [("click", 100, 200), ("double_click", 5, 6), ("right_click", 7, 8), ("type", None, None),
                   ("key", None, None), ("wait", None, None), ("scroll", None, None), ("key", None, None),
                   ("key", None, None), ("drag", None, None), ("move", 2, 2)]
    assert acts[3].text == "héllo" and acts[4].keys == "ctrl+s" and acts[5].seconds == 0.5
    assert acts[6].direction == "down" and acts[6].amount == 3 and acts[7].keys == "Return"
    assert (acts[9].to_x, acts[9].to_y) == (30, 40)
    assert parse_pyautogui("DONE") == ["DONE"] and parse_pyautogui(" FAIL\n") == ["FAIL"]


@pytest.mark.parametrize("code", [
    "__import__('os').system('id')",
    "pyautogui.click(__import__('os').getpid(), 1)",
    "import os",
    "import pyautogui as p\np.click(1, 2)",
    "from pyautogui import click",
    "pyautogui.click(*[1, 2])",
    "pyautogui.click(**{'x': 1})",
    "pyautogui.screenshot().save('/etc/passwd')",
    "pyautogui.__dict__",
    "os.system('id')",
    "x = 1",
    "pyautogui.click(1, 2); exec('1')",
    "for i in range(10**9): pyautogui.click(1, 1)",
    "pyautogui.click(x=(1).__class__, y=1)",
    "pyautogui.write(open('/etc/passwd').read())",
    "time.sleep(__import__('os').getpid())",
    "pyautogui.click(True, 1)",
    "pyautogui.click(" * 200 + ")" * 200,
    "x" * 30_000,
])
def test_hostile_action_strings_are_rejected(code):
    with pytest.raises(InvalidArgument):
        parse_pyautogui(code)


def test_keys():
    assert combo("ctrl+s") == "ctrl+s"
    assert combo("ctrl+shift+T") == "ctrl+shift+T"
    assert combo(["cmd", "enter"]) == "super+Return"
    assert combo("ctrl++") == "ctrl+plus"
    assert keysym("pgdn") == "Next" and keysym("F12") == "F12" and keysym("/") == "slash"
    for bad in ("nosuchkey", "f99", "ctrl+", "é", "a;rm -rf /"):
        with pytest.raises(InvalidArgument):
            combo(bad)


def test_xdotool_argv_checks_and_quotes():
    size = (1280, 800)
    assert xdotool_argv(DesktopAction(action="click", x=1, y=2), size)[:4] == ["xdotool", "mousemove", "1", "2"]
    with pytest.raises(InvalidArgument, match="outside"):
        xdotool_argv(DesktopAction(action="click", x=1280, y=0), size)
    with pytest.raises(InvalidArgument, match="both"):
        xdotool_argv(DesktopAction(action="click", x=3), size)
    hostile = "$(touch /tmp/x); `id` ' \" \\"
    argv = xdotool_argv(DesktopAction(action="type", text=hostile), size)
    assert argv[-1] == hostile and argv[0] == "xdotool"  # one argv element, no shell
    argv = xdotool_argv(DesktopAction(action="type", text="a$(id)\nb"), size)
    assert argv[:2] == ["/bin/sh", "-c"] and "$(id)" not in argv[2] and argv[4:] == ["a$(id)", "b"]
    # no per-key sleep: xdotool's default 12 ms delay dominated a key press's round trip
    assert xdotool_argv(DesktopAction(action="key", keys="ctrl+s"), size) == \
        ["xdotool", "key", "--delay", "0", "--", "ctrl+s"]
    assert xdotool_argv(DesktopAction(action="key_down", keys="shift"), size)[:4] == \
        ["xdotool", "keydown", "--delay", "0"]
    with pytest.raises(ValueError):
        DesktopAction(action="type", text="x" * 5000)
    with pytest.raises(ValueError):
        DesktopAction(action="shell", text="id")  # type: ignore[arg-type]


def _xwd(w: int, h: int, pixels: bytes, name: bytes = b"Xvfb\0") -> bytes:
    header_size = 100 + len(name)
    fields = [header_size, 7, 2, 24, w, h, 0, 0, 32, 0, 32, 32, w * 4, 4, 0xFF0000, 0xFF00, 0xFF, 8, 256, 0,
              w, h, 0, 0, 0]
    return struct.pack(">25I", *fields) + name + pixels


def test_framebuffer_to_png():
    # 3x2: red, green, blue / white, black, grey, stored B G R X
    px = bytes([0, 0, 255, 0, 0, 255, 0, 0, 255, 0, 0, 0, 255, 255, 255, 0, 0, 0, 0, 0, 128, 128, 128, 0])
    png = xwd_to_png(_xwd(3, 2, px))
    assert png_size(png) == (3, 2)
    raw = zlib.decompress(png[png.index(b"IDAT") + 4:png.index(b"IEND") - 8])
    assert raw == (b"\x00" + bytes([255, 0, 0, 0, 255, 0, 0, 0, 255])
                   + b"\x00" + bytes([255, 255, 255, 0, 0, 0, 128, 128, 128]))
    assert png_size(xwd_to_png(_xwd(4, 4, bytes(64)), scale=0.5)) == (2, 2)
    with pytest.raises(DesktopUnavailable):
        xwd_to_png(_xwd(3, 2, px[:10]))  # truncated
    with pytest.raises(DesktopUnavailable):
        xwd_to_png(b"garbage")
