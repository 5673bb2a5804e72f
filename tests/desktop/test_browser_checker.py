"""The browser DOM checker on a real Chromium in a desktop sandbox: it reads the page through the
DevTools port over the contract's `connect_port`; that port is reachable neither from another
sandbox (even one allowed to send to this sandbox's address) nor from the host's network."""
from __future__ import annotations

import ipaddress
import socket
import time

import pytest

from shoal.envs.desktop import DESKTOP_IMAGE, desktop_layers, ensure_desktop
from shoal.envs.sandboxes import open_sandbox
from shoal.tasks.desktop.browser import DEVTOOLS_PORT, BrowserUnavailable, dom_property, evaluate
from shoal.tasks.desktop.task import BrowserDom, check

PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>Checker page</title></head><body>
<input id="name" autofocus><p id="status">waiting</p>
<script>document.getElementById('name').addEventListener('keydown', e => {
  if (e.key === 'Enter') document.getElementById('status').textContent = 'hello ' + e.target.value; });</script>
</body></html>"""


@pytest.fixture(scope="module")
def browser_sb(host, desktop_images):
    ensure_desktop(host, apps=("browser",))  # Debian's chromium: the largest app layer (cached per host)
    sb = open_sandbox(host, DESKTOP_IMAGE, desktop_layers(["browser"]), memory_mb=2048, disk_mb=256)
    try:
        sb.desktop.start()
        sb.files.write("/root/page.html", PAGE)
        sb.desktop.launch("browser", ["file:///root/page.html"])
        sb.desktop.wait_for_window("Checker page", timeout=60)
        yield sb
    finally:
        sb.kill()


def _dom(sb, selector, prop="textContent"):
    deadline = time.monotonic() + 20
    while True:  # DevTools answers a moment after the window maps
        try:
            return dom_property(sb, selector, prop)
        except BrowserUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_the_checker_reads_the_dom(browser_sb):
    sb = browser_sb
    assert _dom(sb, "#status") == "waiting"
    assert not check(sb, BrowserDom(type="browser_dom", selector="#status", text="hello"))
    sb.desktop.type("shoal")
    sb.desktop.key("enter")
    deadline = time.monotonic() + 10
    while dom_property(sb, "#status") != "hello shoal" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert dom_property(sb, "#status") == "hello shoal" and dom_property(sb, "#name", "value") == "shoal"
    assert check(sb, BrowserDom(type="browser_dom", selector="#status", equals="hello shoal"))
    assert check(sb, BrowserDom(type="browser_dom", selector="#name", prop="value", text="sho", url="page.html"))
    assert dom_property(sb, "#missing") is None
    assert not check(sb, BrowserDom(type="browser_dom", selector="#missing", text=""))
    # a selector is data, never code: quotes in it stay inside the string (an invalid selector throws)
    with pytest.raises(BrowserUnavailable, match="threw"):
        dom_property(sb, "x\"); document.title = 'pwned'; (\"")
    assert evaluate(sb, "document.title") == "Checker page"
    with pytest.raises(BrowserUnavailable, match="no browser page"):
        dom_property(sb, "#status", url_contains="https://elsewhere/")
    with pytest.raises(BrowserUnavailable, match="threw"):
        evaluate(sb, "(() => { throw new Error('boom') })()")
    # nothing listening: a clear error, and a failed check rather than an exception
    with pytest.raises(BrowserUnavailable, match="no DevTools endpoint"):
        dom_property(sb, "#status", port=9333)


def test_devtools_is_reachable_only_through_the_checker(host, browser_sb):
    sb = browser_sb
    assert _dom(sb, "#name", "id") == "name"  # the checker's path works meanwhile
    # give the browser's sandbox an address, and a second sandbox egress to exactly that address
    sb.set_network(allow=["192.0.2.1/32"])
    net = ipaddress.ip_network(sb.get_network().subnet)
    _, sb_ip = list(net.hosts())  # the host side, the sandbox's eth0
    other = open_sandbox(host, DESKTOP_IMAGE, desktop_layers([]), memory_mb=256, disk_mb=64)
    try:
        other.set_network(allow=[f"{sb_ip}/32"])
        probe = ("import socket, sys\n"
                 "for addr in sys.argv[1:]:\n"
                 "    s = socket.socket(); s.settimeout(3)\n"
                 "    try:\n"
                 f"        s.connect((addr, {DEVTOOLS_PORT})); print(addr, 'OPEN')\n"
                 "    except OSError as e:\n"
                 "        print(addr, 'closed', type(e).__name__)\n")
        r = other.commands.run(["python3", "-c", probe, str(sb_ip), "127.0.0.1"], timeout=30)
        assert r.exit_code == 0, r.stderr
        assert "OPEN" not in r.stdout and r.stdout.count("closed") == 2, r.stdout
        # nor from the host's own network stack (only connect_port enters the sandbox's namespace)
        with pytest.raises(OSError):
            socket.create_connection((str(sb_ip), DEVTOOLS_PORT), timeout=3).close()
    finally:
        other.kill()
    assert dom_property(sb, "#name", "id") == "name"
