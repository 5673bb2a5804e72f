"""The browser DOM checker on a real Chromium in a desktop sandbox: it reads the page through the
DevTools port over the contract's `connect_port`; that port is reachable neither from another
sandbox (even one allowed to send to this sandbox's address) nor from the host's network. The
grader-forging attacks of docs/desktop.md ("Grader hardening") each fail: a forged page beside the
real one, a javascript: URL typed into the omnibox, script typed into the DevTools console, the
page file edited (and put back), Chromium restarted with another flag, an extension or LD_PRELOAD,
and a stand-in DevTools server on the port."""
from __future__ import annotations

import hashlib
import ipaddress
import socket
import subprocess
import time

import pytest

from shoal.envs.desktop import APPS, DESKTOP_IMAGE, desktop_layers, ensure_desktop
from shoal.envs.sandboxes import open_sandbox
from shoal.tasks.desktop.browser import (
    CHROMIUM_EXE,
    DEVTOOLS_PORT,
    BrowserUnavailable,
    dom_property,
    evaluate,
    targets,
    verify_chromium,
)
from shoal.tasks.desktop.task import BrowserDom, check

PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>Checker page</title></head><body>
<input id="name" autofocus><p id="status">waiting</p>
<script>document.getElementById('name').addEventListener('keydown', e => {
  if (e.key === 'Enter') document.getElementById('status').textContent = 'hello ' + e.target.value; });</script>
</body></html>"""
URL = "file:///root/page.html"

# agent code: python3 of the desktop base, standard library only
CDP_WRITE = r'''
import base64, json, os, socket, struct, sys, urllib.request
pages = [t for t in json.load(urllib.request.urlopen("http://127.0.0.1:9222/json/list")) if t["type"] == "page"]
path = pages[0]["webSocketDebuggerUrl"].split(":9222", 1)[1]
s = socket.create_connection(("127.0.0.1", 9222))
key = base64.b64encode(os.urandom(16)).decode()
s.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:9222\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
          f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode())
head = b""
while b"\r\n\r\n" not in head:
    head += s.recv(4096)
assert head.startswith(b"HTTP/1.1 101"), head
expr = "document.getElementById('status').textContent = " + json.dumps(sys.argv[1])
msg = json.dumps({"id": 1, "method": "Runtime.evaluate", "params": {"expression": expr}}).encode()
mask = os.urandom(4)
s.sendall(bytes([0x81, 0x80 | 126]) + struct.pack(">H", len(msg)) + mask
          + bytes(b ^ mask[i % 4] for i, b in enumerate(msg)))
print(s.recv(65536)[:200])
s.close()
'''


def _drop_guard(host, sb) -> None:
    """What a backend that never guarded the port leaves: no rule (removed from the host, by the test)."""
    pid = host.backend("container")._load(sb.id)["init_pid"]
    subprocess.run(["nsenter", f"--net=/proc/{pid}/ns/net", "nft", "delete", "table", "inet", "shoal_portguard"],
                   check=True)


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
            return dom_property(sb, selector, prop, URL)
        except BrowserUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _wait_status(sb, want: str, seconds: float = 10) -> str | None:
    deadline = time.monotonic() + seconds
    while (v := dom_property(sb, "#status", "textContent", URL)) != want and time.monotonic() < deadline:
        time.sleep(0.2)
    return v


def test_the_checker_reads_the_dom(browser_sb):
    sb = browser_sb
    assert _dom(sb, "#status") == "waiting"
    assert not check(sb, BrowserDom(type="browser_dom", selector="#status", text="hello", url=URL))
    sb.desktop.type("shoal")
    sb.desktop.key("enter")
    assert _wait_status(sb, "hello shoal") == "hello shoal"
    assert dom_property(sb, "#name", "value", URL) == "shoal"
    assert check(sb, BrowserDom(type="browser_dom", selector="#status", equals="hello shoal", url=URL))
    assert check(sb, BrowserDom(type="browser_dom", selector="#name", prop="value", text="sho", url=URL + "#top"))
    assert dom_property(sb, "#missing", "textContent", URL) is None
    assert not check(sb, BrowserDom(type="browser_dom", selector="#missing", text="", url=URL))
    # a selector is data, never code: quotes in it stay inside the string (an invalid selector throws)
    with pytest.raises(BrowserUnavailable, match="threw"):
        dom_property(sb, "x\"); document.title = 'pwned'; (\"", "textContent", URL)
    assert evaluate(sb, "document.title", URL) == "Checker page"
    with pytest.raises(BrowserUnavailable, match="no browser page"):
        dom_property(sb, "#status", "textContent", "https://elsewhere/page.html")
    with pytest.raises(BrowserUnavailable, match="threw"):
        evaluate(sb, "(() => { throw new Error('boom') })()", URL)
    # another port: not guarded (only 9222 is the grader's alone), so refused before anything is read
    with pytest.raises(BrowserUnavailable, match="not guarded"):
        dom_property(sb, "#status", "textContent", URL, port=9333)


def test_a_javascript_url_typed_into_the_omnibox_does_not_run(browser_sb):
    """Attack (b): the agent types javascript:... into the address bar to rewrite the graded page's
    DOM. The browser layer's managed policy blocks javascript: (and data:) URLs."""
    sb = browser_sb
    assert sb.files.exists("/etc/chromium/policies/managed/shoal.json")
    before = _wait_status(sb, "hello shoal")
    sb.desktop.activate("Checker page")
    sb.desktop.key("ctrl+l")
    sb.desktop.type("javascript:void(document.getElementById('status').textContent='forged by js')")
    sb.desktop.key("enter")
    time.sleep(2)
    sb.desktop.key("escape")
    assert dom_property(sb, "#status", "textContent", URL) == before != "forged by js"
    assert evaluate(sb, "location.href", URL) == URL  # still the page, loaded (file: pages are not blocked)


