#!/usr/bin/env python3
"""A quick A/B probe for lazy loading (minutes, not bench/lazy.py's quarter hour): one registry,
the timing images pushed with one chunk size, N fresh-root cold starts per image, each followed by
the agent sequence. Prints cold start -> first exec, bytes fetched (first exec, agent sequence) and
blob GETs per sample, and the medians. Used to measure each change in docs/lazy-loading.md.

    python bench/lazy_probe.py [--chunk-kb 1024] [--readahead-kb 1024] [--prefetch] [--full] [-n 2]

`--prefetch`: first a recording run per image in its own fresh root, whose prefetch lists are
published to the registry (`push --prefetch-only`); the measured roots then find them there.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lazy as lb  # noqa: E402  (bench/lazy.py: its samples and setup)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunk-kb", type=int, default=1024)
    ap.add_argument("--readahead-kb", type=int, default=None)
    ap.add_argument("--prefetch", action="store_true")
    ap.add_argument("--full", action="store_true", help="also full pull + start samples")
    ap.add_argument("-n", type=int, default=2)
    ap.add_argument("--images", default=",".join(lb.TIMING_IMAGES))
    ap.add_argument("--src-root", default="/var/lib/shoal-bench")
    ap.add_argument("--registry-addr", default=None, help="use this registry (host:port, plain HTTP) instead of "
                    "starting one; its access log: --registry-log")
    ap.add_argument("--registry-log", default=None)
    ap.add_argument("--relayout", action="store_true", help="push layers laid out by a first run's reads "
                    "(bench/lazy.py's default: one other root records the images, `push --relayout`)")
    ap.add_argument("--link-mbit", type=int, default=0, help="measure over a shaped link (bench/netlink.py)")
    ap.add_argument("--link-rtt-ms", type=float, default=1.0)
    ap.add_argument("--no-agent", action="store_true", help="cold start only (no agent sequence)")
    ap.add_argument("--sequence", default="agent", choices=("agent", "tests"), help="the sequence after the "
                    "first exec (its bytes are the 'agent' columns)")
    ap.add_argument("--env-b", action="append", default=[], help="VAR=VALUE: every sample also runs with this "
                    "environment (variant B, interleaved with A, the environment as given); medians of both")
    ap.add_argument("--env-c", action="append", default=[], help="VAR=VALUE: a third variant (C), like --env-b")
    ap.add_argument("--warm", action="store_true", help="warm-read samples instead (bench/lazy.py's warm row: "
                    "all of /usr through the lazy mount, every chunk cached, against the local layer)")
    args = ap.parse_args()
    if args.readahead_kb:
        os.environ["SHOAL_LAZY_READAHEAD_KB"] = str(args.readahead_kb)

    from registryctl import RegistryServer, trust

    from shoal import Host
    from shoal.registry import push

    if os.environ.get("SHOAL_LAZY_TRACE") == "1":  # keep each root's daemon log (its per-read lines)
        drop = lb.Roots.drop

        def keep_log(self, h) -> None:
            log = Path(h.settings.root) / "lazy" / "daemon.log"
            if log.exists():
                Path(f"/tmp/lazy-trace-{time.time():.0f}.log").write_bytes(log.read_bytes())
            drop(self, h)

        lb.Roots.drop = keep_log  # type: ignore[method-assign]
    src = Host.get(args.src_root)
    images = {x["name"]: x for x in lb.prepare_images(src)}
    names = args.images.split(",")
    reg = RegistryServer(tls=False, auth=False, workdir=Path("/var/tmp"))
    trust(reg.addr)  # its Shoal images load lazily (shoal.lazy.trust: no registry is trusted by default)
    roots = lb.Roots()
    link = sreg = None
    try:
        sizes = {}
        lay: dict = {}
        if args.relayout:
            lb.record_access(roots, reg, src, [images[n] for n in lb.TIMING_IMAGES], args.chunk_kb)
            lay = {"relayout": True, "access_from": "bench/ws-rec"}
        for n in names:
            res = push(src.store, images[n]["ref"], f"{reg.addr}/bench/ws:{n}", plain_http=True,
                       lazy_chunk_size=args.chunk_kb << 10, **lay)
            sizes[n] = sum(x.size for x in res.layers)
        if args.link_mbit:
            from netlink import ShapedLink, shaped_registry

            link = ShapedLink(args.link_mbit, args.link_rtt_ms)
            link.up()
            sreg = shaped_registry(reg, link)
            print(f"shaped registry at {sreg.addr}: {link.describe()}", flush=True)
        mreg = sreg if sreg is not None else reg
        if args.prefetch:
            for i, n in enumerate(names):
                record(roots, reg, images[n], 900 + i)
        if args.warm:
            warm(args, roots, mreg, src, images, names)
            return
        rows = []
        k = 0
        for _ in range(args.n):
            for n in names:
                for variant, env in variants(args):
                    saved = _with_env(env)
                    try:
                        mark = mreg.mark()
                        s = lb.lazy_sample(roots, mreg, images[n], k, None if args.no_agent else args.sequence)
                        k += 1
                        s.setdefault("bytes", s["first_exec_bytes"])
                        s.setdefault("sequence_s", 0.0)
                        gets = sum(1 for m, p, _st in mreg.requests(mark) if m == "GET" and "/blobs/" in p)
                        s.update(first_frac=s["first_exec_bytes"] / sizes[n], agent_frac=s["bytes"] / sizes[n],
                                 gets=gets)
                        rows.append(s)
                        traces = sorted(Path("/tmp").glob("lazy-trace-*.log"), key=lambda q: q.stat().st_mtime)
                        if os.environ.get("SHOAL_LAZY_TRACE") == "1" and traces:
                            timeline(traces[-1], s)
                        print(f"{n:6s} {variant} lazy pull {s['pull_s']:.3f} create {s['create_s']:.3f} "
                              f"first exec {s['first_exec_s']:.3f} s  bytes first {s['first_frac']:.1%} "
                              f"agent {s['agent_frac']:.1%}  GETs {gets}  seq {s['sequence_s']:.2f} s", flush=True)
                        s["variant"] = variant
                    finally:
                        _restore(saved)
                if args.full:
                    f = lb.full_sample(roots, mreg, images[n], k)
                    k += 1
                    rows.append({"full": f["first_exec_s"]})
                    print(f"{n:6s} full pull+start {f['first_exec_s']:.3f} s", flush=True)
        for variant, env in variants(args):
            summary(args, [r for r in rows if "first_exec_s" in r and r.get("variant") == variant], rows,
                    variant + (f" ({' '.join(env)})" if env else ""))
    finally:
        roots.close()
        if sreg is not None:
            sreg.close()
        if link is not None:
            link.down()
        reg.close()


def variants(args) -> list[tuple[str, list[str]]]:
    """(name, environment) of each variant: A (as given), B (--env-b), C (--env-c), interleaved."""
    return [("A", [])] + ([("B", args.env_b)] if args.env_b else []) + ([("C", args.env_c)] if args.env_c else [])


def _with_env(pairs: list[str]):
    saved = {v.split("=", 1)[0]: os.environ.get(v.split("=", 1)[0]) for v in pairs}
    for v in pairs:
        name, _, val = v.partition("=")
        os.environ[name] = val
    return saved


def _restore(saved: dict) -> None:
    for name, old in saved.items():
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def warm(args, roots, reg, src, images: dict, names: list[str]) -> None:
    """bench/lazy.py's warm sample, A and B interleaved: lazy warm / local, median of 3 reads each."""
    ratios: dict[str, list[float]] = {"A": [], "B": []}
    for _ in range(args.n):
        for n in names:
            for variant in (["A", "B"] if args.env_b else ["A"]):
                saved = _with_env(args.env_b if variant == "B" else [])
                try:
                    w = lb.warm_sample(roots, reg, src, images[n])
                finally:
                    _restore(saved)
                r = statistics.median(w["lazy_warm_mib_s"]) / statistics.median(w["local_mib_s"])
                ratios[variant].append(r)
                print(f"{n:6s} {variant} warm {[round(x) for x in w['lazy_warm_mib_s']]} local "
                      f"{[round(x) for x in w['local_mib_s']]} MiB/s: ratio {r:.2f}; load {os.getloadavg()[0]:.1f}",
                      flush=True)
    for v, rs in ratios.items():
        if rs:
            print(f"MEDIAN {v} warm/local {statistics.median(rs):.2f} [{min(rs):.2f}-{max(rs):.2f}]")


