"""Real HTTP servers for the lazy-loading and registry tests (and bench/lazy.py): a static file server
with Range support (Python's http.server has none) that counts what it serves, and a fault proxy in
front of it (or of a registry) that the tests stop, slow down, or make flip bytes."""
from __future__ import annotations

import base64
import http.client
import os
import re
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


class _Handler(BaseHTTPRequestHandler):
    """Quiet; GET and HEAD both go to `answer` (each server below defines it)."""

    def log_message(self, *a):
        pass

    def do_HEAD(self):
        self.answer()

    def do_GET(self):
        self.answer()

    def answer(self) -> None:
        raise NotImplementedError


class RangeServer:
    """Serves files under `directory` at http://127.0.0.1:<port>/<path> (GET/HEAD, single Range, S3
    ListObjectsV2 on `/?list-type=2&prefix=`). `requests` lists (method, path, range header); `bytes_sent`
    counts body bytes. `auth`: "user:password" required as basic auth when set. `authorizations`
    lists (method, path, Authorization header or None) of every request (the redirect tests: storage
    must never see the registry's credentials). `tls=(cert, key)` serves HTTPS; `challenge`: answer
    every request but `/token` 401 with this WWW-Authenticate header (a redirect target asking for
    credentials)."""

    def __init__(self, directory: Path, auth: str | None = None, tls: tuple[Path, Path] | None = None,
                 challenge: str | None = None):
        self.dir = Path(directory)
        self.auth, self.challenge = auth, challenge
        self.requests: list[tuple[str, str, str]] = []
        self.authorizations: list[tuple[str, str, str | None]] = []
        self.bytes_sent = 0
        self.lock = threading.Lock()
        outer = self

        class H(_Handler):
            protocol_version = "HTTP/1.1"

            def answer(self):
                self._serve(head=self.command == "HEAD")

            def _serve(self, head: bool):
                rng = self.headers.get("Range", "")
                with outer.lock:
                    outer.requests.append((self.command, self.path, rng))
                    outer.authorizations.append((self.command, self.path, self.headers.get("Authorization")))
                if outer.challenge and not self.path.startswith("/token"):
                    return self._send(401, b"", head, extra={"WWW-Authenticate": outer.challenge})
                if outer.auth and self.headers.get("Authorization") != "Basic " + base64.b64encode(
                        outer.auth.encode()).decode():
                    return self._send(401, b"")
                path, _, query = self.path.partition("?")
                if path == "/" and "list-type=2" in query:
                    prefix = re.search(r"prefix=([^&]*)", query)
                    want = unquote(prefix.group(1)) if prefix else ""
                    keys = sorted(str(p.relative_to(outer.dir)) for p in outer.dir.rglob("*") if p.is_file())
                    body = ("<?xml version=\"1.0\"?><ListBucketResult>" + "".join(
                        f"<Contents><Key>{k}</Key></Contents>" for k in keys if k.startswith(want))
                        + "</ListBucketResult>").encode()
                    return self._send(200, body, head)
                f = outer.dir / path.lstrip("/")
                if not f.is_file():
                    return self._send(404, b"", head)
                size = f.stat().st_size
                m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng)
                if not m:
                    return self._send(200, b"" if head else f.read_bytes(), head, size=size)
                start, end = int(m.group(1)), int(m.group(2) or size - 1)
                if start >= size:
                    return self._send(416, b"", head)
                end = min(end, size - 1)
                with open(f, "rb") as fh:
                    body = b"" if head else os.pread(fh.fileno(), end - start + 1, start)
                self._send(206, body, head, size=end - start + 1,
                           extra={"Content-Range": f"bytes {start}-{end}/{size}"})

            def _send(self, code, body, head=False, size=None, extra=None):
                self.send_response(code)
                self.send_header("Content-Length", str(len(body) if size is None else size))
                self.send_header("Accept-Ranges", "bytes")
                for k, v in (extra or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                if not head and body:
                    self.wfile.write(body)
                    with outer.lock:
                        outer.bytes_sent += len(body)

        self.server = _Server(("127.0.0.1", 0), H)
        if tls is not None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(str(tls[0]), str(tls[1]))
            self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def gets(self, path_part: str = "") -> list[tuple[str, str, str]]:
        with self.lock:
            return [r for r in self.requests if r[0] == "GET" and path_part in r[1]]

    def reset(self) -> None:
        with self.lock:
            self.requests.clear()
            self.authorizations.clear()
            self.bytes_sent = 0

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "upgrade", "host",
        "content-length"}