def test_a_forged_page_beside_the_real_one_is_not_graded(browser_sb):
    """Attack (a): the agent opens its own page showing the expected text, in a tab beside the task's
    page (a data: URL, or a file whose URL contains the page's name). The check reads only the
    target whose URL is the task's page."""
    sb = browser_sb
    forged = '<!doctype html><title>Checker page</title><p id="status">forged</p><input id="name" value="forged">'
    sb.commands.run(["mkdir", "-p", "/tmp/x/root"], check=True)
    sb.files.write("/tmp/x/root/page.html", forged)
    sb.desktop.launch("browser", ["file:///tmp/x/root/page.html?u=file:///root/page.html"])
    sb.desktop.launch("browser", ["data:text/html,<title>Checker page</title><p id=status>forged</p>"])
    deadline = time.monotonic() + 20
    while not any("/tmp/x/" in t["url"] for t in targets(sb)) and time.monotonic() < deadline:
        time.sleep(0.3)
    urls = [t["url"] for t in targets(sb)]
    assert URL in urls and any(u.startswith("file:///tmp/x/root/page.html") for u in urls), urls
    assert not check(sb, BrowserDom(type="browser_dom", selector="#status", equals="forged", url=URL))
    assert dom_property(sb, "#status", "textContent", URL) == "hello shoal"
    assert not check(sb, BrowserDom(type="browser_dom", selector="#name", prop="value", text="forged", url=URL))
    # the forged pages themselves cannot be named: data: is refused, and the look-alike file is another page
    with pytest.raises(BrowserUnavailable, match="not a file/http/https"):
        evaluate(sb, "1", "data:text/html,<title>Checker page</title><p id=status>forged</p>")
    assert evaluate(sb, "document.title", URL) == "Checker page"


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
    assert dom_property(sb, "#name", "id", URL) == "name"


