"""One lazy layer: its EROFS image read at any offset, chunk by chunk, through the host's chunk cache.

Where the blob lives is an *origin spec*, a small JSON object kept in the layer store (never a
credential: secrets stay in the environment or the URL given at run time):

    {"kind": "http", "url": "http://host:port/base/", "key": "layers/<hex>.erofs", "timeout_s": 10,
     "token_env": "NAME", "prefetch_key": "layers/<hex>.prefetch.json"}
    {"kind": "registry", "registry": "host:port", "key": "<repo>@sha256:<hex>", ...}  (shoal.registry.origin)

`open_origin(spec)` makes the `Origin`; other kinds (an OCI registry) register a factory with
`register_origin_kind`.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from ..core.errors import CorruptChunk, InvalidArgument, OriginUnavailable
from .cache import ChunkCache
from .chunks import ChunkIndex
from .origin import Origin
from .prefetch import Recorder

_FACTORIES: dict[str, Callable[[dict], Origin]] = {}


def register_origin_kind(kind: str, factory: Callable[[dict], Origin]) -> None:
    """Let origin specs of `kind` be opened by `factory(spec)` (e.g. the registry package)."""
    _FACTORIES[kind] = factory


def _http(spec: dict) -> Origin:
    from .http import HttpOrigin

    return HttpOrigin(spec["url"], timeout=float(spec.get("timeout_s", 10.0)), token_env=spec.get("token_env"),
                      verify=spec.get("verify", True))


register_origin_kind("http", _http)


def open_origin(spec: dict) -> Origin:
    kind = spec.get("kind")
    if kind not in _FACTORIES and kind == "registry":
        try:  # the registry package registers its kind on import
            __import__("shoal.registry")
        except ImportError:
            pass
    factory = _FACTORIES.get(str(kind))
    if factory is None:
        raise InvalidArgument(f"unknown origin kind {kind!r} (known: {', '.join(sorted(_FACTORIES))})")
    return factory(spec)


def spec_key(spec: dict) -> str:
    key = spec.get("key")
    if not isinstance(key, str) or not key:
        raise InvalidArgument("an origin spec needs the blob's key")
    return key


class LazyLayer:
    """Reads of one layer blob, served from the chunk cache, fetching missing chunks from `origin`."""

    def __init__(self, index: ChunkIndex, origin: Origin, key: str, cache: ChunkCache,
                 recorder: Recorder | None = None):
        self.index, self.origin, self.key, self.cache = index, origin, key, cache
        self.recorder = recorder
        self.reads = 0

    def _fetcher(self, i: int) -> Callable[[], bytes]:
        def fetch() -> bytes:
            off, length = self.index.span(i)
            return self.index.verify(i, self.origin.read(self.key, off, length))

        return fetch

    def ensure_chunk(self, i: int) -> None:
        """Chunk i in the cache (fetched and verified if needed)."""
        self.cache.get(self.index.chunks[i], self._fetcher(i))

    def read(self, offset: int, length: int) -> bytes:
        """Bytes [offset, offset+length) of the blob (short at its end). Raises OriginUnavailable or
        CorruptChunk when a chunk it needs cannot be had."""
        self.reads += 1
        parts = []
        end = min(self.index.size, offset + length)
        for i in self.index.chunks_for(offset, length):
            start, clen = self.index.span(i)
            lo, hi = max(offset, start) - start, min(end, start + clen) - start
            if self.recorder is not None:
                self.recorder.saw(i)
            parts.append(self.cache.read(self.index.chunks[i], lo, hi - lo, self._fetcher(i)))
        return b"".join(parts)

    def cached_chunks(self) -> int:
        return sum(1 for c in set(self.index.chunks) if self.cache.has(c))


def prefetch_chunks(layer: LazyLayer, order: list[int], stop: threading.Event | None = None,
             on_error: Callable[[int, Exception], None] | None = None) -> int:
    """Fetch chunks in `order` (the prefetch list) unless cached; returns how many it fetched. Stops at
    the first origin failure (demand reads still try the origin themselves)."""
    fetched = 0
    for i in order:
        if stop is not None and stop.is_set():
            break
        if not 0 <= i < len(layer.index.chunks) or layer.cache.has(layer.index.chunks[i]):
            continue
        try:
            layer.ensure_chunk(i)
            fetched += 1
        except (OriginUnavailable, CorruptChunk, OSError) as e:
            if on_error is not None:
                on_error(i, e)
            break
    return fetched


def chunk_cache_for(root: os.PathLike | str, cap_bytes: int | None = None,
                    pinned: Callable[[], set[str]] | None = None) -> ChunkCache:
    from pathlib import Path

    from .cache import DEFAULT_CAP_BYTES

    env = os.environ.get("SHOAL_CHUNK_CACHE_BYTES")
    cap = cap_bytes or (int(env) if env else DEFAULT_CAP_BYTES)
    return ChunkCache(Path(root) / "chunks", cap, pinned)


def describe_spec(spec: dict[str, Any]) -> str:
    """A spec for humans and logs: kind and the URL without credentials."""
    from .http import redact

    url = spec.get("url")
    if spec.get("kind") == "registry":
        return f"registry:{spec.get('registry', '')}/{spec.get('key', '')}"
    return f"{spec.get('kind')}:{redact(url) if isinstance(url, str) else ''}{spec.get('key', '')}"