class FaultProxy:
    """An HTTP/1.0 reverse proxy to `upstream` (one connection per request, so stopping it cuts
    clients off at once), for GET and HEAD. Modes: `delay` seconds before answering, `corrupt` (flip
    one byte of each body whose path contains `corrupt_match`). `stop()` closes the port
    (connections refused); `start()` opens it again on the same port. An upstream that does not
    answer gets the client a 502. `requests` records (method, path, Range header) of each request.

    TLS: `tls=(cert, key)` serves HTTPS; `upstream_ca` makes it talk HTTPS to the upstream (a
    registry with a private CA): the proxy sees plaintext, so flipped bytes reach the client's
    digest check instead of breaking TLS."""

    def __init__(self, upstream_port: int, tls: tuple[Path, Path] | None = None,
                 upstream_ca: Path | None = None, corrupt_match: str = ""):
        self.upstream_port = upstream_port
        self.tls, self.upstream_ca, self.corrupt_match = tls, upstream_ca, corrupt_match
        self.delay = 0.0
        self.corrupt = False
        self.port = 0
        self.requests: list[tuple[str, str, str]] = []
        self.lock = threading.Lock()
        self.server: _Server | None = None
        self.start()
        self.addr = f"127.0.0.1:{self.port}"
        self.url = f"{'https' if tls else 'http'}://{self.addr}/"

    def _upstream(self) -> http.client.HTTPConnection:
        if self.upstream_ca is not None:
            ctx = ssl.create_default_context(cafile=str(self.upstream_ca))
            return http.client.HTTPSConnection("127.0.0.1", self.upstream_port, timeout=30, context=ctx)
        return http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=30)

    def start(self) -> None:
        outer = self

        class H(_Handler):
            protocol_version = "HTTP/1.0"

            def answer(self):
                with outer.lock:
                    outer.requests.append((self.command, self.path, self.headers.get("Range", "")))
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                try:
                    conn = outer._upstream()
                    conn.request(self.command, self.path, headers=headers)
                    r = conn.getresponse()
                    body = r.read()
                    status, rheaders, length = r.status, r.getheaders(), r.getheader("Content-Length")
                    conn.close()
                except OSError:
                    status, rheaders, body, length = 502, [], b"upstream down", None
                if outer.delay:
                    time.sleep(outer.delay)
                if outer.corrupt and body and outer.corrupt_match in self.path:
                    body = bytes([body[0] ^ 0xFF]) + body[1:]
                self.send_response(status)
                for k, v in rheaders:
                    if k.lower() not in _HOP:
                        self.send_header(k, v)
                self.send_header("Content-Length", length or str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body if self.command == "GET" else b"")
                except OSError:
                    pass

        self.server = _Server(("127.0.0.1", self.port), H)
        if self.tls is not None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(str(self.tls[0]), str(self.tls[1]))
            self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def gets(self, path_part: str = "") -> list[tuple[str, str, str]]:
        with self.lock:
            return [r for r in self.requests if r[0] == "GET" and path_part in r[1]]

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


class Redirector:
    """Answers every GET/HEAD with `status` (307) to `location` + the request's path (or `location`
    as it is when `keep_path` is False), recording (method, path, Authorization header or None)."""

    def __init__(self, location: str, status: int = 307, keep_path: bool = True):
        self.location, self.status, self.keep_path = location.rstrip("/") if keep_path else location, status, keep_path
        self.authorizations: list[tuple[str, str, str | None]] = []
        outer = self

        class H(_Handler):
            protocol_version = "HTTP/1.1"

            def answer(self):
                outer.authorizations.append((self.command, self.path, self.headers.get("Authorization")))
                self.send_response(outer.status)
                self.send_header("Location", outer.location + self.path if outer.keep_path else outer.location)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = _Server(("127.0.0.1", 0), H)
        self.port = self.server.server_address[1]
        self.addr = f"127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
