"""The lazy-layer daemon: one per Shoal root, serving `<root>/lazyfs/<hex>.erofs` over FUSE.

Each file is a lazy layer's EROFS image, read through the chunk cache; the layer store mounts it
file-backed at `<root>/mnt/<hex>` like any local layer (`shoal.lazy.mount`), so sandboxes see no
difference. A read whose chunk cannot be fetched or verified in time answers EIO to the reader (the
kernel does not cache the failure: the next read tries again).

Run by `mount.ensure_daemon` as `python -m shoal.lazy.daemon --root ROOT` (detached, log in
`<root>/lazy/daemon.log`); it exits when its mount goes away (`shoal gc` once no lazy layer is
mounted) or on SIGTERM.
"""
from __future__ import annotations

import argparse
import errno
import logging
import os
import re
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..config import load_settings
from ..core.errors import ShoalError
from ..layers.store import LayerStore
from . import layer as layer_mod
from . import prefetch, readahead
from .cache import ChunkCache
from .fuse import FuseServer
from .layer import LazyLayer, chunk_cache_for, open_origin, prefetch_chunks, promote, spec_key
from .readahead import ChunkReadahead

log = logging.getLogger("shoal.lazy.daemon")
READAHEAD_KB = 1024
_TRACE = os.environ.get("SHOAL_LAZY_TRACE") == "1"  # a log line per FUSE read (profiling)
PREFETCH_WORKERS = int(os.environ.get("SHOAL_LAZY_PREFETCH_WORKERS", "4"))
_NAME = re.compile(r"^([0-9a-f]{64})\.erofs$")


