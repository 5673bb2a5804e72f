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
from pathlib import Path

from ..config import load_settings
from ..core.errors import ShoalError
from ..layers.store import LayerStore
from . import prefetch
from .cache import ChunkCache
from .fuse import FuseServer
from .layer import LazyLayer, chunk_cache_for, open_origin, prefetch_chunks, spec_key

log = logging.getLogger("shoal.lazy.daemon")
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
            order = prefetch.load(self.root, digest)
            if order is None and isinstance(spec.get("prefetch_key"), str):
                try:
                    size = origin.stat(spec["prefetch_key"]).size
                    order = prefetch.parse(origin.read(spec["prefetch_key"], 0, size))
                except ShoalError:
                    order = None
                if order:  # kept here too: a restarted daemon does not ask again
                    prefetch.save(self.root, digest, order)
            recorder = None if order else prefetch.Recorder(self.root, digest)
            layer = LazyLayer(index, origin, spec_key(spec), self.cache, recorder)
            self.layers[name] = layer
            log.info("layer %s: %d chunks, %s", digest[:19], len(index.chunks),
                     f"prefetching {len(order)}" if order else "recording a prefetch list")
            if order:
                threading.Thread(target=self._prefetch, args=(name, layer, order), daemon=True).start()
            return layer

    def _prefetch(self, name: str, layer: LazyLayer, order: list[int]) -> None:
        n = prefetch_chunks(layer, order, self.stop,
                              on_error=lambda i, e: log.warning("%s: prefetch stopped at chunk %d: %s", name, i, e))
        log.info("%s: prefetched %d chunks", name, n)

    def lookup(self, name: str) -> int | None:
        layer = self._layer(name)
        return None if layer is None else layer.index.size

    def names(self) -> list[str]:
        return [f"{d.split(':', 1)[1]}.erofs" for d in self.store.lazy_digests()]

    def read(self, name: str, offset: int, size: int) -> bytes:
        layer = self._layer(name)
        if layer is None:
            raise OSError(errno.ENOENT, name)
        try:
            return layer.read(offset, size)
        except ShoalError as e:  # OriginUnavailable, CorruptChunk, LayerNotFound: the reader gets EIO
            log.warning("%s: read of %d bytes at %d failed: %s", name, size, offset, e)
            raise OSError(errno.EIO, str(e)) from None


def _raise_readahead(mountpoint: Path, kb: int = 1024) -> None:
    """1 MiB read-ahead on the FUSE connection (default 128 KiB): one request per chunk."""
    st = os.stat(mountpoint)
    try:
        Path(f"/sys/class/bdi/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/read_ahead_kb").write_text(str(kb))
    except OSError as e:
        log.info("read_ahead_kb not raised: %s", e)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shoal.lazy.daemon")
    ap.add_argument("--root", required=True)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--foreground", action="store_true", help="do not detach (by default the process forks once "
                    "more so the daemon is nobody's child: no zombie once it exits)")
    args = ap.parse_args(argv)
    if not args.foreground and os.fork() != 0:
        os._exit(0)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    root = Path(args.root).absolute()
    from .mount import lazyfs_dir, pid_path

    files = LayerFiles(root)
    srv = FuseServer(lazyfs_dir(root), files, threads=args.threads)
    srv.mount()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    srv.start()  # before anything touches the mount: a stat of it waits for these threads
    _raise_readahead(lazyfs_dir(root), int(os.environ.get("SHOAL_LAZY_READAHEAD_KB", "1024")))
    pid_path(root).write_text(f"{os.getpid()}\n")
    log.info("serving lazy layers of %s at %s (pid %d)", root, lazyfs_dir(root), os.getpid())
    srv.wait()
    files.stop.set()
    log.info("unmounted: exiting")
    return 0


if __name__ == "__main__":
    sys.exit(main())
