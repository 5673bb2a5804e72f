#!/usr/bin/env python3
"""Where a lazy cold start's bytes go (issue 14): bytes TOUCHED vs bytes FETCHED, per image and layer.

For each workspace image and sequence (bench/lazy.py's `agent` and `tests`), a fresh root pulls the
image lazily from a local registry and runs the first exec + the sequence, with the lazy daemon's
per-read trace on (`SHOAL_LAZY_TRACE=1`). Two modes:

  fetched   the defaults (the daemon's read-ahead, EROFS's): registry blob bytes (its access log),
            and the pages the kernel asked the FUSE file for (`requested`, read-ahead included)
  touched   read-ahead off on the FUSE file AND on the sample's EROFS mounts: the pages the kernel
            asks for are then the pages the sandbox reads (file data) plus the EROFS metadata it
            walks: what an ideal fetcher, with no chunking and no read-ahead, would fetch

`touched` pages are attributed to files through FIEMAP on a private mount of the local image (the
source root's), and summed by kind (.pyc, .py, shared objects, ...) and top directories.

    python bench/lazy_bytes.py [--images six,idna] [--seqs agent,tests] [--modes fetched,touched]
        [--relayout] [--out bench/results/lazy-bytes.json]
`--relayout`: push layers laid out for the recorded access order (shoal.layers.relayout), from a
recording run of `--record-images` (agent + tests sequence), before measuring.
"""
from __future__ import annotations

import argparse
import bisect
import fcntl
import json
import os
import re
import statistics
import struct
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lazy as lb  # noqa: E402  (bench/lazy.py: its samples and setup)

PAGE = 4096
_READ = re.compile(r" read ([0-9a-f]{12}) (\d+)\+(\d+):")
_FIEMAP = 0xC020660B


def erofs_bdis() -> set[str]:
    return {p.name for p in Path("/sys/class/bdi").glob("erofs-*")}


