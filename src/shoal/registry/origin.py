"""`RegistryOrigin`: an OCI registry as a lazy-loading origin (stat, range read, list).

Keys are `<repository>@sha256:<hex>` (a blob of that repository), as the Origin contract says.
stat = HEAD blob, read = GET blob with a Range header, list(prefix) = the blobs a manifest
references, with `prefix` a manifest reference `<repository>:<tag>` or `<repository>@sha256:<hex>`.
`layers()` gives what a lazy loader needs per Shoal layer: the EROFS blob's key and size and its
chunk-index key. Reads time out after `timeout` seconds (OriginUnavailable); bytes are returned
unverified, the caller checks each chunk against its ChunkIndex.

A key `<repository>:<tag>` (no `@`) names the single blob of the small artifact manifest under that
tag (a prefetch list, `shoal.registry.prefetch`), fetched whole and checked against its digest.

Origin specs of kind "registry" (what a lazily pulled layer records in the layer store, never a
credential: those come from the environment or the Docker config when the origin is opened):

    {"kind": "registry", "registry": "host:port", "key": "<repo>@sha256:<hex>",
     "index_key": "<repo>@sha256:<hex>", "prefetch_key": "<repo>:shoal-prefetch-<hex>",
     "timeout_s": 10, "ca": "/path/ca.pem", "insecure": false, "plain_http": false}

`origin_from_spec` opens one; RegistryOrigins of one process with the same connection settings
share one RegistryClient (one connection pool, one auth handshake)."""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import InvalidArgument, RegistryError
from ..lazy.chunks import LAYER_MEDIA_TYPE, ChunkIndex
from ..lazy.origin import DEFAULT_TIMEOUT_S, BlobStat, Origin
from .client import RegistryClient
from .media import ANN_CHUNKS, ANN_LAYER, ANN_LAYER_ENTRIES, ANN_LAYER_SIZE
from .pull import resolve_manifest
from .reference import Reference, parse_reference


@dataclass(frozen=True)
class RemoteLayer:
    layer: str  # Shoal layer digest (tree digest)
    key: str  # origin key of the EROFS image blob: <repo>@sha256:<hex>
    size: int  # bytes of the EROFS image
    index_key: str  # origin key of its chunk index blob
    content_size: int = 0  # LayerInfo.size, from the annotation
    entries: int = 0


def split_key(key: str) -> tuple[str, str]:
    repo, sep, digest = key.rpartition("@")
    if not sep or not repo or not digest.startswith("sha256:") or len(digest) != 71:
        raise InvalidArgument(f"registry origin key {key!r}: expected <repository>@sha256:<hex>")
    return repo, digest


def _tag_key(key: str) -> tuple[str, str] | None:
    """(repository, tag) of a `<repository>:<tag>` key, None for a blob key."""
    if "@" in key:
        return None
    repo, sep, tag = key.rpartition(":")
    if not sep or not repo or not tag or "/" in tag:
        raise InvalidArgument(f"registry origin key {key!r}: expected <repository>@sha256:<hex> or <repository>:<tag>")
    return repo, tag


