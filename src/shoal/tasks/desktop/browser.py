"""The browser's DOM for subgoal checks: Chromium's DevTools protocol over the contract's `connect_port`.

Chromium in a desktop sandbox listens for DevTools on 127.0.0.1:9222 of the sandbox's own network
namespace (envs/desktop.py). Nothing outside the sandbox can reach that address except Shoal's
checker, which asks the backend for a stream to it (`SandboxBackend.connect_port`, the same path
as shoald's port tunnel): no veth, no published port, so another sandbox has no route to it.

Over that stream: `GET /json/list` (the page targets), then a WebSocket to the chosen page and
one `Runtime.evaluate`. The WebSocket client is the minimum RFC 6455 needs (masked text frames
out, unfragmented or fragmented text frames in, pings answered); the page is the agent's, so
every size and count read from the wire is bounded.

The page is named exactly (`page_key`): a check grades the target whose URL is the task's page
(scheme, host and path; query and fragment ignored), never a data:, javascript:, blob: or about:
target the agent opened beside it; and the server on the port is the browser layer's Chromium,
started the layer's way (`verify_chromium`, asked of the backend before and after each read: the
image's binary, its flags, no library from outside the image), not a stand-in or a relaunch of the agent's. The
read runs in an isolated world of the page; a file:// page is graded only while its file is
unchanged since the load (and, pinned by the task, holds the task's bytes), and only while the
layer's managed policy is in force (docs/desktop.md, "Grader hardening")."""
from __future__ import annotations

import base64
import hashlib
import json
import os
import socket
import struct
import time
from typing import Any
from urllib.parse import unquote, urlsplit

from ...core.errors import SandboxError, ShoalError

DEVTOOLS_PORT = 9222
CHROMIUM_EXE = "/usr/lib/chromium/chromium"  # Debian's chromium: what its processes' /proc/<pid>/exe names
MAX_BODY = 4 << 20  # a target list or an evaluate answer larger than this is refused


PAGE_SCHEMES = ("file", "http", "https")  # a graded page is one of these; data:, javascript:, blob:, about: never


class BrowserUnavailable(SandboxError):
    """The DevTools endpoint did not answer as expected (no browser, no page, a malformed answer)."""


def page_key(url: str) -> tuple[str, str, str] | None:
    """(scheme, host, path) of a page URL, the identity a check compares; None for a URL that is
    not a file/http/https page (data:, javascript:, blob:, about:, chrome:, view-source: ...)."""
    try:
        u = urlsplit(url.strip())
    except ValueError:
        return None
    scheme = u.scheme.lower()
    if scheme not in PAGE_SCHEMES or not u.path.startswith("/"):
        return None
    return scheme, u.netloc.lower(), unquote(u.path)


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(min(65536, n - len(buf)))
        if not chunk:
            raise BrowserUnavailable("DevTools closed the connection")
        buf += chunk
    return bytes(buf)