@pytest.mark.slow
def test_agent_code_cannot_write_the_graded_dom_through_devtools(host, browser_sb):
    """Review F3: any process in the sandbox spoke DevTools to Chromium on its loopback and wrote the
    graded DOM (same document, same file, same Chromium: every check above passed). The port is now
    guarded from the host: the sandbox's connection is reset, the checker's (marked) one reads."""
    sb = browser_sb
    before = _dom(sb, "#status")
    sb.files.write("/tmp/cdp_write.py", CDP_WRITE)
    r = sb.commands.run(["python3", "/tmp/cdp_write.py", "Welcome, Ada Lovelace"], timeout=30)
    assert r.exit_code != 0 and "Connection" in r.stderr, (r.stdout, r.stderr[-500:])  # refused / reset
    assert _dom(sb, "#status") == before != "Welcome, Ada Lovelace"
    # without the guard the checker fails closed rather than grade a DOM agent code could have written
    _drop_guard(host, sb)
    try:
        with pytest.raises(BrowserUnavailable, match="not guarded"):
            dom_property(sb, "#status", "textContent", URL)
    finally:
        sb.guard_port(DEVTOOLS_PORT)
    assert _dom(sb, "#status") == before


def test_the_devtools_window_does_not_open(browser_sb):
    """Attack (d): the agent opens Chromium's DevTools (ctrl+shift+j) and types script into its console
    to rewrite the graded page. The managed policy blocks devtools:// (the window), while the remote
    debugging port the checker uses stays open."""
    sb = browser_sb
    before = _dom(sb, "#status")
    sb.desktop.activate("Checker page")
    sb.desktop.key("ctrl+shift+j")
    time.sleep(2)
    sb.desktop.type("document.getElementById('status').textContent='forged by console'")
    sb.desktop.key("enter")
    time.sleep(1)
    sb.desktop.key("escape")
    assert dom_property(sb, "#status", "textContent", URL) == before != "forged by console"
    assert not any("devtools" in t["url"] for t in targets(sb))


