"""A small OCI distribution-spec client over httpx (docs/registry.md says why not `oras`).

What Shoal needs from a registry, and nothing else: HEAD/GET blobs (GET with Range, for lazy
loading), chunked uploads that resume from the registry's reported offset, manifests by tag or
digest, and the two auth flows (basic, and the bearer-token challenge of Docker Hub and most
hosted registries). Every downloaded byte is hashed against the digest it was asked for.

Errors: a registry that does not answer in time or drops the connection -> OriginUnavailable
(retryable); an error status -> RegistryError naming the registry and the registry's error code;
a missing blob or manifest -> LayerNotFound / ImageNotFound; wrong bytes -> CorruptChunk.
Credentials appear in no message and no log line."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import ssl
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlencode, urljoin, urlsplit

import httpx

from ..core.errors import CorruptChunk, ImageNotFound, InvalidArgument, LayerNotFound, OriginUnavailable, RegistryError
from ..lazy.http import no_foreign_credentials, origin_of
from ..lazy.origin import DEFAULT_TIMEOUT_S
from . import fastget
from .auth import Credentials, find_credentials, parse_challenge
from .fastget import FastRangeGet
from .media import ACCEPT_MANIFESTS
from .uploads import UploadSessions

MAX_MANIFEST_BYTES = 4 << 20  # distribution's own limit on a manifest it accepts
SMALL_BODY_BYTES = 64 << 10  # of an answer whose body is not needed whole (an error's JSON, an upload's)
MAX_TOKEN_BYTES = 1 << 20  # a token service's JSON (Docker Hub's: ~4 KiB)
log = logging.getLogger("shoal.registry")


DEFAULT_CHUNK_SIZE = 16 << 20  # upload chunk: one PATCH; what an interrupted push re-sends at most
_READ = 1 << 20
Progress = Callable[[int, int], None]  # (bytes done, bytes total)


@dataclass
class UploadResult:
    digest: str
    size: int
    sent: int  # bytes this call sent (0: the registry had the blob)
    resumed_from: int  # offset an earlier, interrupted upload had reached (0: a fresh upload)
    existed: bool = False


@dataclass
class Manifest:
    body: bytes
    media_type: str
    digest: str

    def json(self) -> dict:
        try:
            data = json.loads(self.body)
        except ValueError as e:
            raise RegistryError(f"manifest {self.digest} is not JSON ({e})") from None
        if not isinstance(data, dict):
            raise RegistryError(f"manifest {self.digest} is not a JSON object")
        return data


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _ssl_verify(ca: str | os.PathLike | None, insecure: bool) -> ssl.SSLContext | bool:
    """TLS verification: `ca` (a PEM bundle), $SHOAL_REGISTRY_CA, $SSL_CERT_FILE / $SSL_CERT_DIR, else the
    system's default bundle; `insecure` turns verification off (a test registry, never a default)."""
    if insecure:
        return False
    cafile = str(ca) if ca else os.environ.get("SHOAL_REGISTRY_CA") or os.environ.get("SSL_CERT_FILE")
    if cafile:
        if not Path(cafile).is_file():
            raise InvalidArgument(f"CA bundle {cafile} does not exist")
        return ssl.create_default_context(cafile=cafile)
    if os.environ.get("SSL_CERT_DIR"):
        return ssl.create_default_context(capath=os.environ["SSL_CERT_DIR"])
    return True