class LayerFiles:
    """The FUSE file source: one file per lazy layer registered in the root's layer store."""

    def __init__(self, root: Path, threads_note: str = ""):
        self.root = root
        self.store = LayerStore(load_settings(root))
        self.cache: ChunkCache = chunk_cache_for(root, pinned=self._pinned)
        self.layers: dict[str, LazyLayer] = {}
        self._lock = threading.Lock()
        self.stop = threading.Event()
        self.promoted: set[str] = set()
        self.promote = os.environ.get("SHOAL_LAZY_PROMOTE", "1") != "0"
        self.complete = os.environ.get("SHOAL_LAZY_COMPLETE", "0") == "1"
        self._checked: dict[str, float] = {}
        # the C fast path's chunk descriptors (by chunk sha256): open for the daemon's life, so a
        # descriptor the C code holds is never closed or reused under it (fastread.c)
        self._fast_fds: dict[str, int] = {}
        self._fast_max = _fd_budget()
        self._ra_pool: ThreadPoolExecutor | None = None  # read-ahead fetches of layers without a list

    def _readahead_for(self, name: str, layer: LazyLayer) -> ChunkReadahead | None:
        """Read-ahead on first touches (shoal.lazy.readahead) for a layer with no prefetch list."""
        if self._ra_pool is None:
            self._ra_pool = ThreadPoolExecutor(4, thread_name_prefix="readahead")
        return readahead.for_layer(layer, self._ra_pool, name=name)

    def _pinned(self) -> set[str]:
        return {c for layer in list(self.layers.values()) for c in layer.index.chunks}

    def _layer(self, name: str) -> LazyLayer | None:
        m = _NAME.match(name)
        if not m:
            return None
        with self._lock:
            if name in self.layers:
                return self.layers[name]
            digest = f"sha256:{m.group(1)}"
            rec = self.store.lazy_layer(digest)
            if rec is None:
                return None
            index, spec = rec
            origin = open_origin(spec)
            order = prefetch.load(self.root, digest)  # a lazy pull fetched it already, if published
            order = prefetch.to_fetch(order, prefetch.load_startup(self.root, digest))  # its start-up part
            # recording until a published list turns up (the origin is asked in the background, not
            # here: a lookup answers at once, the mount of the layer does not wait for the registry)
            recorder = None if order else prefetch.Recorder(self.root, digest)
            layer = LazyLayer(index, origin, spec_key(spec), self.cache, recorder)
            prefix: list[int] = []
            if not order:
                layer.readahead = self._readahead_for(name, layer)
                prefix = layout_prefix(index.size, index.chunk_size, spec)
            self.layers[name] = layer
            log.info("layer %s: %d chunks, %s%s", digest[:19], len(index.chunks),
                     f"prefetching {len(order)}" if order else "recording a prefetch list",
                     f", its start-up prefix: {len(prefix)} chunks" if prefix else "")
            threading.Thread(target=self._background, args=(name, digest, layer, order, spec, prefix),
                             daemon=True).start()
            return layer

    def _published_list(self, digest: str, layer: LazyLayer, spec: dict) -> list[int] | None:
        key = spec.get("prefetch_key")
        if not isinstance(key, str):
            return None
        try:
            size = layer.origin.stat(key).size
            body = layer.origin.read(key, 0, size)
        except ShoalError:
            return None
        order, startup = prefetch.parse(body), prefetch.parse_startup(body)
        if order:  # kept here too: a restarted daemon does not ask again
            prefetch.save(self.root, digest, order, startup=startup)
            order = prefetch.to_fetch(order, startup) or []
            layer.recorder = None
            layer.readahead = None  # the list says what to fetch
            log.info("layer %s: prefetching %d chunks (published list)", digest[:19], len(order))
        return order

    def _background(self, name: str, digest: str, layer: LazyLayer, order: list[int] | None, spec: dict,
                    prefix: list[int] | None = None) -> None:
        """The prefetch list (found here, else asked from the origin; coalesced, `PREFETCH_WORKERS`
        reads at once), or with no list the layer's start-up prefix (`layout_prefix`); then, only
        when SHOAL_LAZY_COMPLETE=1, the rest of the layer at low priority (one read at a time); then,
        once every chunk is here, the layer's promotion to a local image."""
        if not order and not prefetch.absent_recently(self.root, digest):  # a pull just asked: none
            order = self._published_list(digest, layer, spec)
        first = None
        if not order and prefix:  # no list: what the layout says a start-up reads (still recording)
            order, first = prefix, 1  # the superblock's chunk alone first: the mount waits for it
        if order:
            n = prefetch_chunks(layer, order, self.stop, workers=PREFETCH_WORKERS, first_batch=first,
                                on_error=lambda i, e: log.warning("%s: prefetch stopped at chunk %d: %s", name, i, e))
            log.info("%s: prefetched %d chunks", name, n)
        if self.complete and not self.stop.is_set():
            rest = layer.missing_chunks()
            n = prefetch_chunks(layer, rest, self.stop, workers=1, batch=len(rest) or 1,
                                on_error=lambda i, e: log.warning("%s: completion stopped at chunk %d: %s", name, i, e))
            log.info("%s: completed the layer (%d chunks fetched)", name, n)
        self.maybe_promote(digest, layer)

    def maybe_promote(self, digest: str, layer: LazyLayer) -> bool:
        """Once every chunk of a layer is cached: its EROFS image assembled into the store's
        `layers/<hex>.erofs`, checked against the blob digest (so against every chunk too). New
        sandboxes then mount that local file (`LayerStore.ensure_mounted`); the ones already running
        keep reading through this daemon until they end."""
        if digest in self.promoted or not self.promote:
            return False
        with self._lock:
            if digest in self.promoted:
                return False
            try:
                path = promote(self.store, digest, layer)
            except (OSError, ShoalError) as e:
                log.warning("layer %s: not promoted: %s", digest[:19], e)
                return False
            if path is None:
                return False
            self.promoted.add(digest)
        log.info("layer %s: every chunk cached: promoted to %s", digest[:19], path)
        return True

    def lookup(self, name: str) -> int | None:
        layer = self._layer(name)
        return None if layer is None else layer.index.size

    def chunk_size(self, name: str) -> int | None:
        layer = self._layer(name)
        return None if layer is None else layer.index.chunk_size

    def chunk_fds(self, name: str, offset: int, size: int) -> list[tuple[int, int]]:
        layer = self.layers.get(name)
        if layer is None or size <= 0:
            return []
        out = []
        rec = layer.recorder
        for i in layer.index.chunks_for(offset, size):
            if rec is not None and not rec.covers(*layer.index.span(i)):
                continue  # pages of it not read yet: their first reads are recorded in Python
            sha = layer.index.chunks[i]
            fd = self._fast_fds.get(sha)
            if fd is None:
                if not self.cache.verified(sha) or len(self._fast_fds) >= self._fast_max:
                    continue
                try:
                    fd = os.open(self.cache.path(sha), os.O_RDONLY | os.O_CLOEXEC)
                except OSError:
                    continue
                with self._lock:
                    kept = self._fast_fds.setdefault(sha, fd)
                if kept != fd:
                    os.close(fd)
                    fd = kept
            out.append((i, fd))
        return out

    def names(self) -> list[str]:
        return [f"{d.split(':', 1)[1]}.erofs" for d in self.store.lazy_digests()]

    def read(self, name: str, offset: int, size: int) -> bytes:
        layer = self._layer(name)
        if layer is None:
            raise OSError(errno.ENOENT, name)
        before = self.cache.fetches
        t0 = time.monotonic() if _TRACE else 0.0
        try:
            data = layer.read(offset, size)
            if _TRACE:
                ra = layer.readahead
                log.info("read %s %d+%d: %.1f ms, %d fetched%s", name[:12], offset, size,
                         (time.monotonic() - t0) * 1000, self.cache.fetches - before,
                         f" (read-ahead {ra.requests} reads, {ra.chunks} chunks)" if ra else "")
        except ShoalError as e:  # OriginUnavailable, CorruptChunk, LayerNotFound: the reader gets EIO
            log.warning("%s: read of %d bytes at %d failed: %s", name, size, offset, e)
            raise OSError(errno.EIO, str(e)) from None
        if self.cache.fetches != before and self.promote:
            digest = f"sha256:{name[:64]}"
            now = time.monotonic()
            if digest not in self.promoted and now - self._checked.get(digest, 0) > 1.0:
                self._checked[digest] = now
                if not layer.missing_chunks():
                    threading.Thread(target=self.maybe_promote, args=(digest, layer), daemon=True).start()
        return data


