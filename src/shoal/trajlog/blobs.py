"""Blobs beside a trajectory log, stored by their SHA-256 digest (desktop screenshots).

A log entry keeps only the digest (`sha256:<hex>`); the bytes sit in a content-addressed directory
next to an SQLite log (`<log>.blobs/`), or where $SHOAL_TRAJ_BLOBS points (a PostgreSQL log: a
directory every worker shares). A blob is written (to a temp file, then renamed) before the entry
that names it completes, so a logged digest always has its bytes; the same screenshot twice is
stored once.
"""
from __future__ import annotations

import hashlib
import os
import re
import threading
from pathlib import Path

from ..core.errors import InvalidArgument

_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_open: dict[Path, BlobStore] = {}
_lock = threading.Lock()


class BlobStore:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, digest: str) -> Path:
        if not _DIGEST.fullmatch(digest):
            raise InvalidArgument(f"not a blob digest (sha256:<64 hex>): {digest[:80]!r}")
        h = digest[7:]
        return self.root / h[:2] / h

    def put(self, data: bytes) -> str:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        p = self._path(digest)
        if not p.exists():
            p.parent.mkdir(exist_ok=True)
            tmp = p.with_name(f".{p.name}.{os.getpid()}.{threading.get_ident()}")
            tmp.write_bytes(data)
            os.replace(tmp, p)
        return digest

    def get(self, digest: str) -> bytes:
        p = self._path(digest)
        try:
            data = p.read_bytes()
        except FileNotFoundError:
            raise InvalidArgument(f"blob {digest} is not in {self.root}") from None
        if "sha256:" + hashlib.sha256(data).hexdigest() != digest:  # a damaged file is not that blob
            raise InvalidArgument(f"blob {digest} in {self.root} does not match its digest")
        return data

    def has(self, digest: str) -> bool:
        return self._path(digest).exists()


def blobs_for(log: object) -> BlobStore:
    """The blob store of a `TrajectoryLog` (or its store): $SHOAL_TRAJ_BLOBS, else `<log file>.blobs`."""
    where = os.environ.get("SHOAL_TRAJ_BLOBS")
    if not where:
        store = getattr(log, "store", log)
        path = getattr(store, "path", None)
        if path is None:
            raise InvalidArgument("this trajectory log is not a file: set SHOAL_TRAJ_BLOBS to a directory for its "
                                  "blobs (screenshots)")
        where = str(Path(path).with_name(Path(path).name + ".blobs"))
    root = Path(where).resolve()
    with _lock:
        bs = _open.get(root)
        if bs is None:
            bs = _open[root] = BlobStore(root)
    return bs


def find(digest: str) -> bytes:
    """A blob from any store this process has opened (a policy resolving a screenshot it was shown)."""
    with _lock:
        stores = list(_open.values())
    for bs in stores:
        if bs.has(digest):
            return bs.get(digest)
    raise InvalidArgument(f"blob {digest} is in none of this process's blob stores")
