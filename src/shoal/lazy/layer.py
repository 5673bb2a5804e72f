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
from pathlib import Path
from typing import Any

from ..core.errors import CorruptChunk, InvalidArgument, OriginUnavailable
from .cache import ChunkCache
from .chunks import ChunkIndex
from .origin import Origin
from .prefetch import Recorder
from .readahead import ChunkReadahead

_FACTORIES: dict[str, Callable[[dict], Origin]] = {}
# a prefetch read spans gaps of up to this many unlisted bytes between listed chunks (one request
# instead of two: per-request cost dominates small reads, see docs/lazy-loading.md)
PREFETCH_GAP_BYTES = int(os.environ.get("SHOAL_LAZY_PREFETCH_GAP_KB", "0")) << 10
# a prefetch batch's runs in one multi-range GET where the origin answers them (a registry does)
MULTI_RANGE = os.environ.get("SHOAL_LAZY_MULTI_RANGE", "1") != "0"


def reload_env() -> None:
    """Re-read the settings above (a daemon forked by the zygote takes its requester's environment)."""
    global PREFETCH_GAP_BYTES, MULTI_RANGE
    PREFETCH_GAP_BYTES = int(os.environ.get("SHOAL_LAZY_PREFETCH_GAP_KB", "0")) << 10
    MULTI_RANGE = os.environ.get("SHOAL_LAZY_MULTI_RANGE", "1") != "0"


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
        if recorder is not None and recorder.blob is None:  # its byte ranges refer to this blob
            recorder.blob = index.blob
        self.reads = 0
        self.readahead: ChunkReadahead | None = None  # set by the daemon for a layer without a list
        # a coalesced read fetches at most this many chunks (about 4 MiB)
        self.max_run = max(1, (4 << 20) // index.chunk_size)

    def _fetcher(self, i: int) -> Callable[[], bytes]:
        def fetch() -> bytes:
            off, length = self.index.span(i)
            return self.index.verify(i, self.origin.read(self.key, off, length))

        return fetch

    def fetch_run(self, first: int, last: int) -> list[memoryview]:
        """Chunks first..last in ONE range read (coalesced), cut into chunks, unverified (the cache
        verifies each against its own digest)."""
        off = self.index.span(first)[0]
        end = sum(self.index.span(last))
        data = memoryview(self.origin.read(self.key, off, end - off))
        out = []
        for i in range(first, last + 1):
            a, n = self.index.span(i)
            out.append(data[a - off:a - off + n])
        return out

    def fetch_runs(self, runs: list[tuple[int, int]]) -> list[list[memoryview]]:
        """Several runs (first, last) in ONE multi-range read (an origin that cannot: one read each)."""
        spans = [(self.index.span(a)[0], sum(self.index.span(b)) - self.index.span(a)[0]) for a, b in runs]
        datas = self.origin.read_ranges(self.key, spans)
        out = []
        for (a, b), (off, _), data in zip(runs, spans, datas):
            mv = memoryview(data)
            out.append([mv[self.index.span(i)[0] - off:sum(self.index.span(i)) - off] for i in range(a, b + 1)])
        return out

    def ensure_chunk(self, i: int) -> None:
        """Chunk i in the cache (fetched and verified if needed)."""
        self.cache.get(self.index.chunks[i], self._fetcher(i))

    def ensure_chunks(self, numbers: list[int]) -> int:
        """Chunks `numbers` (ascending) in the cache, runs of consecutive ones fetched coalesced;
        returns how many were fetched now."""
        got = self.cache.get_many([(i, self.index.chunks[i]) for i in numbers], self.fetch_run, self.max_run,
                                  self.fetch_runs if self.origin.multi_range else None)
        return sum(1 for v in got.values() if not isinstance(v, Path))

    def read(self, offset: int, length: int) -> bytes:
        """Bytes [offset, offset+length) of the blob (short at its end). Missing chunks of the range
        are fetched with one coalesced range read. Raises OriginUnavailable or CorruptChunk when a
        chunk it needs cannot be had."""
        self.reads += 1
        end = min(self.index.size, offset + length)
        numbers = self.index.chunks_for(offset, length)
        if self.recorder is not None:
            self.recorder.saw_range(offset, end - offset)
            for i in numbers:
                self.recorder.saw(i)
        ra = self.readahead
        if ra is not None:  # started before this read waits for its own chunks: the two fetches overlap
            ra.note(numbers)
        if len(numbers) == 1:  # the warm path: one verified chunk, read through its open descriptor
            start = numbers[0] * self.index.chunk_size
            data = self.cache.pread_cached(self.index.chunks[numbers[0]], offset - start, end - offset)
            if data is not None and len(data) == end - offset:
                return data
        # runs split by chunks cached in between: one multi-range request, not one round trip each
        many = self.fetch_runs if MULTI_RANGE and self.origin.multi_range else None
        got = self.cache.get_many([(i, self.index.chunks[i]) for i in numbers], self.fetch_run, self.max_run, many)
        parts: list[bytes | memoryview] = []
        for i in numbers:
            start, clen = self.index.span(i)
            lo, hi = max(offset, start) - start, min(end, start + clen) - start
            src = got[i]
            if isinstance(src, Path):
                parts.append(self.cache.read(self.index.chunks[i], lo, hi - lo, self._fetcher(i)))
            else:
                parts.append(src[lo:hi])
        return parts[0] if len(parts) == 1 and isinstance(parts[0], bytes) else b"".join(parts)

    def cached_chunks(self) -> int:
        return sum(1 for c in set(self.index.chunks) if self.cache.has(c))

    def missing_chunks(self) -> list[int]:
        return [i for i, c in enumerate(self.index.chunks) if not self.cache.has(c)]


def _batch_sizes(n: int, batch: int, first: int) -> list[int]:
    """Batch sizes covering n chunks: `first`, doubling up to `batch`, then `batch` each."""
    out, size, left = [], max(1, min(first, batch)), n
    while left > 0:
        out.append(min(size, left))
        left -= size
        size = min(batch, size * 2)
    return out


def _batches(order: list[int], batch: int, max_run: int, gap: int = 0,
             first: int | None = None) -> list[list[list[int]]]:
    """The prefetch list in batches (`first` chunks, doubling up to `batch`), each sorted and cut
    into runs (one coalesced read each): the list's order between batches, locality within one.
    Listed chunks at most `gap` chunks apart share a run, the unlisted ones between them included
    (fewer requests, more bytes). Small first batches: what the mount and the first exec read first
    arrives first (a read waiting for a chunk of a batch in flight waits for its whole batch)."""
    out: list[list[list[int]]] = []
    b = 0
    for size in _batch_sizes(len(order), batch, first or batch):
        runs: list[list[int]] = []
        run: list[int] = []
        for i in sorted(set(order[b:b + size])):
            if run and (i - run[-1] > gap + 1 or i - run[0] >= max_run):
                runs.append(run)
                run = []
            run.extend(range(run[-1] + 1, i + 1) if run else [i])
        if run:
            runs.append(run)
        out.append(runs)
        b += size
    return out


def prefetch_chunks(layer: LazyLayer, order: list[int], stop: threading.Event | None = None,
                    on_error: Callable[[int, Exception], None] | None = None, workers: int = 4,
                    batch: int | None = None, first_batch: int | None = None) -> int:
    """Fetch chunks in `order` (the prefetch list) unless cached; returns how many it fetched.
    Consecutive chunks go in one coalesced read, `workers` reads at once; from an origin that
    answers multi-range reads, each batch's runs in one request. Batches grow from `first_batch`
    chunks (default ~1 MiB) to `batch` (default ~16 MiB). Stops at the first origin failure (demand
    reads still try the origin themselves)."""
    from concurrent.futures import ThreadPoolExecutor

    wanted = [i for i in order if 0 <= i < len(layer.index.chunks)]
    wanted = [i for i in dict.fromkeys(wanted) if not layer.cache.has(layer.index.chunks[i])]
    failed = threading.Event()
    lock = threading.Lock()
    fetched = 0

    def one(run: list[int]) -> None:
        nonlocal fetched
        if failed.is_set() or (stop is not None and stop.is_set()):
            return
        try:
            n = layer.ensure_chunks(run)
        except (OriginUnavailable, CorruptChunk, OSError) as e:
            if not failed.is_set():
                failed.set()
                if on_error is not None:
                    on_error(run[0], e)
            return
        with lock:
            fetched += n

    gap = PREFETCH_GAP_BYTES // layer.index.chunk_size
    size = batch or max(1, (16 << 20) // layer.index.chunk_size)
    first = first_batch or (size if batch else max(1, (1 << 20) // layer.index.chunk_size))
    batches = _batches(wanted, size, layer.max_run, gap, first)
    if layer.origin.multi_range and MULTI_RANGE:  # a batch's runs in one multi-range request
        runs = [[i for run in b for i in run] for b in batches if b]
    else:
        runs = [run for b in batches for run in b]
    if workers <= 1:
        for run in runs:
            one(run)
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="prefetch") as ex:
            list(ex.map(one, runs))
    return fetched


def promote(store: Any, digest: str, layer: LazyLayer) -> Path | None:
    """Assemble a lazy layer whose chunks are all cached into the store's image file
    (`store.image_path(digest)`), verified against the layer's blob digest before it is renamed into
    place. Returns the path, or None when a chunk is missing (nothing is written then)."""
    import hashlib

    target = Path(store.image_path(digest))
    if target.exists():
        return target
    if layer.missing_chunks():
        return None
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.promote")
    whole = hashlib.sha256()
    try:
        with open(tmp, "wb") as out:
            for i, sha in enumerate(layer.index.chunks):
                try:
                    with open(layer.cache.path(sha), "rb") as f:
                        data = f.read()
                except FileNotFoundError:  # evicted meanwhile
                    return None
                if len(data) != layer.index.span(i)[1] or hashlib.sha256(data).hexdigest() != sha:
                    raise CorruptChunk(f"cached chunk {i} of layer {digest} is damaged")
                whole.update(data)
                out.write(data)
        if f"sha256:{whole.hexdigest()}" != layer.index.blob:
            raise CorruptChunk(f"the chunks of layer {digest} do not make its blob {layer.index.blob}")
        os.chmod(tmp, 0o444)
        os.replace(tmp, target)
        return target
    finally:
        tmp.unlink(missing_ok=True)


def chunk_cache_for(root: os.PathLike | str, cap_bytes: int | None = None,
                    pinned: Callable[[], set[str]] | None = None) -> ChunkCache:
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
