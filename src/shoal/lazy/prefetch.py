"""Prefetch lists: which chunks of a layer the first run of an image read, in the order it read them
(what Nydus and SOCI record). Kept at `<root>/lazy/<hex>.prefetch.json` and, when an origin spec names
a `prefetch_key`, read from the origin too (published beside the layer by whoever pushed it).

The first time a host mounts a layer that has no list, the lazy daemon records first accesses for
`RECORD_WINDOW_S` seconds; later cold starts fetch the listed chunks in the background, in order,
while the sandbox already runs (demand reads never wait behind the prefetch: they fetch themselves,
and single-flight merges the two when they want the same chunk).

**Start-up part.** The recording keeps going after the sandbox's first command (a relayout wants
everything a first run read), but the list also says how many of its chunks came before that first
command finished (`startup`): the host marks the moment (`mark_startup`, from `Host.exec`) and the
recorder notes it. A later cold start prefetches only that part (`to_fetch`); what the first run did
afterwards is that run's own work (an agent's git and grep, say), which another workload on the
same image would fetch for nothing. `SHOAL_LAZY_PREFETCH_STARTUP=0` prefetches the whole list.
The recorder also notes how many of its byte ranges came before the mark (`startup_ranges`):
`shoal push --relayout` lays those out first and says in the layer's descriptor where they end
(`io.shoal.layer.startup-bytes`), which a cold start with no list fetches at once (round 6)."""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

RECORD_WINDOW_S = 60.0


def prefetch_path(root: Path, digest: str) -> Path:
    return Path(root) / "lazy" / f"{digest.split(':', 1)[1]}.prefetch.json"


ABSENT_FRESH_S = 300.0


def absent_path(root: Path, digest: str) -> Path:
    return Path(root) / "lazy" / f"{digest.split(':', 1)[1]}.prefetch.absent"


def mark_absent(root: Path, digest: str) -> None:
    """The origin said just now that it has no published list for the layer (a lazy pull asked):
    the daemon need not ask it again while it opens the layer (a lookup per layer at mount time
    competed with the mounts' first chunks for the origin)."""
    p = absent_path(root, digest)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(b"")


def absent_recently(root: Path, digest: str, max_age_s: float = ABSENT_FRESH_S) -> bool:
    """Whether a lazy pull found no published list for the layer less than `max_age_s` ago."""
    try:
        return time.time() - absent_path(root, digest).stat().st_mtime < max_age_s
    except OSError:
        return False


def startup_path(root: Path, digest: str) -> Path:
    """The marker `mark_startup` leaves: the first command of a sandbox using the layer has finished."""
    return Path(root) / "lazy" / f"{digest.split(':', 1)[1]}.startup"


def mark_startup(root: Path, digests: list[str]) -> int:
    """The first command of a sandbox with these layers has finished: each layer of them that is
    recording a list (it has a list file and no marker yet) gets its marker. Returns how many."""
    n = 0
    for d in digests:
        if ":" not in d:
            continue
        m = startup_path(root, d)
        if prefetch_path(root, d).exists() and not m.exists():
            try:
                m.touch()
                n += 1
            except OSError:
                pass
    return n


def to_fetch(chunks: list[int] | None, startup: int | None) -> list[int] | None:
    """What a cold start prefetches of a list: its start-up part when it has one (and the
    environment does not say otherwise), else all of it."""
    if not chunks or not startup or os.environ.get("SHOAL_LAZY_PREFETCH_STARTUP", "1") == "0":
        return chunks
    return chunks[:startup]


def load(root: Path, digest: str) -> list[int] | None:
    try:
        data = json.loads(prefetch_path(root, digest).read_text())
    except (OSError, ValueError):
        return None
    chunks = data.get("chunks") if isinstance(data, dict) else None
    return [int(i) for i in chunks] if isinstance(chunks, list) else None


def dumps(digest: str, chunks: list[int], ranges: list[list[int]] | None = None, blob: str | None = None,
          startup: int | None = None, startup_ranges: int | None = None) -> bytes:
    """The prefetch list as the blob a push publishes beside the layer. `ranges`: the byte ranges
    ([offset, length], first-read order) behind the chunk numbers, and `blob` the EROFS blob they
    refer to: what `shoal push --relayout` orders a layer's image by (shoal.layers.relayout).
    `startup`: how many of `chunks` were read before the first command finished;
    `startup_ranges`: how many of `ranges` (what the relayout marks as the layer's start-up prefix)."""
    body: dict = {"layer": digest, "chunks": chunks}
    if ranges:
        body.update(ranges=ranges, blob=blob)
        if startup_ranges:
            body["startup_ranges"] = startup_ranges
    if startup:
        body["startup"] = startup
    return json.dumps(body).encode()


def parse_startup(blob: bytes) -> int | None:
    """The start-up part's length of a list that has one (a positive int), else None."""
    try:
        n = json.loads(blob).get("startup")
    except (ValueError, AttributeError):
        return None
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def parse_startup_ranges(blob: bytes) -> int | None:
    """How many of a list's byte ranges were read before the first command finished (a positive int
    when the list has ranges and the mark came while recording), else None."""
    try:
        n = json.loads(blob).get("startup_ranges")
    except (ValueError, AttributeError):
        return None
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def load_startup_ranges(root: Path, digest: str) -> int | None:
    """`parse_startup_ranges` of this root's list; when the layer was marked but its recorder never
    saw a new range after the mark (the run read nothing new after its first command), all of them."""
    try:
        body = prefetch_path(root, digest).read_bytes()
    except OSError:
        return None
    n = parse_startup_ranges(body)
    if n is None and startup_path(root, digest).exists():
        got = parse_ranges(body)
        n = len(got[1]) if got is not None and got[1] else None
    return n


