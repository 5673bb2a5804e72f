"""Real HTTP servers for the lazy-loading tests: a static file server with Range support (Python's
http.server has none) that counts what it serves, and a fault proxy in front of it that the tests
stop, slow down, or make flip bytes."""
from __future__ import annotations

import base64
import http.client
import os
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


class RangeServer:
    """Serves files under `directory` at http://127.0.0.1:<port>/<path> (GET/HEAD, single Range, S3
    ListObjectsV2 on `/?list-type=2&prefix=`). `requests` lists (method, path, range header); `bytes_sent`
    counts body bytes. `auth`: "user:password" required as basic auth when set."""

    def __init__(self, directory: Path, auth: str | None = None):
        self.dir = Path(directory)
        self.auth = auth
        self.requests: list[tuple[str, str, str]] = []
        self.bytes_sent = 0
        self.lock = threading.Lock()
        outer = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_HEAD(self):
                self._serve(head=True)

            def do_GET(self):
                self._serve(head=False)

            def _serve(self, head: bool):
                rng = self.headers.get("Range", "")
                with outer.lock:
                    outer.requests.append((self.command, self.path, rng))
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
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def gets(self, path_part: str = "") -> list[tuple[str, str, str]]:
        with self.lock:
            return [r for r in self.requests if r[0] == "GET" and path_part in r[1]]

    def reset(self) -> None:
        with self.lock:
            self.requests.clear()
            self.bytes_sent = 0

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class FaultProxy:
    """An HTTP/1.0 reverse proxy to `upstream` (one connection per request, so stopping it cuts
    clients off at once). Modes: `delay` seconds before answering, `corrupt` (flip one byte of each
    body). `stop()` closes the port (connections refused); `start()` opens it again on the same port."""

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.delay = 0.0
        self.corrupt = False
        self.port = 0
        self.server: _Server | None = None
        self.start()
        self.url = f"http://127.0.0.1:{self.port}/"

    def start(self) -> None:
        outer = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *a):
                pass

            def do_HEAD(self):
                self._forward()

            def do_GET(self):
                self._forward()

            def _forward(self):
                conn = http.client.HTTPConnection("127.0.0.1", outer.upstream_port, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() in ("range", "authorization")}
                conn.request(self.command, self.path, headers=headers)
                r = conn.getresponse()
                body = r.read()
                conn.close()
                if outer.delay:
                    time.sleep(outer.delay)
                if outer.corrupt and body:
                    body = bytes([body[0] ^ 0xFF]) + body[1:]
                self.send_response(r.status)
                for k, v in r.getheaders():
                    if k.lower() not in ("connection", "keep-alive", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", r.getheader("Content-Length") or str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body if self.command == "GET" else b"")
                except OSError:
                    pass

        self.server = _Server(("127.0.0.1", self.port), H)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
