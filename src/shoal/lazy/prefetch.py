"""Prefetch lists: which chunks of a layer the first run of an image read, in the order it read them
(what Nydus and SOCI record). Kept at `<root>/lazy/<hex>.prefetch.json` and, when an origin spec names
a `prefetch_key`, read from the origin too (published beside the layer by whoever pushed it).

The first time a host mounts a layer that has no list, the lazy daemon records first accesses for
`RECORD_WINDOW_S` seconds; later cold starts fetch the listed chunks in the background, in order,
while the sandbox already runs (demand reads never wait behind the prefetch: they fetch themselves,
and single-flight merges the two when they want the same chunk)."""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

RECORD_WINDOW_S = 60.0


def prefetch_path(root: Path, digest: str) -> Path:
    return Path(root) / "lazy" / f"{digest.split(':', 1)[1]}.prefetch.json"


def load(root: Path, digest: str) -> list[int] | None:
    try:
        data = json.loads(prefetch_path(root, digest).read_text())
    except (OSError, ValueError):
        return None
    chunks = data.get("chunks") if isinstance(data, dict) else None
    return [int(i) for i in chunks] if isinstance(chunks, list) else None


def dumps(digest: str, chunks: list[int]) -> bytes:
    """The prefetch list as the blob a push publishes beside the layer."""
    return json.dumps({"layer": digest, "chunks": chunks}).encode()


def parse(blob: bytes) -> list[int] | None:
    try:
        data = json.loads(blob)
        return [int(i) for i in data["chunks"]]
    except (ValueError, KeyError, TypeError):
        return None


def save(root: Path, digest: str, chunks: list[int]) -> None:
    p = prefetch_path(root, digest)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(dumps(digest, chunks))
    os.replace(tmp, p)


class Recorder:
    """Records the first access of each chunk while the window is open, saving as it goes."""

    def __init__(self, root: Path, digest: str, window_s: float = RECORD_WINDOW_S):
        self.root, self.digest = Path(root), digest
        self.deadline = time.monotonic() + window_s
        self.order: list[int] = []
        self._seen: set[int] = set()
        self._lock = threading.Lock()

    def saw(self, i: int) -> None:
        if i in self._seen or time.monotonic() > self.deadline:
            return
        with self._lock:
            if i in self._seen:
                return
            self._seen.add(i)
            self.order.append(i)
            save(self.root, self.digest, list(self.order))
