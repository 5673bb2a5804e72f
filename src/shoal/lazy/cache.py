"""The host-wide chunk cache: content-addressed by chunk sha256, shared by every lazy layer and
sandbox under one Shoal root (`<root>/chunks/<2 hex>/<64 hex>`).

- **Verified**: a chunk is written only after its bytes hash to the name it is stored under (the
  entry of a `ChunkIndex`), by a temp file and an atomic rename, so a bad or half-written chunk is
  never kept. A chunk file is hashed again the first time each process uses it.
- **Single-flight**: a chunk being fetched is waited for, never fetched twice: in a process by a
  future per chunk, across processes by an flock on `chunks/.locks/<hex>` (re-checked after taking it).
- **Size cap, LRU**: the mtime of a chunk file is its last use (refreshed at most once a minute);
  when the cache grows past `cap_bytes` the least recently used chunks go first, those of layers
  that are not mounted before those of mounted ones (`pinned`). A chunk evicted under a live
  layer is fetched again (and verified) on its next use: eviction costs a re-fetch, never a wrong byte.
- `gc(keep)` (run by `shoal gc`) removes every chunk not in `keep` (the chunks of mounted lazy layers).
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from pathlib import Path

from ..core.errors import CorruptChunk

DEFAULT_CAP_BYTES = 20 << 30
_TOUCH_EVERY_S = 60.0
_FDS = 512


def _hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


class ChunkCache:
    def __init__(self, directory: Path, cap_bytes: int = DEFAULT_CAP_BYTES,
                 pinned: Callable[[], set[str]] | None = None):
        self.dir = Path(directory)
        self.cap_bytes = cap_bytes
        self.pinned = pinned or (lambda: set())
        (self.dir / ".locks").mkdir(parents=True, exist_ok=True)
        (self.dir / ".tmp").mkdir(exist_ok=True)
        self._lock = threading.Lock()
        self._inflight: dict[str, Future[Path]] = {}
        self._verified: set[str] = set()
        self._touched: dict[str, float] = {}
        self._bytes: int | None = None
        self.fetches = 0  # chunks this process fetched from an origin (tests, bench)
        self.fetched_bytes = 0
        self.requests = 0  # origin reads of coalesced runs (get_many)
        self._fds: dict[str, int] = {}  # open chunk files of the warm path (pread_cached), LRU order

    def path(self, sha: str) -> Path:
        return self.dir / sha[:2] / sha

    def has(self, sha: str) -> bool:
        return self.path(sha).exists()

    # ------------------------------------------------------------------ get
    def get(self, sha: str, fetch: Callable[[], bytes]) -> Path:
        """The path of chunk `sha`, fetching it with `fetch` (whose bytes must hash to `sha`) if the
        cache lacks it. Concurrent callers for one chunk share one fetch. Raises what `fetch` raises,
        or CorruptChunk (nothing is kept then)."""
        p = self.path(sha)
        if sha in self._verified and os.path.exists(p):
            self._touch(sha, p)
            return p
        with self._lock:
            fut = self._inflight.get(sha)
            leader = fut is None
            if leader:
                fut = self._inflight[sha] = Future()
        assert fut is not None
        if not leader:
            return fut.result()
        try:
            path = self._get_locked(sha, fetch)
            fut.set_result(path)
            return path
        except BaseException as e:
            fut.set_exception(e)
            raise
        finally:
            with self._lock:
                self._inflight.pop(sha, None)

    def _get_locked(self, sha: str, fetch: Callable[[], bytes]) -> Path:
        p = self.path(sha)
        fd = os.open(self.dir / ".locks" / sha, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # another process fetching it: wait (bounded by its timeout)
            if p.exists():
                if _hash_file(p) == sha:
                    self._verified.add(sha)
                    self._touch(sha, p, force=True)
                    return p
                p.unlink(missing_ok=True)  # damaged on disk: fetch again
            data = fetch()
            if hashlib.sha256(data).hexdigest() != sha:
                raise CorruptChunk(f"chunk {sha[:16]}: {len(data)} bytes from the origin do not hash to it")
            self._store(sha, p, data)
            self.fetches += 1
            self.fetched_bytes += len(data)
            return p
        finally:
            os.close(fd)  # the lock file stays: unlinking it would let two holders lock two inodes

    # ------------------------------------------------------------------ coalesced fetches
    def get_many(self, items: Sequence[tuple[int, str]],
                 fetch_run: Callable[[int, int], Sequence[bytes | memoryview]],
                 max_run: int = 64,
                 fetch_runs: Callable[[list[tuple[int, int]]], Sequence[Sequence[bytes | memoryview]]] | None = None,
                 ) -> dict[int, Path | bytes | memoryview]:
        """Chunks `items` ((chunk number, sha256) of one layer, ascending numbers), fetching the missing
        ones with ONE `fetch_run(first, last)` per run of consecutive numbers (at most `max_run`
        chunks): a coalesced Range read that returns the bytes of chunks first..last, one item each.

        Every chunk is still verified on its own (a corrupt chunk in a run is rejected and never
        kept; its good neighbours are kept), and single-flight still holds per chunk: a chunk another
        thread is fetching is waited for, one another process holds the lock of is fetched by that
        process. `fetch_runs`, when given, fetches several runs in one request (a multi-range read).
        Returns number -> the chunk's path (cached) or its verified bytes (fetched now).
        Raises (after settling every chunk) the first OriginUnavailable / CorruptChunk it met."""
        out: dict[int, Path | bytes | memoryview] = {}
        todo: list[tuple[int, str]] = []
        for i, sha in items:
            p = self.path(sha)
            if sha in self._verified and os.path.exists(p):
                self._touch(sha, p)
                out[i] = p
            else:
                todo.append((i, sha))
        if not todo:
            return out
        mine: dict[str, Future[Path]] = {}
        waits: list[tuple[int, Future[Path]]] = []
        claimed: list[tuple[int, str]] = []
        with self._lock:
            for i, sha in todo:
                if sha in mine:
                    waits.append((i, mine[sha]))
                elif sha in self._inflight:
                    waits.append((i, self._inflight[sha]))
                else:
                    fut = mine[sha] = self._inflight[sha] = Future()
                    claimed.append((i, sha))
        first_error: BaseException | None = None
        locks: dict[str, int] = {}
        blocked: list[tuple[int, str]] = []
        runs: list[list[tuple[int, str]]] = []
        try:
            for i, sha in claimed:
                fd = os.open(self.dir / ".locks" / sha, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:  # another process fetches it: wait for that one below
                    os.close(fd)
                    blocked.append((i, sha))
                    continue
                locks[sha] = fd
                p = self.path(sha)
                if p.exists():
                    if _hash_file(p) == sha:
                        self._verified.add(sha)
                        self._touch(sha, p, force=True)
                        out[i] = p
                        mine[sha].set_result(p)
                        continue
                    p.unlink(missing_ok=True)
                if runs and runs[-1][-1][0] == i - 1 and len(runs[-1]) < max_run:
                    runs[-1].append((i, sha))
                else:
                    runs.append([(i, sha)])
            fetched: list[Sequence[bytes | memoryview] | BaseException] = []
            if fetch_runs is not None and len(runs) > 1:
                try:
                    fetched = list(fetch_runs([(run[0][0], run[-1][0]) for run in runs]))
                    self.requests += 1
                except BaseException as e:
                    fetched = [e] * len(runs)
            for n, run in enumerate(runs):
                try:
                    got = fetched[n] if fetched else fetch_run(run[0][0], run[-1][0])
                    if isinstance(got, BaseException):
                        raise got
                    parts = got
                    if not fetched:
                        self.requests += 1
                except BaseException as e:
                    first_error = first_error or e
                    for _, sha in run:
                        if not mine[sha].done():
                            mine[sha].set_exception(e)
                    continue
                for k, (i, sha) in enumerate(run):
                    data = parts[k] if k < len(parts) else b""
                    if hashlib.sha256(data).hexdigest() != sha:
                        err = CorruptChunk(f"chunk {sha[:16]}: {len(data)} bytes from the origin do not hash to it")
                        first_error = first_error or err
                        mine[sha].set_exception(err)
                        continue
                    p = self.path(sha)
                    self._store(sha, p, data)
                    self.fetches += 1
                    self.fetched_bytes += len(data)
                    out[i] = data
                    mine[sha].set_result(p)
        finally:
            for fd in locks.values():
                os.close(fd)
            for i, sha in blocked:  # the other process's fetch: take its lock (blocking), use its chunk
                try:
                    path = self._get_locked(sha, lambda i=i: bytes(fetch_run(i, i)[0]))  # type: ignore[misc]  # default arg binds i
                    out[i] = path
                    mine[sha].set_result(path)
                except BaseException as e:
                    first_error = first_error or e
                    mine[sha].set_exception(e)
            with self._lock:
                for sha, fut in mine.items():
                    if not fut.done():  # an exception escaped above
                        fut.set_exception(first_error or OSError("chunk fetch abandoned"))
                    if self._inflight.get(sha) is fut:
                        del self._inflight[sha]
        for i, fut in waits:
            try:
                out[i] = fut.result()
            except BaseException as e:
                first_error = first_error or e
        if first_error is not None:
            raise first_error
        return out

    def _store(self, sha: str, p: Path, data: bytes | memoryview) -> None:
        p.parent.mkdir(exist_ok=True)
        tmp = self.dir / ".tmp" / f"{sha}.{os.getpid()}.{threading.get_ident()}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o444)
        os.replace(tmp, p)
        self._verified.add(sha)
        self._touched[sha] = time.time()
        with self._lock:
            if self._bytes is not None:
                self._bytes += len(data)
        if self.usage()[1] > self.cap_bytes:
            self.evict_to(int(self.cap_bytes * 0.9))

    def _touch(self, sha: str, p: Path, force: bool = False) -> None:
        now = time.time()
        if force or now - self._touched.get(sha, 0) > _TOUCH_EVERY_S:
            self._touched[sha] = now
            try:
                os.utime(p)
            except OSError:
                pass

    def verified(self, sha: str) -> bool:
        """Whether this process has verified chunk `sha` (fetched it, or hashed its file)."""
        return sha in self._verified

    def pread_cached(self, sha: str, offset: int, length: int) -> bytes | None:
        """The warm path: bytes of a chunk this process has verified, through an open file descriptor
        kept for it (no path lookup per read; at most `_FDS` kept, least recently used closed first),
        None when the chunk is not verified here yet (or was evicted)."""
        if sha not in self._verified:
            return None
        with self._lock:
            fd = self._fds.pop(sha, None)
            if fd is not None:
                self._fds[sha] = fd  # most recently used last
        if fd is None:
            try:
                fd = os.open(self.path(sha), os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                self._verified.discard(sha)
                return None
            with self._lock:
                if sha in self._fds:
                    os.close(fd)
                    fd = self._fds[sha]
                else:
                    self._fds[sha] = fd
                    while len(self._fds) > _FDS:
                        os.close(self._fds.pop(next(iter(self._fds))))
        try:
            return os.pread(fd, length, offset)
        except OSError:  # closed by the LRU meanwhile: the slow path
            return None

    def read(self, sha: str, offset: int, length: int, fetch: Callable[[], bytes]) -> bytes:
        """`length` bytes at `offset` inside chunk `sha`."""
        p = self.get(sha, fetch)
        try:
            fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:  # evicted between get and open: once more
            fd = os.open(self.get(sha, fetch), os.O_RDONLY | os.O_CLOEXEC)
        try:
            return os.pread(fd, length, offset)
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ size, eviction
    def _entries(self) -> list[tuple[float, int, str, Path]]:
        out = []
        for sub in self.dir.iterdir():
            if len(sub.name) != 2 or not sub.is_dir():
                continue
            for e in os.scandir(sub):
                try:
                    st = e.stat()
                except FileNotFoundError:
                    continue
                out.append((st.st_mtime, st.st_size, e.name, Path(e.path)))
        return out

    def usage(self) -> tuple[int, int]:
        """(chunks, bytes) in the cache (bytes counted once per process, then kept up to date)."""
        if self._bytes is None:
            entries = self._entries()
            self._bytes = sum(e[1] for e in entries)
            return len(entries), self._bytes
        return -1, self._bytes

    def chunks(self) -> set[str]:
        return {e[2] for e in self._entries()}

    def evict_to(self, target_bytes: int) -> int:
        """Remove least recently used chunks until the cache holds at most `target_bytes`; chunks of
        unpinned layers first. Returns the number of chunks removed."""
        entries = self._entries()
        total = sum(e[1] for e in entries)
        pinned = self.pinned() if total > target_bytes else set()
        order = sorted(entries, key=lambda e: (e[2] in pinned, e[0]))
        removed = 0
        for _, size, sha, path in order:
            if total <= target_bytes:
                break
            if self._remove(sha, path):
                total -= size
                removed += 1
        self._bytes = total
        return removed

    def gc(self, keep: Iterable[str]) -> dict:
        """Remove every chunk not in `keep`; returns {"chunks_evicted", "bytes_evicted"}."""
        keep = set(keep)
        n = freed = 0
        for _, size, sha, path in self._entries():
            if sha not in keep and self._remove(sha, path):
                n += 1
                freed += size
        for stale in [*(self.dir / ".tmp").iterdir(), *(self.dir / ".locks").iterdir()]:
            try:
                if stale.name not in keep and time.time() - stale.stat().st_mtime > 600:
                    stale.unlink(missing_ok=True)
            except FileNotFoundError:
                pass  # a fetch in flight renamed it into place (or ended) between the listing and the stat
        self._bytes = None
        return {"chunks_evicted": n, "bytes_evicted": freed}

    def _remove(self, sha: str, path: Path) -> bool:
        # under the chunk's lock, so a fetch in flight in another process is not raced
        fd = os.open(self.dir / ".locks" / sha, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            path.unlink(missing_ok=True)
            self._verified.discard(sha)
            with self._lock:
                kept = self._fds.pop(sha, None)
            if kept is not None:
                os.close(kept)
            return True
        finally:
            os.close(fd)