def layout_prefix(size: int, chunk_size: int, spec: dict) -> list[int]:
    """The chunks of a layer's start-up prefix: the bytes at the start of a layer pushed laid out by
    first read that held what the recorded run read before its first command finished (the origin
    spec's `startup_bytes`, from the `io.shoal.layer.startup-bytes` annotation, like eStargz's
    prefetch landmark). A layer with no prefetch list fetches them at once, as a list's start-up
    part would be, instead of one miss at a time. At most SHOAL_LAZY_LAYOUT_PREFETCH_MAX_PCT
    (default 10) percent of the layer, at least 1 MiB of it: a hint never costs a whole download.
    SHOAL_LAZY_LAYOUT_PREFETCH=0: off."""
    if os.environ.get("SHOAL_LAZY_LAYOUT_PREFETCH", "1") == "0" or chunk_size <= 0:
        return []
    want = spec.get("startup_bytes")
    if not isinstance(want, int) or isinstance(want, bool) or want <= 0:
        return []
    pct = float(os.environ.get("SHOAL_LAZY_LAYOUT_PREFETCH_MAX_PCT", "10"))
    cap = max(1 << 20, int(size * max(0.0, pct) / 100))
    end = min(want, cap, size)
    return list(range(-(-end // chunk_size)))


def _fd_budget() -> int:
    """How many chunk descriptors the fast path may keep: the soft RLIMIT_NOFILE raised to the hard
    one, less room for everything else (an image of 284 MiB in 128 KiB chunks needs ~2300)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    except (OSError, ValueError):
        pass
    return max(0, min(soft - 4096, 1 << 20))


def _raise_readahead(mountpoint: Path, kb: int = 1024) -> None:
    """The read-ahead of the FUSE connection (READAHEAD_KB, 1 MiB; SHOAL_LAZY_READAHEAD_KB): the kernel's
    window grows to it only for sequential reads (a scattered small file gets a small one), and
    1 MiB requests make warm reads through the daemon ~1.6x faster than 128 KiB ones."""
    st = os.stat(mountpoint)
    try:
        Path(f"/sys/class/bdi/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/read_ahead_kb").write_text(str(kb))
    except OSError as e:
        log.info("read_ahead_kb not raised: %s", e)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shoal.lazy.daemon")
    ap.add_argument("--root", required=True)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("SHOAL_LAZY_THREADS", "16")))
    ap.add_argument("--foreground", action="store_true", help="do not detach (by default the process forks once "
                    "more so the daemon is nobody's child: no zombie once it exits)")
    args = ap.parse_args(argv)
    global _TRACE, PREFETCH_WORKERS
    _TRACE = os.environ.get("SHOAL_LAZY_TRACE") == "1"  # again: a zygote's child got its environment late
    PREFETCH_WORKERS = int(os.environ.get("SHOAL_LAZY_PREFETCH_WORKERS", "4"))
    layer_mod.reload_env()
    if not args.foreground and os.fork() != 0:
        os._exit(0)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    root = Path(args.root).absolute()
    from .mount import lazyfs_dir, pid_path

    files = LayerFiles(root)
    from .fastread import load as load_fast
    from .fuse import MAX_PAGES

    fast = load_fast(MAX_PAGES * 4096)
    srv = FuseServer(lazyfs_dir(root), files, threads=args.threads, fast=fast)
    srv.mount()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    srv.start()  # before anything touches the mount: a stat of it waits for these threads
    _raise_readahead(lazyfs_dir(root), int(os.environ.get("SHOAL_LAZY_READAHEAD_KB", str(READAHEAD_KB))))
    pid_path(root).write_text(f"{os.getpid()}\n")
    (root / "lazy" / "daemon.starting").unlink(missing_ok=True)
    log.info("serving lazy layers of %s at %s (pid %d; warm reads: %s)", root, lazyfs_dir(root), os.getpid(),
             "C fast path" if srv.fast is not None else "Python")
    srv.wait()
    files.stop.set()
    log.info("unmounted: exiting")
    return 0


if __name__ == "__main__":
    sys.exit(main())