def _read_head(s: socket.socket) -> tuple[str, bytes]:
    """An HTTP response head (status line + headers) and whatever body bytes came with it."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(4096)
        if not chunk:
            raise BrowserUnavailable("DevTools closed the connection before answering")
        buf += chunk
        if len(buf) > 65536:
            raise BrowserUnavailable("DevTools answered with an oversized header")
    head, _, rest = buf.partition(b"\r\n\r\n")
    return head.decode("latin-1"), rest


def verify_chromium(sb: Any, port: int = DEVTOOLS_PORT) -> None:
    """Raise BrowserUnavailable unless every socket on `port` inside the sandbox that a process holds
    (the listener, and the connections it accepted) is held only by the image's own Chromium binary,
    and one of them listens. The backend answers from the host (`port_sockets`), so nothing the agent
    runs in the sandbox takes part in the answer."""
    for attempt in range(3):
        try:
            socks = sb.port_sockets(port)
        except ShoalError as e:
            raise BrowserUnavailable(f"cannot tell who serves the sandbox's port {port}: {e}") from None
        # a connection that just ended can be seen unheld for a moment: look again before refusing
        if attempt < 2 and any(not s.pids and s.state != "listen" for s in socks):
            time.sleep(0.05)
            continue
        break
    if not any(s.state == "listen" for s in socks):
        raise BrowserUnavailable(f"nothing listens on the sandbox's port {port}")
    for s in socks:
        if not s.pids:
            raise BrowserUnavailable(f"a socket on port {port} is held by no process of the sandbox")
        for exe, own in zip(s.exes, s.exes_from_image, strict=True):
            if exe != CHROMIUM_EXE or not own:
                raise BrowserUnavailable(f"port {port} is served by {exe[:200]!r}"
                                         f"{'' if own else ' (a program written in the sandbox)'}, "
                                         "not the browser layer's Chromium")
        if len(s.cmdlines) != len(s.pids) or len(s.code_from_image) != len(s.pids):
            raise BrowserUnavailable("the backend did not say how the browser on the port was started")
        for argv, own_code in zip(s.cmdlines, s.code_from_image, strict=True):
            if not own_code:
                raise BrowserUnavailable("the browser on the port runs code from a file written in the sandbox "
                                         "(LD_PRELOAD, LD_LIBRARY_PATH or a replaced library)")
            if (bad := flags_problem(argv)) is not None:
                raise BrowserUnavailable(f"the browser on the port was not started as the browser layer starts it: "
                                         f"{bad}")


def _layer_flags() -> tuple[frozenset[str], frozenset[str]]:
    """(every flag the layer's Chromium may run with, the flags it must run with). The layer's own
    launcher flags, and what Debian's /usr/bin/chromium wrapper adds from /etc/chromium.d (an empty
    --load-extension: no extension directory in the image)."""
    from ...envs.desktop import APPS

    required = frozenset(a for a in APPS["browser"].argv if a.startswith("--"))
    return required | DEBIAN_WRAPPER_FLAGS, required


# what the image's /etc/chromium.d/* put in CHROMIUM_FLAGS (Debian bookworm's chromium); Chromium
# shows its command line with an empty value as the bare flag
DEBIAN_WRAPPER_FLAGS = frozenset({
    "--show-component-extension-options", "--enable-gpu-rasterization", "--no-default-browser-check",
    "--disable-pings", "--media-router=0", "--disable-dev-shm-usage", "--enable-remote-extensions",
    "--load-extension", "--load-extension="})


def flags_problem(argv: list[str]) -> str | None:
    """None if a Chromium browser process's command line is the browser layer's (its program, only
    the allowed flags with their exact values, every required one, and page URLs); else what is wrong.
    Chromium rewrites its argv as one space-joined string: both forms are read."""
    words = [w for a in argv for w in a.split(" ") if w]
    if not words or words[0] != CHROMIUM_EXE:
        return f"program {words[0][:200] if words else ''!r}"
    allowed, required = _layer_flags()
    seen: set[str] = set()
    for w in words[1:]:
        if w.startswith("-"):
            if w not in allowed:
                return f"flag {w[:200]!r}"
            seen.add(w)
        elif page_key(w) is None:
            return f"argument {w[:200]!r} (not a page URL)"
    if missing := sorted(required - seen):
        return f"without {', '.join(missing)}"
    return None


def _connect(sb: Any, port: int, timeout: float) -> socket.socket:
    try:
        s = sb.connect_port(port, timeout=timeout)
    except ShoalError as e:
        raise BrowserUnavailable(f"no DevTools endpoint on the sandbox's 127.0.0.1:{port}: {e}") from None
    s.settimeout(timeout)
    return s


def targets(sb: Any, port: int = DEVTOOLS_PORT, timeout: float = 10.0) -> list[dict]:
    """DevTools' page targets (id, url, title, webSocketDebuggerUrl)."""
    s = _connect(sb, port, timeout)
    try:
        # DevTools refuses a Host that is not an IP or localhost (DNS rebinding guard)
        s.sendall(f"GET /json/list HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
        head, body = _read_head(s)
        if not head.startswith("HTTP/1.1 200"):
            raise BrowserUnavailable(f"DevTools /json/list answered {head.splitlines()[0]!r}")
        # DevTools keeps the connection open whatever the request says: read Content-Length bytes
        length = next((int(v) for k, _, v in (ln.partition(":") for ln in head.split("\r\n")[1:])
                       if k.strip().lower() == "content-length" and v.strip().isdigit()), None)
        if length is None or length > MAX_BODY:
            raise BrowserUnavailable(f"DevTools' target list has no usable length ({length})")
        if len(body) < length:
            body += _recv_exact(s, length - len(body))
    except OSError as e:
        raise BrowserUnavailable(f"DevTools /json/list: {e}") from None
    finally:
        s.close()
    try:
        items = json.loads(body)
    except ValueError:
        raise BrowserUnavailable("DevTools' target list is not JSON") from None
    if not isinstance(items, list):
        raise BrowserUnavailable("DevTools' target list is not a list")
    return [t for t in items if isinstance(t, dict) and t.get("type") == "page"]


def _ws_send(s: socket.socket, text: str) -> None:
    data = text.encode()
    mask = os.urandom(4)
    n = len(data)
    head = bytes([0x81]) + (bytes([0x80 | n]) if n < 126 else
                            bytes([0x80 | 126]) + struct.pack(">H", n) if n < 65536 else
                            bytes([0x80 | 127]) + struct.pack(">Q", n))
    s.sendall(head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data)))


