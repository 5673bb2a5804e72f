"""sb.desktop on a real desktop sandbox: Xvfb + openbox + mousepad from Debian packages, built by
recipes and composed at creation. Screens are decoded and checked pixel by pixel; text typed into
the editor is read back through AT-SPI."""
from __future__ import annotations

import struct
import zlib

import pytest

from shoal.core.errors import CommandTimeout, DesktopUnavailable, InvalidArgument
from shoal.desktop.actions import MAX_TYPE_CHARS


def decode(png: bytes) -> tuple[int, int, bytes]:
    """(width, height, RGB rows) of the 8-bit RGB, filter-0 PNGs the screenshot encoder writes."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    w, h, depth, ctype = struct.unpack(">IIBB", png[16:26])
    assert (depth, ctype) == (8, 2)
    pos, idat = 8, b""
    while pos < len(png):
        (n,) = struct.unpack(">I", png[pos:pos + 4])
        if png[pos + 4:pos + 8] == b"IDAT":
            idat += png[pos + 8:pos + 8 + n]
        pos += 12 + n
    raw = zlib.decompress(idat)
    assert len(raw) == h * (1 + 3 * w)
    return w, h, b"".join(raw[r * (1 + 3 * w) + 1:(r + 1) * (1 + 3 * w)] for r in range(h))


# the agent kills its own X server; the command returns once the server is dead (a zombie or gone),
# not merely signalled: SIGKILL takes effect asynchronously
KILL_X = ("p=$(cat /tmp/.shoal-desktop/xvfb.pid); kill -9 $p; for i in $(seq 500); do "
          "grep -qs '^State:.[ZX]' /proc/$p/status || [ ! -e /proc/$p ] && exit 0; sleep 0.01; done; exit 1")


def pixel(img: tuple[int, int, bytes], x: int, y: int) -> tuple[int, ...]:
    w, _, rgb = img
    return tuple(rgb[(y * w + x) * 3:(y * w + x) * 3 + 3])


def test_screenshot_is_the_screen(desk):
    img = decode(desk.desktop.screenshot())
    assert img[:2] == (1280, 800)
    assert pixel(img, 5, 5) == (0x2E, 0x34, 0x40)  # the root window's colour from desktop.conf
    assert decode(desk.desktop.screenshot(scale=0.5))[:2] == (640, 400)
    with pytest.raises(InvalidArgument):
        desk.desktop.screenshot(scale=1.5)


def test_pointer_actions_and_their_limits(desk):
    d = desk.desktop
    d.move(321, 123)
    assert d.get_cursor_position() == (321, 123)
    d.run_pyautogui("import pyautogui\npyautogui.moveTo(400, 300)\ntime.sleep(0.01)")
    assert d.get_cursor_position() == (400, 300)
    d.move_mouse(10, 20)  # E2B's name
    assert d.get_cursor_position() == (10, 20)
    with pytest.raises(InvalidArgument, match="outside the 1280x800 screen"):
        d.click(1280, 5)
    with pytest.raises(InvalidArgument, match="outside"):
        d.act({"action": "click", "x": -1, "y": 5})
    with pytest.raises(InvalidArgument, match="unknown key"):
        d.key("ctrl+nosuchkey")


def test_editor_typing_windows_and_accessibility(desk):
    d = desk.desktop
    pid = d.launch("editor")
    assert pid > 0
    win = d.wait_for_window("Mousepad", timeout=30)
    assert win.app == "mousepad" and win.width > 0
    d.click(win.x + win.width // 2, win.y + win.height // 2)
    text = "héllo ✓ wörld\nzweite Zeile"
    d.type(text)
    d.key("ctrl+Home")
    d.press(["shift", "End"])  # E2B: keys pressed together
    focused = [w for w in d.windows() if w.focused]
    assert focused and focused[0].app == "mousepad"
    assert focused[0].title.startswith("*") or "*" in focused[0].title  # modified

    def texts(n, out):
        if n.text is not None:
            out.append(n.text)
        for c in n.children:
            texts(c, out)
        return out

    tree = d.accessibility_tree(depth=20)
    assert any(a.name == "mousepad" for a in tree.children)
    assert text in texts(tree, [])
    shallow = d.accessibility_tree(depth=1)
    assert all(not c.children for c in shallow.children)


def test_bad_input(desk):
    d = desk.desktop
    with pytest.raises(InvalidArgument, match="at most|4096"):
        d.type("x" * (MAX_TYPE_CHARS + 1))
    with pytest.raises(InvalidArgument, match="control character"):
        d.type("a\x1bb")
    with pytest.raises(InvalidArgument, match="unknown app"):
        d.launch("nosuchapp")
    with pytest.raises(InvalidArgument):
        d.launch("../../bin/sh")
    with pytest.raises(CommandTimeout):
        d.wait_for_window("no such window title", timeout=0.3)


def test_action_strings_are_parsed_never_run(desk, tmp_path):
    marker = tmp_path / "pwned"
    for code in (f"__import__('os').system('touch {marker}')",
                 f"pyautogui.click(__import__('os').system('touch {marker}'), 1)",
                 f"import os\nos.system('touch {marker}')",
                 f"pyautogui.write(open('{marker}', 'w').write('x'))",
                 "exec('print(1)')", "pyautogui.click(*[1, 2])", "pyautogui.__class__.__bases__"):
        with pytest.raises(InvalidArgument):
            desk.desktop.run_pyautogui(code)
    assert not marker.exists()
    # nothing ran in the sandbox either
    assert desk.commands.run(f"test -e {marker}").exit_code != 0
    assert [r.action for r in desk.desktop.run_pyautogui("DONE")] == ["DONE"]


def test_screenshot_after_the_x_server_was_killed(host, desktop_images):
    from shoal.envs.sandboxes import open_sandbox

    image, layers = desktop_images
    with open_sandbox(host, image, layers, memory_mb=512, disk_mb=128) as sb:
        sb.desktop.start()
        sb.desktop.screenshot()
        # the agent kills its own X server: the framebuffer file stays behind, stale
        sb.commands.run(KILL_X, check=True)
        assert sb.files.exists("/tmp/.shoal-desktop/fb/Xvfb_screen0")
        with pytest.raises(DesktopUnavailable):
            sb.desktop.screenshot()
        with pytest.raises(DesktopUnavailable):
            sb.desktop.windows()
        with pytest.raises(DesktopUnavailable):
            sb.desktop.click(5, 5)
        sb.desktop.start()  # comes back
        assert decode(sb.desktop.screenshot())[:2] == (1280, 800)


def test_through_shoald(daemon, desktop_images):
    """Screenshot as image/png and actions as JSON over the daemon's API (and the SDK over it)."""
    import httpx

    from shoal import Sandbox

    image, layers = desktop_images
    with Sandbox.create(image, layers=layers, url=daemon["url"], memory_mb=512, disk_mb=128) as sb:
        prefix = f"/v1/sandboxes/{sb.id}/desktop"
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(daemon["sock"])), base_url="http://shoald") as c:
            r = c.post(prefix + "/start")
            assert r.status_code == 200 and r.json() == {"width": 1280, "height": 800}
            r = c.get(prefix + "/screenshot", params={"scale": 0.25})
            assert r.headers["content-type"] == "image/png" and decode(r.content)[:2] == (320, 200)
            r = c.post(prefix + "/actions", json={"action": "move", "x": 77, "y": 66})
            assert r.status_code == 200 and r.json()["ok"]
            r = c.post(prefix + "/actions", json={"action": "click", "x": 5000, "y": 1})
            assert r.status_code == 400 and r.json()["error"]["type"] == "InvalidArgument"
            r = c.post(prefix + "/pyautogui", json={"code": "import subprocess"})
            assert r.status_code == 400
            r = c.get(prefix + "/windows")
            assert r.status_code == 200 and isinstance(r.json(), list)
        assert sb.desktop.get_cursor_position() == (77, 66)
        assert decode(sb.desktop.screenshot())[:2] == (1280, 800)  # the SDK over the http backend
        sb.desktop.click(100, 100)
        sb.commands.run(KILL_X, check=True)
        with pytest.raises(DesktopUnavailable):
            sb.desktop.screenshot()
