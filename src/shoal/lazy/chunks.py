"""A layer cut into chunks, each with its own digest: what lets a host use a chunk the moment it
arrives instead of after the whole blob. The index is a small JSON blob published beside the layer
(media type `CHUNK_INDEX_MEDIA_TYPE`); a chunk whose bytes do not hash to its entry is never used
or cached (`CorruptChunk`)."""
from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel, Field, model_validator

from ..core.errors import CorruptChunk

CHUNK_SIZE = 1 << 20  # 1 MiB: DSec/Nydus-scale chunks; a cold read fetches at most this much extra
# what `shoal push` indexes registry layers with: 128 KiB fetches a third of the bytes 1 MiB does for
# an agent's first run; adjacent missing chunks still go in one coalesced Range read, and a published
# prefetch list hides the extra round trips (measured: docs/lazy-loading.md)
REGISTRY_CHUNK_SIZE = 128 << 10
LAYER_MEDIA_TYPE = "application/vnd.shoal.layer.v1.erofs"
CHUNK_INDEX_MEDIA_TYPE = "application/vnd.shoal.layer.v1.chunks+json"


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class ChunkIndex(BaseModel):
    """Per-chunk sha256 of one layer blob (the layer's EROFS image, byte for byte)."""

    layer: str = Field(description="the Shoal layer digest (sha256:<hex> of the tree)")
    blob: str = Field(description="sha256:<hex> of the whole EROFS image")
    size: int = Field(ge=0, description="bytes of the EROFS image")
    chunk_size: int = Field(CHUNK_SIZE, gt=0)
    chunks: list[str] = Field(description="sha256 hex of each chunk, in order")

    @model_validator(mode="after")
    def _count(self) -> ChunkIndex:
        want = -(-self.size // self.chunk_size)
        if len(self.chunks) != want:
            raise ValueError(f"{self.size} bytes in chunks of {self.chunk_size} make {want} chunks, "
                             f"the index lists {len(self.chunks)}")
        return self

    def span(self, i: int) -> tuple[int, int]:
        """(offset, length) of chunk i."""
        off = i * self.chunk_size
        return off, min(self.chunk_size, self.size - off)

    def chunks_for(self, offset: int, length: int) -> range:
        """The chunks a read of [offset, offset+length) touches."""
        if length <= 0 or offset >= self.size:
            return range(0)
        end = min(self.size, offset + length)
        return range(offset // self.chunk_size, (end - 1) // self.chunk_size + 1)

    def verify(self, i: int, data: bytes) -> bytes:
        """`data` if it is chunk i, else CorruptChunk (nothing is kept)."""
        _, length = self.span(i)
        if len(data) != length or sha256_hex(data) != self.chunks[i]:
            raise CorruptChunk(f"chunk {i} of layer {self.layer} does not match its digest "
                               f"({len(data)} bytes, want {length})")
        return data


def _blocks(path: Path, chunk_size: int) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while block := f.read(chunk_size):
            yield block


def build_index(layer: str, image: str | os.PathLike, chunk_size: int = CHUNK_SIZE) -> ChunkIndex:
    """The chunk index of a local layer's EROFS image file."""
    path = Path(image)
    whole = hashlib.sha256()
    chunks = []
    for block in _blocks(path, chunk_size):
        whole.update(block)
        chunks.append(sha256_hex(block))
    return ChunkIndex(layer=layer, blob=f"sha256:{whole.hexdigest()}", size=path.stat().st_size,
                      chunk_size=chunk_size, chunks=chunks)