def _ws_frame(s: socket.socket, pending: bytearray) -> tuple[int, bool, bytes]:
    def take(n: int) -> bytes:
        if len(pending) < n:
            pending.extend(_recv_exact(s, n - len(pending)))
        out = bytes(pending[:n])
        del pending[:n]
        return out

    b0, b1 = take(2)
    n = b1 & 0x7F
    if n == 126:
        n = struct.unpack(">H", take(2))[0]
    elif n == 127:
        n = struct.unpack(">Q", take(8))[0]
    if n > MAX_BODY:
        raise BrowserUnavailable("DevTools sent an oversized frame")
    mask = take(4) if b1 & 0x80 else b""
    data = take(n)
    if mask:
        data = bytes(b ^ mask[i % 4] for i, b in enumerate(data))
    return b0 & 0x0F, bool(b0 & 0x80), data


def _ws_messages(s: socket.socket, pending: bytearray, deadline: float):
    """Text messages as they arrive (fragments joined; pings answered; a close ends it)."""
    msg = bytearray()
    while time.monotonic() < deadline:
        op, fin, data = _ws_frame(s, pending)
        if op == 0x9:  # ping -> pong (masked, as a client must)
            mask = os.urandom(4)
            s.sendall(bytes([0x8A, 0x80 | len(data[:125])]) + mask
                      + bytes(b ^ mask[i % 4] for i, b in enumerate(data[:125])))
            continue
        if op == 0x8:
            raise BrowserUnavailable("DevTools closed the WebSocket")
        if op in (0x1, 0x0):
            msg += data
            if len(msg) > MAX_BODY:
                raise BrowserUnavailable("DevTools sent an oversized message")
            if fin:
                yield bytes(msg)
                msg = bytearray()
    raise BrowserUnavailable("DevTools did not answer in time")


def evaluate(sb: Any, expression: str, url: str, port: int = DEVTOOLS_PORT, timeout: float = 10.0,
             page_sha256: str | None = None) -> Any:
    """The value of a JavaScript expression in the first page target whose URL is `url` (compared
    by `page_key`), evaluated in an isolated world of its main frame (the page's own scripts cannot
    redefine what it reads); JSON-serialisable values come back by value.

    A file:// page is read only if its file has not changed since Chromium loaded the document (the
    file's ctime, which nothing in the sandbox can set back, against the document's time origin),
    and, with `page_sha256`, only if the file holds those bytes: a page file the agent edited,
    reloaded and put back, or left edited, is not graded."""
    want = page_key(url)
    if want is None:
        raise BrowserUnavailable(f"{url[:200]!r} is not a file/http/https page URL")
    verify_chromium(sb, port)
    return _evaluate(sb, expression, want, url, port, timeout, page_sha256)


def _call(s: socket.socket, pending: bytearray, msg_id: int, method: str, params: dict, deadline: float) -> dict:
    """One DevTools command on the page's WebSocket; its `result` (events before it are skipped)."""
    _ws_send(s, json.dumps({"id": msg_id, "method": method, "params": params}))
    for raw in _ws_messages(s, pending, deadline):
        try:
            msg = json.loads(raw)
        except ValueError:
            raise BrowserUnavailable("DevTools sent a message that is not JSON") from None
        if not isinstance(msg, dict) or msg.get("id") != msg_id:
            continue  # an event, not our answer
        if "error" in msg:
            raise BrowserUnavailable(f"{method}: {str(msg['error'])[:300]}")
        result = msg.get("result", {})
        if not isinstance(result, dict):
            raise BrowserUnavailable(f"{method}: a malformed answer")
        return result
    raise BrowserUnavailable("DevTools did not answer")  # unreachable: the generator raises


def _value(result: dict) -> Any:
    if result.get("exceptionDetails"):
        raise BrowserUnavailable(f"the expression threw: {str(result['exceptionDetails'])[:300]}")
    return result.get("result", {}).get("value")