class RegistryClient:
    """One registry (host[:port]); thread-safe for reads (httpx.Client is)."""

    def __init__(self, registry: str, *, credentials: Credentials | None = None, username: str | None = None,
                 password: str | None = None, ca: str | os.PathLike | None = None, insecure: bool = False,
                 plain_http: bool = False, timeout: float = DEFAULT_TIMEOUT_S, anonymous: bool = False):
        self.registry = registry
        self.base = f"{'http' if plain_http else 'https'}://{registry}"
        self.credentials = None if anonymous else (credentials or find_credentials(registry, username, password))
        self.timeout = timeout
        # how to reach it again (a lazy layer's origin spec records these; never the credentials)
        self.ca = str(Path(ca).absolute()) if ca else None
        self.insecure, self.plain_http = insecure, plain_http
        verify = _ssl_verify(ca, insecure)
        self._origin = origin_of(self.base)
        self._http = httpx.Client(verify=verify, timeout=httpx.Timeout(timeout),
                                  follow_redirects=True, trust_env=False,
                                  headers={"User-Agent": "shoal-registry/1"},
                                  event_hooks={"request": [no_foreign_credentials(self._origin)]})
        self._auth: dict[str, str] = {}  # repository ("" for /v2/) -> Authorization header value
        self.stats: Counter[str] = Counter()  # e.g. "GET blob", "PATCH upload", "bytes sent"
        self.multi_range: bool | None = None  # whether it answers multi-range GETs (None: not tried yet)
        # the lazy loader's Range GETs on plain kept-alive connections (shoal.registry.fastget)
        self._fast = FastRangeGet(self.base, registry, timeout, verify) if fastget.enabled() else None

    def close(self) -> None:
        self._http.close()
        if self._fast is not None:
            self._fast.drop()

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RegistryClient({self.registry!r}, user={self.credentials.username if self.credentials else None!r})"

    # ------------------------------------------------------------------------------ transport
    def _url(self, path_or_url: str) -> str:
        return urljoin(self.base + "/", path_or_url) if not path_or_url.startswith("http") else path_or_url

    def _who(self) -> str:
        c = self.credentials
        return f"as {c.username!r} (credentials from {c.source})" if c else "anonymously"

    def _token(self, params: dict[str, str], repo: str) -> str:
        realm = params.get("realm")
        if not realm:
            raise RegistryError(f"registry {self.registry}: bearer challenge without a realm")
        query = {k: params[k] for k in ("service", "scope") if params.get(k)}
        headers = {"Authorization": self.credentials.basic()} if self.credentials else {}
        try:
            where = origin_of(realm)
        except httpx.InvalidURL:
            raise RegistryError(f"registry {self.registry}: bearer challenge with a malformed realm") from None
        if headers and not self.plain_http and where[0] != "https":
            # a TLS registry naming a plain-HTTP token service would put its credentials on the wire in clear
            raise RegistryError(f"registry {self.registry}: its token service {where[1]} is not HTTPS: "
                                f"the credentials of {self.registry} were not sent")
        try:  # the registry names its token service: the credentials go there (Docker Hub: another host)
            r = self._http.send(self._http.build_request("GET", realm, params=query, headers=headers,
                                                         extensions={"shoal_credentials_for": where}), stream=True)
        except httpx.TransportError as e:
            raise self._transport_error(e, "token request") from None
        except httpx.TooManyRedirects:
            raise RegistryError(f"registry {self.registry}: token request redirected too many times") from None
        raw = self._small_body(r, MAX_TOKEN_BYTES)
        if r.status_code in (401, 403):
            raise RegistryError(f"registry {self.registry}: authentication failed {self._who()} "
                                f"(token service answered {r.status_code})")
        if r.status_code != 200:
            raise RegistryError(f"registry {self.registry}: token service answered {r.status_code}")
        try:
            body = json.loads(raw)
            token = body.get("token") or body.get("access_token")
        except (ValueError, AttributeError):
            token = None
        if not isinstance(token, str) or not token:
            raise RegistryError(f"registry {self.registry}: token service returned no token")
        return f"Bearer {token}"

    def _transport_error(self, e: httpx.TransportError, what: str) -> Exception:
        """Timeouts and dropped connections are retryable; an untrusted certificate is not."""
        if isinstance(e, httpx.TimeoutException):
            return OriginUnavailable(f"registry {self.registry}: {what} timed out after {self.timeout:g} s")
        if "CERTIFICATE_VERIFY_FAILED" in str(e):
            return RegistryError(f"registry {self.registry}: its TLS certificate is not trusted (give its CA with "
                                 f"--ca, SHOAL_REGISTRY_CA or SSL_CERT_FILE; --insecure skips the check)")
        return OriginUnavailable(f"registry {self.registry}: {what} failed ({type(e).__name__}: "
                                 f"{_no_secrets(str(e))})")

    def _authorize(self, response: httpx.Response, repo: str, sent: str | None = None) -> bool:
        """Answer a 401's challenge; False when there is nothing more to try. `sent`: the Authorization
        the refused request carried (threads racing on a fresh client all get a 401 for no header at
        all: only the one that sent this very answer has seen it fail)."""
        challenge = parse_challenge(response.headers.get("WWW-Authenticate", ""))
        if challenge is None:
            return False
        if challenge.scheme == "basic":
            if self.credentials is None:
                raise RegistryError(f"registry {self.registry} requires credentials: set SHOAL_REGISTRY_USER / "
                                    f"SHOAL_REGISTRY_PASSWORD with SHOAL_REGISTRY_HOST={self.registry}, or "
                                    f"`docker login {self.registry}`")
            header = self.credentials.basic()
        elif challenge.scheme == "bearer":
            header = self._token(challenge.params, repo)
        else:
            raise RegistryError(f"registry {self.registry}: unsupported auth scheme {challenge.scheme!r}")
        if header == sent:
            return False  # the same answer failed already
        self._auth[repo] = header
        return True

    def request(self, method: str, path: str, *, repo: str = "", what: str = "", stream: bool = False,
                ok: tuple[int, ...] = (200,), headers: dict[str, str] | None = None,
                content: bytes | None = None, missing: type[Exception] | None = None) -> httpx.Response:
        """One call, authenticated as the registry asks; non-`ok` statuses become typed errors."""
        what = what or f"{method} {urlsplit(path).path}"
        for _ in range(3):
            hdrs = dict(headers or {})
            auth = self._auth.get(repo) or self._auth.get("")
            if auth:
                hdrs["Authorization"] = auth
            req = self._http.build_request(method, self._url(path), headers=hdrs, content=content)
            log.debug("%s %s", method, urlsplit(str(req.url)).path)
            try:  # always streamed: a hostile registry's answer body is read only as far as needed
                r = self._http.send(req, stream=True)
            except httpx.TransportError as e:
                raise self._transport_error(e, what) from None
            except httpx.TooManyRedirects:  # a hostile registry's redirect loop: typed, not httpx's own error
                raise RegistryError(f"registry {self.registry}: {what} redirected more than "
                                    f"{self._http.max_redirects} times: refused") from None
            if r.status_code == 401:
                self._small_body(r)  # its connection stays reusable (the auth round trip that follows)
                if origin_of(r.url) != self._origin:  # a redirect's target (storage) asks: never answered
                    raise RegistryError(f"registry {self.registry}: {what} was redirected to "
                                        f"{r.url.host}:{origin_of(r.url)[2]}, which asked for credentials; those "
                                        f"of {self.registry} are for it alone and were not sent")
                if not self._authorize(r, repo, auth):
                    raise RegistryError(f"registry {self.registry}: authentication failed {self._who()} ({what})")
                continue
            if r.status_code in ok:
                if not stream:  # callers of a plain request use its status and headers only
                    self._small_body(r)
                return r
            raise self._error(r, what, missing, self._small_body(r))
        raise RegistryError(f"registry {self.registry}: authentication failed {self._who()} ({what})")

    def _small_body(self, r: httpx.Response, cap: int = SMALL_BODY_BYTES) -> bytes:
        """At most `cap` bytes of a streamed answer (an error's JSON, a token), within the timeout; the
        response is closed. More than `cap` is cut off (the connection is dropped, not drained): a
        hostile registry's 20 GB error body or token answer was read whole into memory before."""
        buf = bytearray()
        deadline = time.monotonic() + self.timeout
        try:
            for block in r.iter_bytes():
                buf += block
                if len(buf) > cap or time.monotonic() > deadline:
                    break
        except httpx.HTTPError:
            pass  # what arrived is all the caller gets (an error's detail, or too little for a token)
        finally:
            r.close()
        return bytes(buf[:cap])

    def _error(self, r: httpx.Response, what: str, missing: type[Exception] | None, body: bytes = b"") -> Exception:
        detail = ""
        try:
            errs = json.loads(body).get("errors") or []
            detail = "; ".join(f"{e.get('code')}: {e.get('message')}" for e in errs if isinstance(e, dict))
        except (ValueError, AttributeError):
            pass
        # the registry's own words: no terminal control sequences, no page of text
        detail = "".join(c if c.isprintable() else "?" for c in detail[:500])
        msg = f"registry {self.registry}: {what} answered {r.status_code}" + (f" ({detail})" if detail else "")
        if r.status_code == 404 and missing is not None:
            return missing(msg)
        if r.status_code == 403:
            return RegistryError(msg + f"; denied {self._who()}")
        if r.status_code >= 500 or r.status_code == 429:
            return OriginUnavailable(msg)
        return RegistryError(msg)

    # ------------------------------------------------------------------------------ API
    def ping(self) -> None:
        """GET /v2/: the registry answers and accepts these credentials."""
        self.request("GET", "/v2/", what="version check").close()

    def stat_blob(self, repo: str, digest: str) -> int:
        """Size of a blob (HEAD); LayerNotFound if the registry lacks it."""
        self.stats["HEAD blob"] += 1
        r = self.request("HEAD", f"/v2/{repo}/blobs/{digest}", repo=repo, what=f"HEAD blob {digest[:19]}",
                         missing=LayerNotFound)
        return int(r.headers.get("Content-Length", "0"))

    def has_blob(self, repo: str, digest: str) -> bool:
        try:
            self.stat_blob(repo, digest)
            return True
        except LayerNotFound:
            return False

    def read_blob(self, repo: str, digest: str, offset: int, length: int) -> bytes:
        """`length` bytes at `offset` (a Range GET); fewer only at the end of the blob. Unverified: the
        caller checks them (a chunk against its ChunkIndex)."""
        if length <= 0:
            return b""
        self.stats["GET blob range"] += 1
        rng = f"bytes={offset}-{offset + length - 1}"
        if self._fast is not None:  # the plain case on a kept-alive connection; else the full path below
            got = self._fast.get(f"/v2/{repo}/blobs/{digest}", rng, self._auth.get(repo) or self._auth.get(""),
                                 f"GET blob {digest[:19]} range", length, offset)
            if got is not None:
                status, data = got
                if status == 200:
                    data = data[offset:offset + length]
                self.stats["bytes received"] += len(data)
                return data
        r = self.request("GET", f"/v2/{repo}/blobs/{digest}", repo=repo, what=f"GET blob {digest[:19]} range",
                         ok=(200, 206), headers={"Range": rng}, stream=True,
                         missing=LayerNotFound)
        deadline = time.monotonic() + self.timeout  # the body's (the auth flow's round trips had their own)
        try:
            # a registry (or a redirect target) that ignores Range answers 200: the blob's first bytes
            keep = length if r.status_code == 206 else offset + length
            data = self._read_capped(r, digest, keep, deadline, exact=r.status_code == 206)
        finally:
            r.close()
        if r.status_code == 200:
            data = data[offset:offset + length]
        return data

    def read_blob_ranges(self, repo: str, digest: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        """Several (offset, length) ranges of a blob in ONE request (`Range: bytes=a-b,c-d,...`, answered
        206 multipart/byteranges by distribution's http.ServeContent), in the order given; unverified.
        A registry or redirect target that answers otherwise (one range, or 200 with the whole blob,
        which is not read) gets one Range GET per range from then on."""
        if len(ranges) < 2 or self.multi_range is False:
            return [self.read_blob(repo, digest, o, n) for o, n in ranges]
        self.stats["GET blob ranges"] += 1
        spec = ",".join(f"{o}-{o + n - 1}" for o, n in ranges)
        what = f"GET blob {digest[:19]} {len(ranges)} ranges"
        r = self.request("GET", f"/v2/{repo}/blobs/{digest}", repo=repo, what=what, ok=(200, 206), stream=True,
                         headers={"Range": f"bytes={spec}"}, missing=LayerNotFound)
        try:
            ctype = r.headers.get("content-type", "")
            if r.status_code != 206 or not ctype.startswith("multipart/byteranges") or "boundary=" not in ctype:
                self.multi_range = False  # not read: it may be the whole blob
                log.info("registry %s: no multi-range reads (HTTP %d, %s)", self.registry, r.status_code, ctype)
                r.close()
                return [self.read_blob(repo, digest, o, n) for o, n in ranges]
            # the parts' bytes and their heads (a few hundred bytes each), within the timeout
            cap = sum(n for _, n in ranges) + 1024 * len(ranges) + 4096
            body = self._read_capped(r, digest, cap, time.monotonic() + self.timeout, exact=True)
        finally:
            r.close()
        self.multi_range = True
        parts = _byteranges(body, ctype.split("boundary=", 1)[1].strip('"'))
        out = []
        for o, n in ranges:
            data = parts.get(o, b"")
            out.append(data[:n])
        return out

    @contextmanager
    def _blob_stream(self, repo: str, digest: str) -> Iterator[httpx.Response]:
        self.stats["GET blob"] += 1
        r = self.request("GET", f"/v2/{repo}/blobs/{digest}", repo=repo, what=f"GET blob {digest[:19]}",
                         stream=True, missing=LayerNotFound)
        try:
            yield r
        finally:
            r.close()

    def get_blob(self, repo: str, digest: str, max_bytes: int = 64 << 20) -> bytes:
        """A small blob (config, chunk index) in memory, verified against its digest."""
        buf = bytearray()
        with self._blob_stream(repo, digest) as r:
            for block in self._iter(r, digest):
                buf += block
                if len(buf) > max_bytes:
                    raise RegistryError(f"registry {self.registry}: blob {digest} is larger than {max_bytes} bytes")
        data = bytes(buf)
        if sha256_digest(data) != digest:
            raise CorruptChunk(f"blob {digest} from {self.registry}/{repo} does not match its digest: refused")
        return data

    def _read_capped(self, r: httpx.Response, digest: str, cap: int, deadline: float, exact: bool) -> bytes:
        """At most `cap` bytes of a streamed answer, all by `deadline` (httpx's timeout bounds each read
        only: an origin that drip-feeds would never end). `exact`: more than `cap` is the origin's error
        (OriginUnavailable); else the rest is left unread."""
        buf = bytearray()
        for block in self._iter(r, digest, chunk=None):  # each block as it arrives: the deadline is checked
            buf += block
            if len(buf) > cap:
                if exact:
                    raise OriginUnavailable(f"registry {self.registry}: blob {digest[:19]} answered more than the "
                                            f"{cap} bytes asked for: refused")
                del buf[cap:]
                break
            if time.monotonic() > deadline:
                raise OriginUnavailable(f"registry {self.registry}: reading blob {digest[:19]} timed out after "
                                        f"{self.timeout:g} s")
        return bytes(buf)

    def _iter(self, r: httpx.Response, digest: str, chunk: int | None = _READ) -> Iterator[bytes]:
        try:
            for block in r.iter_bytes(chunk):
                self.stats["bytes received"] += len(block)
                yield block
        except httpx.TimeoutException:
            raise OriginUnavailable(f"registry {self.registry}: reading blob {digest[:19]} timed out") from None
        except httpx.TransportError as e:
            raise OriginUnavailable(f"registry {self.registry}: reading blob {digest[:19]} failed "
                                    f"({type(e).__name__})") from None

    def download_blob(self, repo: str, digest: str, dest: Path, size: int | None = None,
                      progress: Progress | None = None) -> Path:
        """Stream a blob into `dest`, hashing every byte; on a mismatch `dest` is removed and
        CorruptChunk raised, so nothing unverified is left behind."""
        h = hashlib.sha256()
        done = 0
        try:
            with self._blob_stream(repo, digest) as r, open(dest, "wb") as f:
                total = size if size is not None else int(r.headers.get("Content-Length") or 0)
                for block in self._iter(r, digest):
                    h.update(block)
                    f.write(block)
                    done += len(block)
                    if size is not None and done > size:
                        break
                    if progress:
                        progress(done, total)
            got = "sha256:" + h.hexdigest()
            if got != digest or (size is not None and done != size):
                raise CorruptChunk(f"blob {digest} from {self.registry}/{repo} does not match its descriptor "
                                   f"({done} bytes hashing to {got[:19]}...): refused, nothing kept")
        except BaseException:
            dest.unlink(missing_ok=True)
            raise
        return dest

    # ------------------------------------------------------------------------------ manifests
    def get_manifest(self, repo: str, reference: str, accept: str = ACCEPT_MANIFESTS) -> Manifest:
        """A manifest or index by tag or digest; by digest its bytes are verified."""
        self.stats["GET manifest"] += 1
        r = self.request("GET", f"/v2/{repo}/manifests/{reference}", repo=repo,
                         what=f"GET manifest {repo}:{reference}", headers={"Accept": accept}, missing=ImageNotFound,
                         stream=True)
        try:  # a hostile registry's "manifest" may be any size: read no more than a manifest can be
            buf = bytearray()
            for block in r.iter_bytes():
                buf += block
                if len(buf) > MAX_MANIFEST_BYTES:
                    raise RegistryError(f"registry {self.registry}: manifest {repo}:{reference} is larger than "
                                        f"{MAX_MANIFEST_BYTES} bytes: refused")
        except httpx.TransportError as e:
            raise self._transport_error(e, f"GET manifest {repo}:{reference}") from None
        finally:
            r.close()
        body = bytes(buf)
        digest = sha256_digest(body)
        if reference.startswith("sha256:") and digest != reference:
            raise CorruptChunk(f"manifest {reference} from {self.registry}/{repo} does not match its digest")
        media = r.headers.get("Content-Type", "").split(";")[0].strip()
        if not media or media in ("application/json", "application/octet-stream"):
            try:
                media = json.loads(body).get("mediaType") or media
            except (ValueError, AttributeError):
                pass
        return Manifest(body, media, digest)

    def put_manifest(self, repo: str, reference: str, body: bytes, media_type: str) -> str:
        """Upload a manifest under a tag (or its digest); returns its digest."""
        self.stats["PUT manifest"] += 1
        r = self.request("PUT", f"/v2/{repo}/manifests/{reference}", repo=repo,
                         what=f"PUT manifest {repo}:{reference}", ok=(200, 201, 202),
                         headers={"Content-Type": media_type}, content=body)
        r.close()
        return sha256_digest(body)

    # ------------------------------------------------------------------------------ uploads
    def upload_blob(self, repo: str, digest: str, path: Path | None = None, data: bytes | None = None,
                    chunk_size: int = DEFAULT_CHUNK_SIZE, sessions: UploadSessions | None = None,
                    progress: Progress | None = None, skip_existing: bool = True,
                    retries: int = 3) -> UploadResult:
        """Upload one blob in chunks (POST, PATCH with Content-Range..., PUT ?digest=).

        With `sessions`, the upload's location is saved after every chunk: a push that dies (or a
        connection that drops) resumes from the offset the registry reports for that upload (a GET on
        it), not from zero. A registry that lost the upload, or ends up with different bytes (a chunk
        half-written when the connection broke), gets the blob again from the start."""
        if (path is None) == (data is None):
            raise InvalidArgument("upload_blob needs exactly one of path or data")
        size = path.stat().st_size if path is not None else len(data or b"")
        if skip_existing and self.has_blob(repo, digest):
            return UploadResult(digest, size, 0, 0, existed=True)
        key = (self.registry, repo, digest)
        location, offset = self._resume_or_start(repo, sessions, key)
        resumed_from, sent, failures, restarts = offset, 0, 0, 0
        with open(path, "rb") if path is not None else _BytesFile(data or b"") as f:
            while True:
                while offset < size:
                    f.seek(offset)
                    block = f.read(min(chunk_size, size - offset))
                    try:
                        location, offset = self._patch(repo, location, offset, block)
                    except OriginUnavailable:
                        failures += 1
                        if failures > retries:
                            raise  # the session stays saved: the next push resumes it
                        time.sleep(min(2.0, 0.2 * failures))
                        try:
                            location, offset = self._status(repo, location)  # where the registry really is
                        except (RegistryError, LayerNotFound):
                            location, offset = self._start(repo, sessions, key)
                        continue
                    sent += len(block)
                    self.stats["bytes sent"] += len(block)
                    if sessions is not None:
                        sessions.save(key, location)
                    if progress:
                        progress(offset, size)
                try:
                    self._finish(repo, location, digest)
                    break
                except RegistryError as e:
                    if restarts or not any(c in str(e) for c in ("DIGEST_INVALID", "BLOB_UPLOAD_INVALID",
                                                                  "SIZE_INVALID")):
                        raise
                    restarts += 1  # the registry's copy went wrong: once more from zero
                    location, offset = self._start(repo, sessions, key)
        if sessions is not None:
            sessions.drop(key)
        return UploadResult(digest, size, sent, resumed_from)

    def _resume_or_start(self, repo: str, sessions: UploadSessions | None,
                         key: tuple[str, str, str]) -> tuple[str, int]:
        saved = sessions.load(key) if sessions is not None else None
        if saved:
            try:
                location, offset = self._status(repo, saved)
                log.info("resuming upload of %s to %s/%s at byte %d", key[2][:19], self.registry, repo, offset)
                return location, offset
            except (RegistryError, LayerNotFound):
                if sessions is not None:
                    sessions.drop(key)
        return self._start(repo, sessions, key)

    def _start(self, repo: str, sessions: UploadSessions | None, key: tuple[str, str, str]) -> tuple[str, int]:
        self.stats["POST upload"] += 1
        r = self.request("POST", f"/v2/{repo}/blobs/uploads/", repo=repo, what=f"start upload to {repo}",
                         ok=(202,), headers={"Content-Length": "0"})
        r.close()
        location = self._location(r)
        if sessions is not None:
            sessions.save(key, location)
        return location, 0

    def _location(self, r: httpx.Response) -> str:
        loc = r.headers.get("Location")
        if not loc:
            raise RegistryError(f"registry {self.registry}: upload response without a Location")
        return urljoin(str(r.url), loc)

    @staticmethod
    def _offset(r: httpx.Response) -> int:
        """The next byte the registry expects, from its `Range: 0-<last>` header."""
        rng = r.headers.get("Range", "")
        if "-" not in rng:
            return 0
        last = int(rng.rsplit("-", 1)[1])
        return last + 1 if last > 0 else 0  # distribution answers 0-0 for an empty upload

    def _status(self, repo: str, location: str) -> tuple[str, int]:
        self.stats["GET upload"] += 1
        r = self.request("GET", location, repo=repo, what="upload status", ok=(204,), missing=LayerNotFound)
        r.close()
        return self._location(r) if r.headers.get("Location") else location, self._offset(r)

    def _patch(self, repo: str, location: str, offset: int, block: bytes) -> tuple[str, int]:
        self.stats["PATCH upload"] += 1
        r = self.request("PATCH", location, repo=repo, what="upload chunk", ok=(202,), content=block,
                         headers={"Content-Type": "application/octet-stream",
                                  "Content-Range": f"{offset}-{offset + len(block) - 1}",
                                  "Content-Length": str(len(block))})
        r.close()
        new_offset = self._offset(r) if r.headers.get("Range") else offset + len(block)
        return self._location(r), new_offset

    def _finish(self, repo: str, location: str, digest: str) -> None:
        sep = "&" if "?" in location else "?"
        self.stats["PUT upload"] += 1
        r = self.request("PUT", f"{location}{sep}{urlencode({'digest': digest})}", repo=repo,
                         what=f"finish upload of {digest[:19]}", ok=(201, 204), headers={"Content-Length": "0"})
        r.close()
        got = r.headers.get("Docker-Content-Digest")
        if got and got != digest:
            raise RegistryError(f"registry {self.registry}: stored {got} for upload of {digest}")


class _BytesFile:
    """`open()`-like access to bytes, so uploads from memory and from files share one loop."""

    def __init__(self, data: bytes):
        self._data, self._pos = data, 0

    def seek(self, pos: int) -> None:
        self._pos = pos

    def read(self, n: int) -> bytes:
        out = self._data[self._pos:self._pos + n]
        self._pos += len(out)
        return out

    def __enter__(self) -> _BytesFile:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def _byteranges(body: bytes, boundary: str) -> dict[int, bytes]:
    """The parts of a multipart/byteranges body: first byte offset -> bytes (a malformed part is
    left out: its chunks then fail their digests and are fetched again)."""
    out: dict[int, bytes] = {}
    delim = b"--" + boundary.encode()
    pos = body.find(delim)
    while pos >= 0:
        head_end = body.find(b"\r\n\r\n", pos)
        if head_end < 0:
            break
        head = body[pos + len(delim):head_end].decode("latin-1")
        m = re.search(r"(?im)^content-range:\s*bytes\s+(\d+)-(\d+)/", head)
        if not m:
            break
        a, b = int(m.group(1)), int(m.group(2))
        start = head_end + 4
        out[a] = body[start:start + b - a + 1]
        pos = body.find(delim, start + b - a + 1)
    return out


def _no_secrets(text: str) -> str:
    """Transport errors quote URLs at most; strip any userinfo a URL might carry."""
    import re

    return re.sub(r"//[^/@\s]+@", "//", text)