def summary(args, lz: list[dict], rows: list[dict], variant: str) -> None:
    ra = os.environ.get('SHOAL_LAZY_READAHEAD_KB', '1024')
    if lz:
        print(f"MEDIAN {variant} chunk {args.chunk_kb} KiB ra {ra} "
              f"prefetch {args.prefetch}: first exec {statistics.median(r['first_exec_s'] for r in lz):.3f} s "
              f"[{min(r['first_exec_s'] for r in lz):.3f}-{max(r['first_exec_s'] for r in lz):.3f}], "
              f"first bytes {statistics.median(r['first_frac'] for r in lz):.1%}, "
              f"agent bytes {statistics.median(r['agent_frac'] for r in lz):.1%} "
              f"(max {max(r['agent_frac'] for r in lz):.1%}), "
              f"GETs {statistics.median(r['gets'] for r in lz)}"
              + (f"; full {statistics.median(r['full'] for r in rows if 'full' in r):.3f} s" if args.full else "")
              + f"; load {os.getloadavg()[0]:.1f}")


def timeline(path: Path, s: dict) -> None:
    """Daemon events relative to the sample's start (t0): when it served, opened layers, read."""
    import datetime

    t0 = s["t0_epoch"]
    print(f"   t0; pull done +{s['pull_s']:.3f}; create done +{s['create_s']:.3f}; exec done +{s['first_exec_s']:.3f}")
    for line in path.read_text().splitlines():
        try:
            ts = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        except ValueError:
            continue
        if "serving" in line or "prefetched" in line or " layer " in line:
            print(f"   +{ts - t0:.3f} {line[29:140]}")


def record(roots, reg, img: dict, i: int) -> None:
    """A first run somewhere else: lazy pull, first exec + agent sequence, publish its prefetch lists."""
    from shoal import Sandbox
    from shoal.registry import pull, push

    h = roots.new()
    try:
        task = lb.task_layer(h, i)
        ref = f"{reg.addr}/bench/ws:{img['name']}"
        pull(h.store, ref, plain_http=True, lazy=True)
        with Sandbox.create(f"bench/ws:{img['name']}", layers=[task], root=h.settings.root, memory_mb=1024) as sb:
            sb.commands.run(lb.FIRST_EXEC)
            sb.commands.run(img["agent"], timeout=600)
        time.sleep(0.2)
        push(h.store, f"bench/ws:{img['name']}", ref, plain_http=True, prefetch_only=True)
    finally:
        roots.drop(h)


if __name__ == "__main__":
    main()
