"""Container image layers (tar, tar+gzip, tar+zstd) into Shoal layers, each converted once.

The blob is downloaded and checked against its descriptor digest first; then it is decompressed
into the layer store's own tar import (`LayerStore.build_from_tar`, the path `shoal layer import`
takes: same extraction, same whiteout translation), hashing the uncompressed stream on the way. A
stream that does not hash to the config's diff_id is refused before anything is stored. The result
is cached by diff_id (the store's build cache, key `oci-diff:<diff_id>`), so a layer shared by many
images, or pulled again, is never converted twice."""
from __future__ import annotations

import gzip
import hashlib
from pathlib import Path
from typing import IO, Any

from ..core.errors import CorruptChunk, RegistryError
from ..layers.store import LayerStore
from .media import CONTAINER_LAYER_TYPES


def cache_key(diff_id: str) -> str:
    return f"oci-diff:{diff_id}"


class HashingReader:
    """A read-only stream that hashes what passes through it (the uncompressed tar, for its diff_id)."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.h = hashlib.sha256()
        self.bytes = 0

    def read(self, n: int = -1) -> bytes:
        try:
            data = self.inner.read(n)
        except Exception as e:  # zstandard.ZstdError is a bare Exception: a corrupt frame is the layer's fault
            if isinstance(e, (OSError, EOFError, ValueError)):
                raise
            raise CorruptChunk(f"layer does not decompress ({type(e).__name__}: {e})") from None
        self.h.update(data)
        self.bytes += len(data)
        return data

    def drain(self) -> None:
        """Read to the end: tar readers stop at the end-of-archive marker, the diff_id covers padding too."""
        while self.read(1 << 20):
            pass

    def readable(self) -> bool:
        return True

    @property
    def digest(self) -> str:
        return "sha256:" + self.h.hexdigest()


def _decompressor(f: IO[bytes], compression: str) -> Any:
    if compression == "gzip":
        return gzip.GzipFile(fileobj=f, mode="rb")
    if compression == "zstd":
        try:
            import zstandard
        except ImportError:  # pragma: no cover - zstandard is a dependency of shoal
            raise RegistryError("a zstd layer needs the `zstandard` package") from None
        return zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True)
    return f


def convert_layer(store: LayerStore, blob: Path, media_type: str, diff_id: str, source: str) -> str:
    """Build (or find) the Shoal layer for one downloaded, digest-checked container layer blob."""
    cached = store.cache_get(cache_key(diff_id))
    if cached:
        return cached
    if media_type not in CONTAINER_LAYER_TYPES:
        raise RegistryError(f"{source}: unsupported layer media type {media_type!r} "
                            f"(Shoal converts {', '.join(sorted(CONTAINER_LAYER_TYPES))})")
    with open(blob, "rb") as f:
        reader = HashingReader(_decompressor(f, CONTAINER_LAYER_TYPES[media_type]))

        def check() -> None:
            try:
                reader.drain()
            except (OSError, EOFError, ValueError) as e:
                raise CorruptChunk(f"{source}: layer does not decompress ({e})") from None
            if reader.digest != diff_id:
                raise CorruptChunk(f"{source}: uncompressed layer hashes to {reader.digest}, the image config "
                                   f"says {diff_id}: refused")

        info = store.build_from_tar(stream=reader, source=source, check=check)  # type: ignore[arg-type]  # a reader
    store.cache_put(cache_key(diff_id), info.digest, f"pull {source}")
    return info.digest
