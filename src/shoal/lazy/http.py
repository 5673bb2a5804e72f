"""`HttpOrigin`: blobs on a plain HTTP server or an S3-compatible bucket, read with Range requests.

Keys are paths under the base URL (`<base>/<key>`). Credentials come from the URL's user:password
(basic auth), a bearer token named by an environment variable (`token_env`: the token itself is never
stored in a spec or a database), or presigned URLs; none of them is logged or shown in `repr`.

Every call has one deadline (`timeout`): connect, headers and body together. Past it, a refused
connection, a reset, or a 5xx answer: `OriginUnavailable`. A 404: `LayerNotFound`.
"""
from __future__ import annotations

import logging
import os
import re
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from urllib.parse import quote, urlsplit, urlunsplit

import httpx

from ..core.errors import InvalidArgument, LayerNotFound, OriginUnavailable
from .origin import DEFAULT_TIMEOUT_S, BlobStat, Origin


def redact(url: str) -> str:
    """The URL without user:password (what logs and errors may show)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def origin_of(url: str | httpx.URL) -> tuple[str, str, int]:
    """(scheme, host, port) of a URL, the default port filled in: what credentials are bound to."""
    u = httpx.URL(str(url))
    return u.scheme, u.host.lower(), u.port or (443 if u.scheme == "https" else 80)


def no_foreign_credentials(own: tuple[str, str, int]) -> Callable[[httpx.Request], None]:
    """An httpx request hook: a request to any origin but `own` (or, for a token request, the realm's
    origin it names in its `shoal_credentials_for` extension) goes without an Authorization header.
    httpx drops the header itself on a cross-origin redirect, but keeps it on an http -> https one to
    the same host; this holds whatever its policy: storage a registry redirects a blob GET to (S3, a
    CDN) never gets the registry's credentials."""
    def hook(request: httpx.Request) -> None:
        if origin_of(request.url) != request.extensions.get("shoal_credentials_for", own):
            request.headers.pop("Authorization", None)
    return hook


class _RedactUrls(logging.Filter):
    """httpx logs each request's URL (INFO) and httpcore the response headers (DEBUG): a redirect's
    Location may carry the storage's credentials (userinfo, an S3 presigned signature in the query).
    Whatever handler the application sets up, these records keep only scheme, host and path."""

    _USERINFO = re.compile(r"(?<=//)[^/@\s'\"]+@")
    _QUERY = re.compile(r"(https?://[^\s?'\"]*)\?[^\s'\"]*")
    # httpcore's header tuples: a relative Location (same host, e.g. a signed storage path) has no scheme
    _LOCATION = re.compile(r"(?i)(b'location', b'[^'?]*)\?[^']*")

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        clean = self._QUERY.sub(r"\1?<redacted>", self._USERINFO.sub("", msg))
        clean = self._LOCATION.sub(r"\1?<redacted>", clean)
        if clean != msg:
            record.msg, record.args = clean, None
        return True


for _name in ("httpx", "httpcore.http11", "httpcore.http2", "httpcore.connection", "httpcore.proxy"):
    logging.getLogger(_name).addFilter(_RedactUrls())


class HttpOrigin(Origin):
    def __init__(self, base_url: str, timeout: float = DEFAULT_TIMEOUT_S, token_env: str | None = None,
                 verify: bool | str = True, max_connections: int = 64):
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidArgument(f"origin URL {redact(base_url)!r}: expected http(s)://host[:port]/path")
        auth = httpx.BasicAuth(parts.username, parts.password or "") if parts.username else None
        headers = {}
        if token_env:
            token = os.environ.get(token_env)
            if token:
                headers["Authorization"] = f"Bearer {token}"
        self.base = redact(base_url).rstrip("/") + "/"
        self.timeout = timeout
        # a redirect to another origin (a bucket's CDN) never takes the credentials along
        self._client = httpx.Client(auth=auth, headers=headers, verify=verify, follow_redirects=True,
                                    timeout=httpx.Timeout(timeout),
                                    event_hooks={"request": [no_foreign_credentials(origin_of(self.base))]},
                                    limits=httpx.Limits(max_connections=max_connections,
                                                        max_keepalive_connections=max_connections))

    def __repr__(self) -> str:
        return f"HttpOrigin({self.base!r})"

    def url(self, key: str) -> str:
        return self.base + quote(key.lstrip("/"))

    def _fail(self, key: str, why: str) -> OriginUnavailable:
        return OriginUnavailable(f"origin {self.base} could not serve {key!r}: {why}")

    def stat(self, key: str) -> BlobStat:
        try:
            r = self._client.head(self.url(key))
        except httpx.HTTPError as e:
            raise self._fail(key, type(e).__name__) from None
        if r.status_code == 404:
            raise LayerNotFound(f"{key!r} not found at origin {self.base}")
        if r.status_code >= 400:
            raise self._fail(key, f"HTTP {r.status_code}")
        digest = r.headers.get("docker-content-digest")
        return BlobStat(key=key, size=int(r.headers.get("content-length", 0)), digest=digest)

    def read(self, key: str, offset: int, length: int) -> bytes:
        if length <= 0:
            return b""
        deadline = time.monotonic() + self.timeout
        out = bytearray()
        try:
            with self._client.stream("GET", self.url(key),
                                     headers={"Range": f"bytes={offset}-{offset + length - 1}"}) as r:
                if r.status_code == 416:
                    return b""
                if r.status_code == 404:
                    raise LayerNotFound(f"{key!r} not found at origin {self.base}")
                if r.status_code >= 400:
                    raise self._fail(key, f"HTTP {r.status_code}")
                skip = offset if r.status_code == 200 else 0  # a server that ignores Range sends it all
                for part in r.iter_raw():
                    if time.monotonic() > deadline:
                        raise self._fail(key, f"read of {length} bytes at {offset} took over {self.timeout:g} s")
                    if skip:
                        drop = min(skip, len(part))
                        part, skip = part[drop:], skip - drop
                    out += part
                    if len(out) >= length:
                        break
        except httpx.HTTPError as e:
            raise self._fail(key, type(e).__name__) from None
        return bytes(out[:length])

    def list(self, prefix: str = "") -> list[str]:
        """S3 ListObjectsV2 (`?list-type=2&prefix=`), else a JSON array of keys, else the links of
        an HTML index page."""
        try:
            r = self._client.get(self.base, params={"list-type": "2", "prefix": prefix})
        except httpx.HTTPError as e:
            raise self._fail(prefix, type(e).__name__) from None
        if r.status_code >= 400:
            raise self._fail(prefix, f"HTTP {r.status_code} listing")
        body = r.text
        if body.lstrip().startswith("<?xml") or "ListBucketResult" in body[:400]:
            root = ET.fromstring(body)
            keys = [el.text or "" for el in root.iter() if el.tag.endswith("}Key") or el.tag == "Key"]
        elif body.lstrip().startswith("["):
            keys = [str(k) for k in r.json()]
        else:
            keys = [k for k in re.findall(r'href="([^"?#]+)"', body) if not k.startswith(("/", "..", "http"))]
        return sorted(k for k in keys if k.startswith(prefix))

    def close(self) -> None:
        self._client.close()
