"""`RegistryOrigin`: an OCI registry as a lazy-loading origin (stat, range read, list).

Keys are `<repository>@sha256:<hex>` (a blob of that repository), as the Origin contract says.
stat = HEAD blob, read = GET blob with a Range header, list(prefix) = the blobs a manifest
references, with `prefix` a manifest reference `<repository>:<tag>` or `<repository>@sha256:<hex>`.
`layers()` gives what a lazy loader needs per Shoal layer: the EROFS blob's key and size and its
chunk-index key. Reads time out after `timeout` seconds (OriginUnavailable); bytes are returned
unverified, the caller checks each chunk against its ChunkIndex."""
from __future__ import annotations

import os
from dataclasses import dataclass

from ..core.errors import InvalidArgument
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


class RegistryOrigin(Origin):
    """Blobs of one registry (any repository in it)."""

    def __init__(self, registry: str | RegistryClient, *, timeout: float = DEFAULT_TIMEOUT_S,
                 ca: str | os.PathLike | None = None, insecure: bool = False):
        if isinstance(registry, RegistryClient):
            self.client, self._own = registry, False
        else:
            self.client, self._own = RegistryClient(registry, ca=ca, insecure=insecure, timeout=timeout), True

    @classmethod
    def for_image(cls, ref: str, **kw: object) -> tuple[RegistryOrigin, Reference]:
        """An origin for the registry `ref` ("REGISTRY/REPO:TAG") lives on, and the parsed reference."""
        r = parse_reference(ref)
        return cls(r.registry, **kw), r  # type: ignore[arg-type]  # keyword options pass through

    def stat(self, key: str) -> BlobStat:
        repo, digest = split_key(key)
        return BlobStat(key=key, size=self.client.stat_blob(repo, digest), digest=digest)

    def read(self, key: str, offset: int, length: int) -> bytes:
        repo, digest = split_key(key)
        return self.client.read_blob(repo, digest, offset, length)

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


__all__ = ["RegistryOrigin", "RemoteLayer", "split_key"]