class RegistryOrigin(Origin):
    """Blobs of one registry (any repository in it)."""

    def __init__(self, registry: str | RegistryClient, *, timeout: float = DEFAULT_TIMEOUT_S,
                 ca: str | os.PathLike | None = None, insecure: bool = False, plain_http: bool = False):
        if isinstance(registry, RegistryClient):
            self.client, self._own = registry, False
        else:
            self.client, self._own = RegistryClient(registry, ca=ca, insecure=insecure, plain_http=plain_http,
                                                    timeout=timeout), True
        self._tagged: dict[str, bytes] = {}  # `<repo>:<tag>` key -> its artifact's blob (small)

    @classmethod
    def for_image(cls, ref: str, **kw: object) -> tuple[RegistryOrigin, Reference]:
        """An origin for the registry `ref` ("REGISTRY/REPO:TAG") lives on, and the parsed reference."""
        r = parse_reference(ref)
        return cls(r.registry, **kw), r  # type: ignore[arg-type]  # keyword options pass through

    def stat(self, key: str) -> BlobStat:
        if _tag_key(key) is not None:
            data = self._artifact(key)
            return BlobStat(key=key, size=len(data), digest=None)
        repo, digest = split_key(key)
        return BlobStat(key=key, size=self.client.stat_blob(repo, digest), digest=digest)

    def read(self, key: str, offset: int, length: int) -> bytes:
        if _tag_key(key) is not None:
            return self._artifact(key)[offset:offset + length]
        repo, digest = split_key(key)
        return self.client.read_blob(repo, digest, offset, length)

    def read_ranges(self, key: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        if _tag_key(key) is not None:
            return [self.read(key, o, n) for o, n in ranges]
        repo, digest = split_key(key)
        return self.client.read_blob_ranges(repo, digest, ranges)

    @property
    def multi_range(self) -> bool:  # type: ignore[override]  # a property over the base's class attribute
        return self.client.multi_range is not False

    def _artifact(self, key: str) -> bytes:
        """The one blob of the artifact manifest tagged `<repo>:<tag>` (ImageNotFound if no such tag)."""
        if key not in self._tagged:
            repo, tag = _tag_key(key) or ("", "")
            m = self.client.get_manifest(repo, tag).json()
            blobs = [d for d in m.get("layers") or [] if isinstance(d, dict) and d.get("digest")]
            if len(blobs) != 1:
                raise RegistryError(f"{self.client.registry}/{key}: expected an artifact with one blob")
            self._tagged[key] = self.client.get_blob(repo, blobs[0]["digest"], max_bytes=16 << 20)
        return self._tagged[key]

    def layers(self, ref: str) -> list[RemoteLayer]:
        """The Shoal layers of image `ref` ("<repository>:<tag>" in this registry), bottom -> top."""
        r = parse_reference(f"{self.client.registry}/{ref}")
        m = resolve_manifest(self.client, r).json()
        out = []
        for d in m.get("layers") or []:
            if not isinstance(d, dict) or d.get("mediaType") != LAYER_MEDIA_TYPE:
                continue
            ann = d.get("annotations") or {}
            out.append(RemoteLayer(layer=ann.get(ANN_LAYER, ""), key=f"{r.repository}@{d['digest']}",
                                   size=int(d.get("size", 0)), index_key=f"{r.repository}@{ann.get(ANN_CHUNKS, '')}",
                                   content_size=int(ann.get(ANN_LAYER_SIZE, 0)),
                                   entries=int(ann.get(ANN_LAYER_ENTRIES, 0))))
        return out

    def chunk_index(self, layer: RemoteLayer) -> ChunkIndex:
        """The layer's chunk index, fetched whole and checked against its digest."""
        repo, digest = split_key(layer.index_key)
        return ChunkIndex.model_validate_json(self.client.get_blob(repo, digest))

    def close(self) -> None:
        if self._own:
            self.client.close()

    # last in the class body: a method named `list` shadows the builtin in the annotations after it
    def list(self, prefix: str = "") -> list[str]:
        """Keys of the blobs the manifest `prefix` names (config first, then layers bottom -> top)."""
        if not prefix:
            return []
        r = parse_reference(f"{self.client.registry}/{prefix}")
        m = resolve_manifest(self.client, r).json()
        descs = [m.get("config") or {}, *(m.get("layers") or [])]
        return [f"{r.repository}@{d['digest']}" for d in descs if isinstance(d, dict) and d.get("digest")]


_SHARED: dict[tuple, RegistryClient] = {}
_SHARED_LOCK = threading.Lock()


def shared_client(registry: str, *, ca: str | None = None, insecure: bool = False, plain_http: bool = False,
                  timeout: float = DEFAULT_TIMEOUT_S) -> RegistryClient:
    """One RegistryClient per connection settings in this process (the lazy daemon opens an origin
    per layer: they share its connections and its auth handshake). Credentials are looked up once,
    when the client is made (environment, then the Docker config)."""
    key = (registry, ca, insecure, plain_http, timeout)
    with _SHARED_LOCK:
        cl = _SHARED.get(key)
        if cl is None:
            cl = _SHARED[key] = RegistryClient(registry, ca=ca, insecure=insecure, plain_http=plain_http,
                                               timeout=timeout)
        return cl


def layer_spec(registry: str, repository: str, blob: str, index_digest: str, *, ca: str | None = None,
               insecure: bool = False, plain_http: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict:
    """The origin spec of one layer blob in a registry (no credential: see the module docstring)."""
    from .prefetch import prefetch_tag

    spec: dict = {"kind": "registry", "registry": registry, "key": f"{repository}@{blob}",
                  "index_key": f"{repository}@{index_digest}",
                  "prefetch_key": f"{repository}:{prefetch_tag(blob)}", "timeout_s": timeout_s}
    ca = ca or os.environ.get("SHOAL_REGISTRY_CA")
    if ca:
        spec["ca"] = str(Path(ca).absolute())
    if insecure:
        spec["insecure"] = True
    if plain_http:
        spec["plain_http"] = True
    return spec


def origin_from_spec(spec: dict) -> RegistryOrigin:
    """The `Origin` of an origin spec of kind "registry" (registered with shoal.lazy.layer)."""
    registry = spec.get("registry")
    if not isinstance(registry, str) or not registry:
        raise InvalidArgument("a registry origin spec needs its registry (host[:port])")
    ca = spec.get("ca")
    return RegistryOrigin(shared_client(registry, ca=ca if isinstance(ca, str) else None,
                                        insecure=bool(spec.get("insecure")), plain_http=bool(spec.get("plain_http")),
                                        timeout=float(spec.get("timeout_s", DEFAULT_TIMEOUT_S))))


def _register() -> None:
    from ..lazy.layer import register_origin_kind

    register_origin_kind("registry", origin_from_spec)


_register()

__all__ = ["RegistryOrigin", "RemoteLayer", "split_key", "layer_spec", "origin_from_spec", "shared_client"]