def load_startup(root: Path, digest: str) -> int | None:
    try:
        return parse_startup(prefetch_path(root, digest).read_bytes())
    except OSError:
        return None


def parse(blob: bytes) -> list[int] | None:
    try:
        data = json.loads(blob)
        return [int(i) for i in data["chunks"]]
    except (ValueError, KeyError, TypeError):
        return None


def parse_ranges(blob: bytes) -> tuple[str, list[tuple[int, int]]] | None:
    """(blob digest, byte ranges in first-read order) of a list that has them, else None (how many
    of them are the start-up part: `parse_startup_ranges`)."""
    try:
        data = json.loads(blob)
        ranges = [(int(a), int(n)) for a, n in data["ranges"]]
        return str(data["blob"]), ranges
    except (ValueError, KeyError, TypeError):
        return None


def load_ranges(root: Path, digest: str) -> tuple[str, list[tuple[int, int]]] | None:
    try:
        return parse_ranges(prefetch_path(root, digest).read_bytes())
    except OSError:
        return None


def save(root: Path, digest: str, chunks: list[int], ranges: list[list[int]] | None = None,
         blob: str | None = None, startup: int | None = None, startup_ranges: int | None = None) -> None:
    p = prefetch_path(root, digest)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_bytes(dumps(digest, chunks, ranges, blob, startup, startup_ranges))
    os.replace(tmp, p)


class Recorder:
    """Records the first access of each chunk while the window is open, saving as it goes; and the
    byte ranges read (page-granular, first read order) when `blob` names the blob they refer to."""

    FLUSH_S = 0.5  # ranges that touch no new chunk are saved at most this late

    def __init__(self, root: Path, digest: str, window_s: float = RECORD_WINDOW_S, blob: str | None = None):
        self.root, self.digest, self.blob = Path(root), digest, blob
        self.deadline = time.monotonic() + window_s
        self.order: list[int] = []
        self.ranges: list[list[int]] = []
        self._seen: set[int] = set()
        self._pages: set[int] = set()
        self._lock = threading.Lock()
        self._flush: threading.Timer | None = None
        self.startup: int | None = None  # chunks seen before the first command finished (mark_startup)
        self.startup_ranges: int | None = None  # byte ranges read before it (the relayout's start-up prefix)
        self._marker = startup_path(self.root, digest)
        self._marker.unlink(missing_ok=True)  # a marker from an earlier recording is not this one's
        # new chunks are saved by a thread of their own, not by the reader that saw them: a save
        # (JSON + write + rename, ~0.3 ms) per new chunk sat on every miss of a cold start
        self._dirty = threading.Event()
        self._saver: threading.Thread | None = None
        self._save_lock = threading.Lock()  # one writer at a time, snapshots written in order

    def _save(self) -> None:
        with self._save_lock:
            with self._lock:
                snap = (list(self.order), [list(r) for r in self.ranges] if self.blob else None, self.startup,
                        self.startup_ranges)
            save(self.root, self.digest, snap[0], snap[1], self.blob, snap[2], snap[3])

    def _saving(self) -> None:
        """Save whenever something new was seen, until the window closes (then once more)."""
        while True:
            left = self.deadline - time.monotonic()
            if not self._dirty.wait(max(0.0, left) + 0.05):
                if left <= 0:
                    return
                continue
            self._dirty.clear()
            self._save()

    def flush(self) -> None:
        """Save what was seen now (tests; the saver thread does it within milliseconds anyway)."""
        self._save()

    def saw(self, i: int) -> None:
        if i in self._seen or time.monotonic() > self.deadline:
            return
        with self._lock:
            if i in self._seen:
                return
            if self.startup is None and self._marker.exists():  # the first new chunk after the mark
                self.startup = len(self.order)
            self._seen.add(i)
            self.order.append(i)
            if self._saver is None:
                self._saver = threading.Thread(target=self._saving, name="prefetch-saver", daemon=True)
                self._saver.start()
        self._dirty.set()

    def saw_range(self, offset: int, length: int) -> None:
        """A read of [offset, offset+length): kept if it reads a page no earlier read did."""
        if self.blob is None or length <= 0 or time.monotonic() > self.deadline:
            return
        pages = range(offset // 4096, (offset + length - 1) // 4096 + 1)
        with self._lock:
            if all(p in self._pages for p in pages):
                return
            self._pages.update(pages)
            marked = False
            if self.startup_ranges is None and self._marker.exists():  # the first new range after the mark
                self.startup_ranges = len(self.ranges)
                marked = True
            last = self.ranges[-1] if self.ranges else None
            if last is not None and last[0] + last[1] == offset and not marked:
                last[1] += length
            else:
                self.ranges.append([offset, length])
            if self._flush is None:  # saved by the next new chunk, or by this timer
                self._flush = threading.Timer(self.FLUSH_S, self._flushed)
                self._flush.daemon = True
                self._flush.start()

    def covers(self, offset: int, length: int) -> bool:
        """Whether nothing in [offset, offset+length) is left to record: every page read already, or
        the window closed. Until then reads there must come through Python (the C warm path records
        nothing), else a first run's list misses the pages of chunks a neighbour already fetched."""
        if self.blob is None or time.monotonic() > self.deadline:
            return True
        return all(p in self._pages for p in range(offset // 4096, (offset + length - 1) // 4096 + 1))

    def _flushed(self) -> None:
        with self._lock:
            self._flush = None
        self._save()
