"""Where layer bytes come from when they are not on this host: the `Origin` contract.

An origin is a flat store of immutable blobs named by key (for a registry: `<repo>@sha256:<hex>`;
for a plain HTTP server or bucket: a path). It needs three things only, which both an OCI registry
(GET .../blobs/<digest> with Range) and an S3-compatible bucket or a static HTTP server with Range
support provide: stat, range read, list. Lazy loading (`shoal.lazy`) reads layers through it in
chunks and verifies every chunk against its `ChunkIndex`; pulls read whole blobs through it.

Errors: an origin that does not answer within its timeout, refuses, or fails raises
`OriginUnavailable` (retryable); a missing key raises `LayerNotFound`. Origins never log or return
credentials.
"""
from __future__ import annotations

import abc

from pydantic import BaseModel, Field

DEFAULT_TIMEOUT_S = 10.0  # a read that takes longer fails with OriginUnavailable


class BlobStat(BaseModel):
    key: str
    size: int = Field(ge=0)
    digest: str | None = Field(None, description="sha256:<hex> of the whole blob when the origin knows it")


class Origin(abc.ABC):
    """A read-only source of immutable blobs, addressed by key."""

    @abc.abstractmethod
    def stat(self, key: str) -> BlobStat:
        """Size (and digest when known) of one blob; LayerNotFound if there is none."""

    @abc.abstractmethod
    def read(self, key: str, offset: int, length: int) -> bytes:
        """Exactly `length` bytes from `offset` (fewer only at the end of the blob)."""

    def read_ranges(self, key: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        """Several (offset, length) ranges: one request where the origin can (a registry's multi-range
        GET), else one read each."""
        return [self.read(key, o, n) for o, n in ranges]

    multi_range = False  # whether read_ranges is one request

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Keys under `prefix` (an origin that cannot list, such as a registry, lists what it knows)."""

    def close(self) -> None:
        """Release connections."""
        return None

    def __enter__(self) -> Origin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
