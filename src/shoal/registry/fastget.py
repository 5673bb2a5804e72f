"""Range GETs of blob bytes on kept-alive `http.client` connections (the lazy loader's miss path).

Why not httpx for these: a lazy cold start without a prefetch list is a chain of ~60 small Range
GETs one after another, and on the 2-core benchmark host httpx spends ~1 ms of client CPU per
request against ~0.3 ms for `http.client` (docs/lazy-loading.md, round 5). Only the plain case goes
here: a 200/206 answer with a Content-Length. Anything else (an auth challenge, a redirect, an error
status, chunked encoding) is handed back (None) to `RegistryClient.request`, which runs the auth
flows, follows redirects and turns statuses into typed errors as before; a timeout or a refused
connection is `OriginUnavailable` at once (the same deadline per socket operation as httpx's).

One connection per thread (the lazy daemon's FUSE workers each hold one; `http.client` connections
are not thread-safe). A kept-alive connection the server closed meanwhile is retried once on a new
one; a fresh connection's failure is reported."""
from __future__ import annotations

import http.client
import io
import os
import socket
import ssl
import threading
import time
from functools import partial
from urllib.parse import urlsplit

from ..core.errors import OriginUnavailable


def enabled() -> bool:
    """SHOAL_REGISTRY_FAST_GET=0 turns it off (A/B). Read per client: a lazy daemon forked by the
    zygote has imported this module under the zygote's environment, not its requester's."""
    return os.environ.get("SHOAL_REGISTRY_FAST_GET", "1") != "0"


class _DeadlineReader(io.RawIOBase):
    """A response's socket reads, each given only what is left of the request's deadline: the socket
    timeout alone bounds one recv, so an origin that drip-feeds a byte at a time would never end."""

    def __init__(self, sock: socket.socket, deadline: float):
        # through a socket file of its own: the connection may close its socket object while this
        # response is read (Connection: close), and the file keeps the descriptor open until closed
        self.sock, self.raw, self.deadline = sock, sock.makefile("rb", buffering=0), deadline

    def readable(self) -> bool:
        return True

    def readinto(self, b: memoryview) -> int:  # type: ignore[override]  # RawIOBase's buffer type
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request's deadline passed")
        self.sock.settimeout(left)
        return self.raw.readinto(b) or 0

    def close(self) -> None:
        if not self.closed:
            self.raw.close()
        super().close()


class _DeadlineResponse(http.client.HTTPResponse):
    def __init__(self, sock: socket.socket, *args: object, deadline: float, **kw: object):
        super().__init__(sock, *args, **kw)  # type: ignore[arg-type]  # http.client's own keywords
        self.fp.close()  # the plain makefile(): its reads would wait a full timeout each
        self.fp = io.BufferedReader(_DeadlineReader(sock, deadline))


_STALE = (http.client.RemoteDisconnected, http.client.BadStatusLine, ConnectionResetError, BrokenPipeError)


class FastRangeGet:
    """GET `path` with a Range header on this thread's connection to `base` ("http[s]://host[:port]")."""

    def __init__(self, base: str, registry: str, timeout: float, verify: ssl.SSLContext | bool,
                 user_agent: str = "shoal-registry/1"):
        u = urlsplit(base)
        self.https = u.scheme == "https"
        self.host = u.hostname or ""
        self.port = u.port or (443 if self.https else 80)
        self.host_header = u.netloc
        self.registry, self.timeout, self.user_agent = registry, timeout, user_agent
        self._verify = verify
        self._ctx: ssl.SSLContext | None = verify if isinstance(verify, ssl.SSLContext) else None
        self._local = threading.local()
        self.requests = 0  # answered here (tests)
        self.connects = 0  # connections opened (tests: kept alive between requests)

    def _conn(self, fresh: bool) -> tuple[http.client.HTTPConnection, bool]:
        """(connection, reused): this thread's kept-alive connection, or a new one."""
        c = getattr(self._local, "conn", None)
        if c is not None and not fresh:
            return c, True
        if c is not None:
            c.close()
        if self.https:
            if self._ctx is None:  # made on first use: loading the system's CAs takes milliseconds
                self._ctx = ssl.create_default_context() if self._verify else ssl._create_unverified_context()
            c = http.client.HTTPSConnection(self.host, self.port, timeout=self.timeout, context=self._ctx)
        else:
            c = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        self._local.conn = c
        self.connects += 1
        return c, False

    def drop(self) -> None:
        c = getattr(self._local, "conn", None)
        if c is not None:
            c.close()
            self._local.conn = None

    def get(self, path: str, range_header: str, auth: str | None, what: str, want: int,
            offset: int = 0) -> tuple[int, bytes] | None:
        """(status, body) of a 200/206 answer; None for any other answer (the caller's slow path).
        The whole request (status line, headers, body) ends within the timeout; a 206 body longer
        than `want` bytes (the range asked for) is refused unread, and of a 200 (a whole blob: Range
        ignored) only the first `offset + want` bytes are read."""
        headers = {"Host": self.host_header, "User-Agent": self.user_agent, "Range": range_header,
                   "Accept-Encoding": "identity"}
        if auth:
            headers["Authorization"] = auth
        for attempt in (0, 1):
            conn, reused = self._conn(fresh=attempt > 0)
            conn.response_class = partial(_DeadlineResponse,  # type: ignore[assignment]  # a factory will do
                                          deadline=time.monotonic() + self.timeout)
            try:
                if conn.sock is not None:
                    conn.sock.settimeout(self.timeout)  # the last response's reads shortened it
                conn.request("GET", path, headers=headers)
                r = conn.getresponse()
                if r.status not in (200, 206) or r.length is None or r.chunked:
                    self.drop()  # its body is not read: the connection is not reusable
                    return None
                if r.status == 206 and r.length > want:
                    self.drop()
                    raise OriginUnavailable(f"registry {self.registry}: {what} answered {r.length} bytes "
                                            f"for a range of {want}: refused")
                if r.status == 200 and r.length > offset + want:
                    body = r.read(offset + want)
                    self.drop()  # the rest of the blob is not read
                else:
                    body = r.read()
                if r.will_close:
                    self.drop()
                self.requests += 1
                return r.status, body
            except TimeoutError:  # socket.timeout is TimeoutError
                self.drop()
                raise OriginUnavailable(f"registry {self.registry}: {what} timed out after {self.timeout:g} s") \
                    from None
            except _STALE as e:
                self.drop()
                if reused and attempt == 0:
                    continue  # the server closed the idle connection: once more on a new one
                raise OriginUnavailable(f"registry {self.registry}: {what} failed ({type(e).__name__})") from None
            except ssl.SSLCertVerificationError:
                self.drop()
                return None  # the slow path names the untrusted certificate
            except (OSError, http.client.HTTPException) as e:
                self.drop()
                raise OriginUnavailable(f"registry {self.registry}: {what} failed ({type(e).__name__})") from None
        return None