def _reload(sb, t0: float | None) -> None:
    """F5 on the page, and wait until the checker reads a document loaded after `t0` (its time
    origin; None: whenever it reads one again). The forged tabs of an earlier test share the
    window: the task's tab is brought to the front first (DevTools' /json/activate)."""
    [tab] = [t for t in targets(sb) if t["url"] == URL]
    with sb.connect_port(DEVTOOLS_PORT) as c:
        c.sendall(f"GET /json/activate/{tab['id']} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        assert c.recv(4096).startswith(b"HTTP/1.1 200"), "DevTools did not activate the tab"
    sb.desktop.activate("Checker page")
    sb.desktop.key("F5")
    deadline = time.monotonic() + 20
    while True:
        try:  # refused while the file is newer than the document shown
            if evaluate(sb, "performance.timeOrigin", URL) != t0 and evaluate(sb, "document.readyState", URL) \
                    == "complete":
                return
        except BrowserUnavailable:
            pass
        assert time.monotonic() < deadline, "the page did not reload"
        time.sleep(0.3)


def test_an_edited_page_file_is_not_graded(browser_sb):
    """Attack (e): the agent edits the task's page file to show what a check wants and reloads it
    (then, to hide it, puts the file back). A check grades a file:// page only as the task's setup
    wrote it (page_sha256) and only while the file is unchanged since Chromium loaded it (its ctime,
    read from the host, against the document's time origin)."""
    sb = browser_sb
    digest = hashlib.sha256(PAGE.encode()).hexdigest()
    want = BrowserDom(type="browser_dom", selector="#status", equals="forged", url=URL, page_sha256=digest)
    real = BrowserDom(type="browser_dom", selector="#name", prop="id", equals="name", url=URL, page_sha256=digest)
    assert check(sb, real) and not check(sb, want)
    t0 = evaluate(sb, "performance.timeOrigin", URL)
    sb.files.write("/root/page.html", PAGE.replace(">waiting<", ">forged<"))
    _reload(sb, t0)
    assert _dom(sb, "#status") == "forged"  # the browser shows the forged file...
    assert not check(sb, want)  # ...which is not the task's page
    with pytest.raises(BrowserUnavailable, match="not the task's page"):
        dom_property(sb, "#status", "textContent", URL, page_sha256=digest)
    sb.files.write("/root/page.html", PAGE)  # put back, the forged document still shown
    assert not check(sb, want)
    with pytest.raises(BrowserUnavailable, match="changed after the browser loaded it"):
        dom_property(sb, "#status", "textContent", URL, page_sha256=digest)
    # an editable page (a task that edits it on purpose): graded as the file now is, after a reload
    assert not check(sb, BrowserDom(type="browser_dom", selector="#name", prop="id", equals="name", url=URL,
                                    page_editable=True))
    _reload(sb, None)
    assert check(sb, real) and not check(sb, want)
    assert _dom(sb, "#status") == "waiting"


def _wait_listen(sb, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not any(s.state == "listen" for s in sb.port_sockets(DEVTOOLS_PORT)):
        assert time.monotonic() < deadline, "Chromium did not listen"
        time.sleep(0.3)


def _relaunch(sb, args: list[str], env: str = "", dialog: str = "") -> None:
    """The agent kills Chromium and starts the layer's own binary again, its own way (and answers
    the start-up `dialog`, if one shows)."""
    _kill_chromium(sb)
    deadline = time.monotonic() + 10
    while sb.port_sockets(DEVTOOLS_PORT) and time.monotonic() < deadline:
        time.sleep(0.2)
    if env:  # by hand, as the layer's launcher does, with this environment
        flags = " ".join(a for a in LAYER_ARGV if a.startswith("--"))
        sb.commands.run(["sh", "-c", f"{env} setsid -f /usr/bin/env ACCESSIBILITY_ENABLED=1 /usr/bin/chromium "
                                     f"{flags} {URL} >/dev/null 2>&1"], check=True)
    else:  # the launch action, with the agent's arguments
        sb.desktop.launch("browser", [*args, URL])
    if dialog:
        sb.desktop.wait_for_window(dialog, timeout=60)
        sb.desktop.activate(dialog)
        sb.desktop.key("enter")
    _wait_listen(sb)
    sb.desktop.wait_for_window("Checker page", timeout=60)


LAYER_ARGV = APPS["browser"].argv


def test_chromium_restarted_another_way_is_not_trusted(browser_sb):
    """Attack (f): the agent restarts the layer's own Chromium binary with another flag (here
    --remote-allow-origins=*, which lets a page script drive DevTools), with an extension of its own
    dropped where Debian's wrapper loads extensions from, or with a library of its own in
    LD_PRELOAD. The checker reads the browser process's command line and the files it maps as code
    from the host: each is refused; the layer's own way of starting it is graded again."""
    sb = browser_sb
    real = BrowserDom(type="browser_dom", selector="#name", prop="id", equals="name", url=URL)
    assert check(sb, real)
    _relaunch(sb, ["--remote-allow-origins=*"])
    assert not check(sb, real)
    with pytest.raises(BrowserUnavailable, match="remote-allow-origins"):
        verify_chromium(sb)
    sb.commands.run(["mkdir", "-p", "/usr/share/chromium/extensions/x"], check=True)
    sb.files.write("/usr/share/chromium/extensions/x/manifest.json",
                   '{"manifest_version": 3, "name": "x", "version": "1", "content_scripts": [{"matches": '
                   '["<all_urls>"], "js": ["forge.js"]}]}')
    sb.files.write("/usr/share/chromium/extensions/x/forge.js",
                   "document.getElementById('status').textContent = 'forged';")
    # the policy refuses unpacked extensions (a dialog says so); the checker refuses the flag anyway
    _relaunch(sb, [], dialog="Error Loading Extension")
    assert not check(sb, real)
    with pytest.raises(BrowserUnavailable, match="load-extension=/usr/share/chromium/extensions/x"):
        verify_chromium(sb)
    sb.commands.run(["rm", "-rf", "/usr/share/chromium/extensions/x"], check=True)
    # a library of the agent's own (here a copy of libm) preloaded into the layer's Chromium
    sb.commands.run(["cp", "/usr/lib/x86_64-linux-gnu/libm.so.6", "/tmp/forge.so"], check=True)
    _relaunch(sb, [], env="LD_PRELOAD=/tmp/forge.so")
    assert not check(sb, real)
    with pytest.raises(BrowserUnavailable, match="code from a file written in the sandbox"):
        verify_chromium(sb)
    _relaunch(sb, [])
    assert check(sb, real)


FAKE_DEVTOOLS = r"""
import base64, hashlib, json, socket, sys
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", 9222)); srv.listen(8); print("listening", flush=True)
while True:
    c, _ = srv.accept()
    req = b""
    while b"\r\n\r\n" not in req:
        req += c.recv(4096)
    if b"/json/list" in req:
        body = json.dumps([{"type": "page", "url": "file:///root/page.html", "id": "X",
                            "webSocketDebuggerUrl": "ws://127.0.0.1:9222/devtools/page/X"}]).encode()
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body); c.close(); continue
    key = [l.split(b":", 1)[1].strip() for l in req.split(b"\r\n") if l.lower().startswith(b"sec-websocket-key")][0]
    acc = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
    c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
              b"Sec-WebSocket-Accept: " + acc + b"\r\n\r\n")
    c.recv(65536)
    msg = json.dumps({"id": 1, "result": {"result": {"type": "string", "value": "forged"}}}).encode()
    c.sendall(bytes([0x81, len(msg)]) + msg)
    c.recv(10)
    c.close()
"""


def _kill_chromium(sb) -> None:
    kill = ("import os, signal\n"
            "for p in os.listdir('/proc'):\n"
            "    try:\n"
            f"        if p.isdigit() and os.readlink(f'/proc/{{p}}/exe') == {CHROMIUM_EXE!r}: os.kill(int(p), 9)\n"
            "    except OSError: pass\n")
    sb.commands.run(["python3", "-c", kill], timeout=30, check=True)


def _serve_fake(sb, argv: list[str], env: dict[str, str] | None = None):
    sb.files.write("/tmp/fake_devtools.py", FAKE_DEVTOOLS)
    proc = sb.commands.start(argv + ["/tmp/fake_devtools.py"], env=env)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if any(s.state == "listen" for s in sb.port_sockets(DEVTOOLS_PORT)):
            return proc
        time.sleep(0.2)
    raise AssertionError(f"the fake DevTools server did not start: {proc.output()}")


def test_a_stand_in_devtools_server_is_not_trusted(browser_sb):
    """Attack (c), last in the module (it kills the browser): the agent kills Chromium and serves its
    own /json/list and WebSocket on 9222 answering every evaluate with the text a check wants. The checker
    asks the backend, from the host, who holds the port: not the browser layer's Chromium binary (a
    Python server, or a copy of Python put at Chromium's own path), so the check fails."""
    sb = browser_sb
    real = sb.port_sockets(DEVTOOLS_PORT)
    assert any(s.state == "listen" for s in real)
    assert all(e == CHROMIUM_EXE for s in real for e in s.exes) and all(all(s.exes_from_image) for s in real), real
    verify_chromium(sb)
    assert check(sb, BrowserDom(type="browser_dom", selector="#name", prop="id", equals="name", url=URL))
    want = BrowserDom(type="browser_dom", selector="#status", equals="forged", url=URL)
    assert not check(sb, want)  # the real page never says it
    _kill_chromium(sb)
    deadline = time.monotonic() + 10
    while sb.port_sockets(DEVTOOLS_PORT) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not check(sb, want)  # nothing serves the port
    proc = _serve_fake(sb, ["python3"])
    try:
        assert not check(sb, want)  # the stand-in answers "forged" to every evaluate
        with pytest.raises(BrowserUnavailable, match="python3.*not the browser layer's Chromium"):
            verify_chromium(sb)
    finally:
        proc.kill()
    deadline = time.monotonic() + 10
    while sb.port_sockets(DEVTOOLS_PORT) and time.monotonic() < deadline:
        time.sleep(0.2)
    # the stand-in at Chromium's own path: a file written in the sandbox, not the layer's
    r = sb.commands.run(f"cp \"$(readlink -f /usr/bin/python3)\" {CHROMIUM_EXE}", timeout=30)
    assert r.exit_code == 0, r.stderr
    proc = _serve_fake(sb, [CHROMIUM_EXE], env={"PYTHONHOME": "/usr"})
    try:
        socks = sb.port_sockets(DEVTOOLS_PORT)
        assert [e for s in socks for e in s.exes] == [CHROMIUM_EXE] and not socks[0].exes_from_image[0], socks
        assert not check(sb, want)
        with pytest.raises(BrowserUnavailable, match="written in the sandbox"):
            verify_chromium(sb)
    finally:
        proc.kill()
