"""The client side of shoald's port tunnel (server/routes/ports.py): one HTTP/1.1 exchange whose chunked
request body and response body carry a TCP connection to a port inside a sandbox.

httpx sends a whole request body before it reads the response, so the exchange is spoken here with
h11 over a socket of our own (unix, tcp or tls). The caller gets one end of a socketpair; a relay
thread moves bytes between it and the exchange. One thread does both directions (select), so a TLS
socket is never read and written from two threads at once.
"""
from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import ssl
import threading
from urllib.parse import urlsplit

import h11

from ...core import errors as E

CHUNK = 64 << 10


def _dial(url: str, ssl_context: ssl.SSLContext | None, timeout: float) -> tuple[socket.socket, str, str]:
    """A connected socket to the daemon at `url`, its Host header and its path prefix."""
    if url.startswith("unix://"):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout)
        try:
            s.connect(url[len("unix://"):])
        except OSError:
            s.close()
            raise
        return s, "shoald", ""
    u = urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise E.InvalidArgument(f"unsupported shoald URL {url!r}")
    port = u.port or (443 if u.scheme == "https" else 80)
    raw = socket.create_connection((u.hostname, port), timeout=timeout)
    if u.scheme == "https":
        ca = os.environ.get("SHOAL_CA_CERT")  # as HttpBackend: a private CA, else the system store
        ctx = ssl_context or ssl.create_default_context(cafile=ca)
        try:
            raw = ctx.wrap_socket(raw, server_hostname=u.hostname)
        except BaseException:
            raw.close()
            raise
    return raw, u.netloc, u.path.rstrip("/")


def open_tunnel(url: str, path: str, headers: dict[str, str], ssl_context: ssl.SSLContext | None,
                timeout: float) -> socket.socket:
    """POST `path` on the daemon at `url` as a tunnel; the returned socket is the caller's end."""
    try:
        sock, host, prefix = _dial(url, ssl_context, timeout)
    except OSError as e:
        err = E.SandboxError(f"shoald at {url} is unreachable: {e}")
        err.retryable = True
        raise err from e
    conn = h11.Connection(h11.CLIENT)
    try:
        sock.sendall(conn.send(h11.Request(method="POST", target=prefix + path, headers=[
            ("Host", host), ("Transfer-Encoding", "chunked"), *headers.items()])) or b"")
        resp = _response(sock, conn)
        if resp.status_code != 200:
            raise _error(sock, conn, resp.status_code)
        sock.settimeout(None)
    except BaseException:
        sock.close()
        raise
    mine, theirs = socket.socketpair()
    threading.Thread(target=_relay, args=(sock, conn, theirs), name="port-tunnel", daemon=True).start()
    return mine


def _next(sock: socket.socket, conn: h11.Connection) -> object:
    while True:
        ev = conn.next_event()
        if ev is not h11.NEED_DATA:
            return ev
        conn.receive_data(sock.recv(CHUNK))


def _response(sock: socket.socket, conn: h11.Connection) -> h11.Response:
    while True:
        ev = _next(sock, conn)
        if isinstance(ev, h11.Response):
            return ev
        if isinstance(ev, h11.ConnectionClosed):
            raise E.SandboxError("shoald closed the port tunnel before answering")


def _error(sock: socket.socket, conn: h11.Connection, status: int) -> Exception:
    """The daemon's error body as its typed error."""
    body = b""
    with contextlib.suppress(OSError, h11.RemoteProtocolError):
        while len(body) < (1 << 20):
            ev = _next(sock, conn)
            if isinstance(ev, h11.Data):
                body += ev.data
            else:
                break
    try:
        err = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        err = None
    if not isinstance(err, dict):
        return E.ShoalError(f"HTTP {status} from shoald: {body[:500]!r}")
    return E.from_wire(err, f"HTTP {status}")


def _deliver(conn: h11.Connection, local: socket.socket) -> bool:
    """Hand what h11 has parsed to the caller; False once the response (the port's side) ended."""
    while (ev := conn.next_event()) is not h11.NEED_DATA:
        if isinstance(ev, h11.Data):
            local.sendall(ev.data)
        elif isinstance(ev, (h11.EndOfMessage, h11.ConnectionClosed)):
            return False
    return True


def _readable(socks: list[socket.socket], timeout: float) -> list[socket.socket]:
    """The sockets of `socks` with data (or an end) to read: poll, not select, whose FD_SETSIZE of
    1024 a dense host's relays pass."""
    p = select.poll()
    for s in socks:
        p.register(s, select.POLLIN)
    fds = {fd for fd, _ in p.poll(timeout * 1000)}
    return [s for s in socks if s.fileno() in fds]


def _relay(sock: socket.socket, conn: h11.Connection, local: socket.socket) -> None:
    up_open = True
    try:
        # the first bytes from the port may have come with the response's head: already parsed
        down_open = _deliver(conn, local)
        while down_open:
            pending = isinstance(sock, ssl.SSLSocket) and sock.pending() > 0
            ready = [sock] if pending else _readable([sock, local] if up_open else [sock], 5.0)
            if local in ready:
                data = local.recv(CHUNK)
                if data:
                    sock.sendall(conn.send(h11.Data(data=data)) or b"")
                else:  # the caller shut its writing side (or closed): end the request body
                    sock.sendall(conn.send(h11.EndOfMessage()) or b"")
                    up_open = False
            if sock in ready:
                data = sock.recv(CHUNK)
                conn.receive_data(data)
                down_open = _deliver(conn, local) and bool(data)
    except (OSError, h11.ProtocolError):
        pass
    finally:  # what was sent to `local` stays readable by the caller after this close
        sock.close()
        local.close()