def _evaluate(sb: Any, expression: str, want: tuple[str, str, str], url: str, port: int, timeout: float,
              page_sha256: str | None = None) -> Any:
    pages = [t for t in targets(sb, port, timeout) if page_key(str(t.get("url", ""))) == want]
    if not pages:
        raise BrowserUnavailable(f"no browser page at {url[:200]!r}")
    ws_url = str(pages[0].get("webSocketDebuggerUrl", ""))
    path = ws_url.split(f":{port}", 1)[-1] if ws_url.startswith("ws://") else ""
    if not path.startswith("/devtools/page/"):
        raise BrowserUnavailable(f"unexpected DevTools WebSocket URL {ws_url[:200]!r}")
    s = _connect(sb, port, timeout)
    try:
        key = base64.b64encode(os.urandom(16)).decode()
        s.sendall((f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
                   f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
        head, rest = _read_head(s)
        if not head.startswith("HTTP/1.1 101"):
            raise BrowserUnavailable(f"DevTools refused the WebSocket: {head.splitlines()[0]!r}")
        pending, deadline = bytearray(rest), time.monotonic() + timeout
        frame = _call(s, pending, 1, "Page.getFrameTree", {}, deadline).get("frameTree", {}).get("frame", {})
        if not isinstance(frame, dict) or page_key(str(frame.get("url", ""))) != want:
            raise BrowserUnavailable(f"the page's main frame is not at {url[:200]!r}")
        world = _call(s, pending, 2, "Page.createIsolatedWorld",
                      {"frameId": frame.get("id"), "worldName": "shoal-checker"}, deadline)
        ctx = world.get("executionContextId")
        if not isinstance(ctx, int):
            raise BrowserUnavailable("DevTools gave no isolated world")
        value = _value(_call(s, pending, 3, "Runtime.evaluate",
                             {"expression": expression, "returnByValue": True, "contextId": ctx}, deadline))
        # after the read: the document that answered is the one whose files are checked
        loaded = _value(_call(s, pending, 4, "Runtime.evaluate",
                              {"expression": "performance.timeOrigin", "returnByValue": True, "contextId": ctx},
                              deadline))
        if not isinstance(loaded, int | float):
            raise BrowserUnavailable("the page's load time is unknown")
        _check_policy(sb, loaded / 1000)
        if want[0] == "file":
            _check_page_file(sb, want[2], loaded / 1000, page_sha256)
        # again, our connection still open: the socket that answered it is Chromium's too (a
        # stand-in swapped in after the first look holds that accepted socket)
        verify_chromium(sb, port)
        return value
    except OSError as e:
        raise BrowserUnavailable(f"DevTools WebSocket: {e}") from None
    finally:
        s.close()


def _check_policy(sb: Any, loaded: float) -> None:
    """The browser layer's managed policy (no javascript:/data: URLs, no DevTools window, no
    extensions) is in force and was not lifted since the document loaded: its file holds the layer's
    text and has not changed since then (Chromium rereads a changed policy at once, so a policy
    deleted, used and put back is a change)."""
    from ...envs.desktop import CHROMIUM_POLICY, CHROMIUM_POLICY_JSON

    try:
        entry = sb.files.stat(CHROMIUM_POLICY)
        text = sb.files.read_bytes(CHROMIUM_POLICY, 65536)
    except ShoalError as e:
        raise BrowserUnavailable(f"the browser's managed policy: {e}") from None
    if entry.type != "file" or text != (CHROMIUM_POLICY_JSON + "\n").encode():
        raise BrowserUnavailable("the browser's managed policy is not the browser layer's")
    if entry.ctime is None or entry.ctime > loaded:
        raise BrowserUnavailable("the browser's managed policy changed after the page loaded")


def _check_page_file(sb: Any, path: str, loaded: float, sha256: str | None) -> None:
    """The page file, read from the host: a regular file not changed since `loaded` (seconds since the
    epoch) and, given a digest, holding those bytes."""
    try:
        entry = sb.files.stat(path)
        data = sb.files.read_bytes(path, MAX_BODY) if sha256 is not None else b""
    except ShoalError as e:
        raise BrowserUnavailable(f"the page file {path[:200]!r}: {e}") from None
    if entry.type != "file" or entry.ctime is None:
        raise BrowserUnavailable(f"the page file {path[:200]!r} is not a plain file whose change time is known")
    if entry.ctime > loaded:
        raise BrowserUnavailable(f"the page file {path[:200]!r} changed after the browser loaded it")
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise BrowserUnavailable(f"the page file {path[:200]!r} is not the task's page")


def dom_property(sb: Any, selector: str, prop: str, url: str, port: int = DEVTOOLS_PORT,
                 timeout: float = 10.0, page_sha256: str | None = None) -> str | None:
    """String(element[prop]) of the first element matching a CSS selector, or None if none matches."""
    expr = (f"(() => {{ const e = document.querySelector({json.dumps(selector)}); "
            f"return e === null ? null : String(e[{json.dumps(prop)}]); }})()")
    v = evaluate(sb, expr, url, port, timeout, page_sha256)
    return None if v is None else str(v)