def fuse_pages(root: Path) -> dict[str, set[int]]:
    """Pages of each lazy layer file (by the first 12 hex of the layer digest) the kernel read."""
    out: dict[str, set[int]] = defaultdict(set)
    log = root / "lazy" / "daemon.log"
    for m in _READ.finditer(log.read_text(errors="replace") if log.exists() else ""):
        off, n = int(m.group(2)), int(m.group(3))
        out[m.group(1)].update(range(off // PAGE, (off + n - 1) // PAGE + 1))
    return out


def extents(mnt: Path) -> tuple[list[int], list[tuple[int, int, str]]]:
    """(starts, [(physical start, end, path)]) of every regular file's data in a mounted EROFS."""
    ext: list[tuple[int, int, str]] = []
    for dirpath, _dirs, files in os.walk(mnt):
        for f in files:
            p = os.path.join(dirpath, f)
            try:
                fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:
                continue
            try:
                if not os.path.isfile(p) or os.fstat(fd).st_size == 0:
                    continue
                buf = bytearray(struct.pack("=QQIIII", 0, 2**64 - 1, 0, 0, 64, 0) + b"\0" * 56 * 64)
                fcntl.ioctl(fd, _FIEMAP, buf)
                n = struct.unpack_from("=I", buf, 20)[0]
                for i in range(n):
                    _lg, phys, length = struct.unpack_from("=QQQ", buf, 32 + 56 * i)
                    flags = struct.unpack_from("=I", buf, 32 + 56 * i + 40)[0]
                    if flags & 0x200:  # FIEMAP_EXTENT_DATA_INLINE: the tail lives with the inode (metadata)
                        continue
                    ext.append((phys, phys + length, os.path.relpath(p, mnt)))
            except OSError:
                pass
            finally:
                os.close(fd)
    ext.sort()
    return [e[0] for e in ext], ext


def kind(path: str) -> str:
    if path.endswith(".pyc"):
        return ".pyc"
    if path.endswith(".py"):
        return ".py"
    if ".so" in os.path.basename(path):
        return "shared object"
    if "/bin/" in "/" + path:
        return "executable"
    return "other"


class LayerMap:
    """Files of each local layer image, for attributing touched pages."""

    def __init__(self, src) -> None:
        self.src = src
        self.maps: dict[str, tuple[list[int], list[tuple[int, int, str]]]] = {}

    def get(self, layer: str):
        if layer not in self.maps:
            from shoal.layers.erofs import mount_image, unmount

            with tempfile.TemporaryDirectory(prefix="shoal-lbmap-") as d:
                mount_image(self.src.store.image_path(layer), Path(d))
                try:
                    self.maps[layer] = extents(Path(d))
                finally:
                    unmount(Path(d))
        return self.maps[layer]

    def attribute(self, layer: str, pages: set[int]) -> tuple[Counter, Counter, Counter]:
        starts, ext = self.get(layer)
        by_kind: Counter = Counter()
        by_dir: Counter = Counter()
        files: Counter = Counter()
        for pg in pages:
            off = pg * PAGE
            i = bisect.bisect_right(starts, off) - 1
            if i >= 0 and ext[i][0] <= off < ext[i][1]:
                path = ext[i][2]
                by_kind[kind(path)] += PAGE
                by_dir["/".join(path.split("/")[:4])] += PAGE
                files[path] += PAGE
            else:
                by_kind["metadata"] += PAGE
                by_dir["(metadata)"] += PAGE
        return by_kind, by_dir, files


def sample(roots, reg, img: dict, seq: str, i: int, touched: bool, blob_layer: dict[str, str],
           repo: str = "bench/ws") -> dict:
    from shoal import Sandbox
    from shoal.registry import pull

    os.environ["SHOAL_LAZY_TRACE"] = "1"
    if touched:
        os.environ["SHOAL_LAZY_READAHEAD_KB"] = "0"
    else:
        os.environ.pop("SHOAL_LAZY_READAHEAD_KB", None)
    h = roots.new()
    try:
        task = lb.task_layer(h, i)
        mark = reg.mark()
        pull(h.store, f"{reg.addr}/{repo}:{img['name']}", plain_http=True, lazy=True)
        before = erofs_bdis()
        with Sandbox.create(f"{repo}:{img['name']}", layers=[task], root=h.settings.root, memory_mb=1024) as sb:
            if touched:  # this sample's EROFS mounts: no read-ahead within files either
                for b in erofs_bdis() - before:
                    Path(f"/sys/class/bdi/{b}/read_ahead_kb").write_text("0")
            assert sb.commands.run(lb.FIRST_EXEC).exit_code == 0
            r = sb.commands.run(img[seq], timeout=600)
        pages = fuse_pages(Path(h.settings.root))
        fetched: Counter = Counter()
        for meth, path, _st, size in reg.entries(mark):
            if meth == "GET" and "/blobs/sha256:" in path:
                hexd = path.rsplit("sha256:", 1)[1]
                fetched[blob_layer.get(hexd, "other blobs (chunk indexes, lists)")] += size
        return {"image": img["name"], "sequence": seq, "mode": "touched" if touched else "fetched",
                "exit": r.exit_code, "fetched": dict(fetched),
                "requested": {k: len(v) * PAGE for k, v in pages.items()}, "pages": pages}
    finally:
        os.environ.pop("SHOAL_LAZY_TRACE", None)
        os.environ.pop("SHOAL_LAZY_READAHEAD_KB", None)
        roots.drop(h)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", default="")
    ap.add_argument("--seqs", default="agent,tests")
    ap.add_argument("--modes", default="fetched,touched")
    ap.add_argument("--chunk-kb", type=int, default=128)
    ap.add_argument("--relayout", action="store_true")
    ap.add_argument("--record-images", default=",".join(lb.TIMING_IMAGES))
    ap.add_argument("--record-readahead-kb", type=int, default=None, help="the recording root's FUSE read-ahead "
                    "(default: the daemon's)")
    ap.add_argument("--src-root", default="/var/lib/shoal-bench")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--out", default=str(lb.RESULTS / "lazy-bytes.json"))
    args = ap.parse_args()
    from registryctl import RegistryServer, trust

    from shoal import Host
    from shoal.registry import push

    src = Host.get(args.src_root)
    images = {x["name"]: x for x in lb.prepare_images(src)}
    names = args.images.split(",") if args.images else list(images)
    reg = RegistryServer(tls=False, auth=False, workdir=Path("/var/tmp"))
    trust(reg.addr)  # its Shoal images load lazily (shoal.lazy.trust: no registry is trusted by default)
    roots = lb.Roots()
    lmap = LayerMap(src)
    rows = []
    try:
        sizes: dict[str, int] = {}
        blob_layer: dict[str, str] = {}
        push_kw: dict = {"plain_http": True, "lazy_chunk_size": args.chunk_kb << 10}
        if args.relayout:
            for n in names:
                push(src.store, images[n]["ref"], f"{reg.addr}/bench/ws:{n}", **push_kw)
            t = time.perf_counter()
            record(roots, reg, images, args.record_images.split(","), args.record_readahead_kb)
            print(f"recorded in {time.perf_counter() - t:.1f} s", flush=True)
            push_kw["relayout"] = True
        for n in names:
            res = push(src.store, images[n]["ref"], f"{reg.addr}/bench/ws:{n}", **push_kw)
            sizes[n] = sum(x.size for x in res.layers)
            if res.relaid:
                hot = sum(res.relaid.values()) / sizes[n]
                print(f"{n}: relaid {len(res.relaid)} layers, hot {hot:.1%}", flush=True)
            blob_layer.update({x.blob.split(":")[1]: x.layer for x in res.layers})
        k = 0
        for n in names:
            for seq in args.seqs.split(","):
                for mode in args.modes.split(","):
                    s = sample(roots, reg, images[n], seq, k, mode == "touched", blob_layer)
                    k += 1
                    pages = s.pop("pages")
                    s["image_bytes"] = sizes[n]
                    s["fetched_total"] = sum(s["fetched"].values())
                    s["requested_total"] = sum(s["requested"].values())
                    chunk = args.chunk_kb << 10
                    s["requested_chunks_bytes"] = sum(
                        len({pg * PAGE // chunk for pg in v}) * chunk for v in pages.values())
                    kinds: Counter = Counter()
                    if mode == "touched" and not args.relayout:  # (attributed through the image as built)
                        dirs: Counter = Counter()
                        files: Counter = Counter()
                        for layer in images[n]["layers"]:
                            pg = pages.get(layer.split(":")[1][:12])
                            if pg:
                                a, b, c = lmap.attribute(layer, pg)
                                kinds += a
                                dirs += b
                                files += c
                        s["touched_by_kind"] = dict(kinds)
                        s["touched_by_dir"] = dict(dirs.most_common(args.top))
                        s["touched_top_files"] = dict(files.most_common(args.top))
                    rows.append(s)
                    print(f"{n:15s} {seq:6s} {mode:8s} exit {s['exit']} fetched {s['fetched_total'] / sizes[n]:6.1%} "
                          f"requested {s['requested_total'] / sizes[n]:6.1%} (as {args.chunk_kb} KiB chunks "
                          f"{s['requested_chunks_bytes'] / sizes[n]:6.1%})"
                          + (f"  kinds {', '.join(f'{a} {b / 2**20:.1f}' for a, b in kinds.most_common())} MiB"
                             if kinds else ""), flush=True)
        summary = {}
        for seq in args.seqs.split(","):
            for mode in args.modes.split(","):
                sel = [r for r in rows if r["sequence"] == seq and r["mode"] == mode]
                for key in ("fetched_total", "requested_total", "requested_chunks_bytes"):
                    fr = [r[key] / r["image_bytes"] for r in sel]
                    if fr:
                        summary[f"{seq}/{mode}/{key}"] = {"median": statistics.median(fr), "min": min(fr),
                                                          "max": max(fr)}
        for key, v in summary.items():
            print(f"{key:45s} {v['median']:6.1%} [{v['min']:.1%}-{v['max']:.1%}]")
        Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "args": vars(args),
                                              "summary": summary, "rows": rows}, indent=1) + "\n")
    finally:
        roots.close()
        reg.close()


def record(roots, reg, images: dict, names: list[str], readahead_kb: int | None) -> None:
    """One root, another host's first runs: each of `names` pulled lazily, first exec + agent + tests
    sequence; then its recorded lists (chunks and byte ranges) published beside the blobs."""
    from shoal import Sandbox
    from shoal.registry import pull, push

    if readahead_kb is not None:
        os.environ["SHOAL_LAZY_READAHEAD_KB"] = str(readahead_kb)
    h = roots.new()
    try:
        for i, n in enumerate(names):
            pull(h.store, f"{reg.addr}/bench/ws:{n}", plain_http=True, lazy=True)
            with Sandbox.create(f"bench/ws:{n}", layers=[lb.task_layer(h, 20_000 + i)], root=h.settings.root,
                                memory_mb=1024) as sb:
                sb.commands.run(lb.FIRST_EXEC)
                sb.commands.run(images[n]["agent"], timeout=600)
                sb.commands.run(images[n]["tests"], timeout=600)
        time.sleep(0.6)  # the recorder's last ranges
        for n in names:
            push(h.store, f"bench/ws:{n}", f"{reg.addr}/bench/ws:{n}", plain_http=True, prefetch_only=True)
    finally:
        os.environ.pop("SHOAL_LAZY_READAHEAD_KB", None)
        roots.drop(h)


if __name__ == "__main__":
    main()
