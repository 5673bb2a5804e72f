"""On-demand loading, the mechanism's numbers over a plain HTTP origin (docs/lazy-loading.md; the
registry benchmark of issue 14, section 3, is bench/lazy.py):

- cold start -> first exec from a layer a fresh root has never seen, served by a Range-capable HTTP
  origin on loopback, against the same image local;
- bytes fetched for that first exec;
- warm read throughput (every chunk in the chunk cache, page cache dropped) against a local layer;
- the mechanism variants measured in docs/lazy-loading.md (file-backed EROFS on the FUSE file, and
  a loop device on it).

    python bench/lazy_http.py [--runs 5] [--big-mb 256]   (root; writes bench/results/lazy-http.json)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("SHOAL_URL", "local")  # sandboxes in this process, on private roots
sys.path.insert(0, str(REPO / "tests"))

from roots import wipe_root  # noqa: E402
from servers import RangeServer  # noqa: E402

from shoal import Host, Sandbox  # noqa: E402
from shoal.layers.busybox import make_busybox_tree  # noqa: E402
from shoal.lazy import mount as lazy_mount  # noqa: E402
from shoal.lazy.layer import chunk_cache_for  # noqa: E402
from shoal.lazy.publish import publish_to_dir, register_http_layer  # noqa: E402


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3")


def read_mib_s(sb: Sandbox, path: str, mib: int) -> float:
    drop_caches()
    r = sb.commands.run(f"time -p cat {path} > /dev/null", timeout=300)
    real = float(next(l.split()[1] for l in r.stderr.splitlines() if l.startswith("real")))
    return mib / max(real, 1e-3)


def newroot() -> Path:
    return Path(tempfile.mkdtemp(prefix="shoal-bl-", dir="/tmp"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--big-mb", type=int, default=256)
    ap.add_argument("--loop", action="store_true", help="mount the lazy file with a loop device instead")
    args = ap.parse_args()
    if args.loop:
        os.environ["SHOAL_EROFS_MOUNT"] = "loop"
    src_root, work = newroot(), Path(tempfile.mkdtemp(prefix="shoal-bw-"))
    roots = [src_root]
    server = None
    try:
        host = Host.get(src_root)
        bb = host.store.build_from_dir(make_busybox_tree(work / "bb"), name="busybox").digest
        tree = work / "tree"
        (tree / "data").mkdir(parents=True)
        with open(tree / "data/big.bin", "wb") as f:
            for _ in range(args.big_mb):
                f.write(os.urandom(1 << 20))
        for i in range(2000):
            (tree / f"data/s{i}.txt").write_text(f"small {i}\n" * 20)
        layer = host.store.build_from_dir(tree, name="data").digest
        host.store.create_image("bench:local", [bb, layer])
        origin = work / "origin"
        image_bytes = sum(publish_to_dir(host.store, d, origin).size for d in (bb, layer))
        server = RangeServer(origin)

        local_starts, lazy_starts, fetched = [], [], []
        for _ in range(args.runs):
            t = time.perf_counter()
            with Sandbox.create("bench:local", root=src_root) as sb:
                sb.commands.run("cat /data/s1.txt")
                local_starts.append(time.perf_counter() - t)
            r = newroot()
            roots.append(r)
            h = Host.get(r)
            for d in (bb, layer):
                register_http_layer(h.store, server.url, d)
            h.store.create_image("bench:lazy", [bb, layer])
            server.reset()
            t = time.perf_counter()
            with Sandbox.create("bench:lazy", root=r) as sb:
                sb.commands.run("cat /data/s1.txt")
                lazy_starts.append(time.perf_counter() - t)
            fetched.append(server.bytes_sent)
        # warm: the last lazy root, every chunk cached (one full read first), page cache dropped each time
        local_mbs, warm_mbs = [], []
        with Sandbox.create("bench:local", root=src_root) as sb:
            for _ in range(3):
                local_mbs.append(read_mib_s(sb, "/data/big.bin", args.big_mb))
        with Sandbox.create("bench:lazy", root=roots[-1]) as sb:
            sb.commands.run("cat /data/big.bin > /dev/null", timeout=600)
            for _ in range(3):
                warm_mbs.append(read_mib_s(sb, "/data/big.bin", args.big_mb))
        out = {
            "mount": "loop on the FUSE file" if args.loop else "file-backed EROFS on the FUSE file",
            "runs": args.runs, "image_bytes": image_bytes, "big_file_mib": args.big_mb,
            "cold_start_first_exec_s": {"lazy": sorted(lazy_starts), "local": sorted(local_starts),
                                        "lazy_p50": statistics.median(lazy_starts),
                                        "local_p50": statistics.median(local_starts)},
            "bytes_fetched_first_exec": {"median": statistics.median(fetched),
                                         "fraction_of_image": statistics.median(fetched) / image_bytes},
            "read_mib_s_page_cache_dropped": {
                "local": local_mbs, "lazy_warm": warm_mbs,
                "ratio_median": statistics.median(warm_mbs) / statistics.median(local_mbs)},
            "chunk_cache_bytes": chunk_cache_for(roots[-1]).usage()[1],
        }
        print(json.dumps(out, indent=2))
        dest = REPO / "bench/results" / ("lazy-loop.json" if args.loop else "lazy-http.json")
        dest.write_text(json.dumps(out, indent=2) + "\n")
    finally:
        for r in roots:
            try:
                wipe_root(r)
            finally:
                lazy_mount.stop_daemon(r)
        if server is not None:
            server.close()
        import shutil

        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
