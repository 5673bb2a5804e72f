#!/usr/bin/env python3
"""Images from a real registry, loaded lazily (issue 14, section 3), side by side.

The 10 real workspace images (python:3.11 on Debian bookworm, ~300 MB of EROFS, + one PyPI project
each; built by shoal.envs and cached in the source root) are pushed to a local `docker-registry`
(Debian's distribution 2.8, started here on loopback, plain HTTP, anonymous: Docker reaches
127.0.0.0/8 registries over HTTP without configuration). Then, in FRESH Shoal roots that have never
seen an image (a new root = a new chunk cache and a new lazy daemon):

  cold start -> first exec   `shoal pull --lazy` (manifest, config, chunk indexes) + create +
                             `python3 -c pass` (the interpreter, libpython and the stdlib it imports);
                             against a full `shoal pull` (every layer downloaded, verified, installed)
                             + the same create + exec; and `docker pull` + `docker run --rm` of a
                             Docker image of the same tree from the same registry;
  bytes fetched              registry blob bytes (its access log) from the pull's start through the
                             agent tool-call sequence (or the project's quick tests), as % of the
                             image's EROFS bytes;
  warm read                  every chunk cached, page cache dropped: read all of /usr in the sandbox;
                             the same read from the same image local (the source root); also the first
                             (cold) read of it, every chunk from the registry;
  fan-out                    64 sandboxes on 8 never-seen images at once in one fresh root, through a
                             counting proxy: GET requests per (blob, range) = per chunk.

Docker's image (fairness): the same merged tree (base + workspace layers, overlay-mounted from the
source root) as ONE layer: `docker import` of its tar, then `docker push` (gzip-compressed by
Docker: Docker fetches fewer bytes than Shoal's uncompressed EROFS and must decompress and extract
them before it starts). A private dockerd (bench/docker_engine.py); the image is removed before each
sample so every pull is cold.

    python bench/lazy.py [--runs 3] [--src-root /var/lib/shoal-bench]   (root; ~15 min)
writes bench/results/lazy.json and lazy.png; README's table: `python tests/test_docs_numbers.py lazy`.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("SHOAL_URL", "local")  # sandboxes in this process, on private roots
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "bench"))

RESULTS = REPO / "bench" / "results"
FIRST_EXEC = "python3 -c pass"
READ_ALL = "find /usr -xdev -type f -print0 | xargs -0 cat | wc -c"
TIMING_IMAGES = ("six", "idna", "click")  # cold-start samples, every run (all 10 get byte samples)


def spread(xs: list[float]) -> dict:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "n": len(xs), "all": xs}


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------------ setup
def prepare_images(src) -> list[dict]:
    """One image per workspace: python:3.11's layers + the workspace's, with the base's env."""
    from shoal.envs.debian import PYTHON_IMAGE, ensure_python_base
    from shoal.envs.workspaces import CATALOG, agent_sequence, build_workspace, test_command

    ensure_python_base(src)
    base = src.store.get_image(PYTHON_IMAGE)
    out = []
    for spec in CATALOG:
        ws = build_workspace(src, spec)
        ref = f"lazybench/{spec.name}:1"
        layers = list(base.layers) + [d for d in ws.layers if d not in base.layers]
        src.store.create_image(ref, layers, config={"env": base.config.get("env", {}), "workdir": "/work/repo"})
        out.append({"name": spec.name, "ref": ref, "layers": layers, "agent": agent_sequence(spec),
                    "tests": test_command(spec, quick=True)})
    return out


def task_layer(h, i: int) -> str:
    """A per-task file (/work/task/task.json, which the agent sequence reads), built in root `h`."""
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "work/task").mkdir(parents=True)
        (Path(d) / "work/task/task.json").write_text(json.dumps({"task": i}) + "\n")
        return h.store.build_from_dir(d, source=f"lazy bench task {i}").digest


class Roots:
    """Fresh roots, each torn down (sandboxes, mounts, lazy daemon, files) right after its sample."""

    def __init__(self):
        self.live: list[Path] = []

    def new(self):
        from shoal import Host

        d = Path(tempfile.mkdtemp(prefix="shoal-lb-", dir="/tmp"))
        self.live.append(d)
        return Host.get(d)

    def drop(self, h) -> None:
        from roots import teardown_root

        d = h.settings.root
        teardown_root(d)
        if d in self.live:
            self.live.remove(d)

    def close(self) -> None:
        for d in list(self.live):
            try:
                from roots import teardown_root

                teardown_root(d)
            except Exception as e:  # keep cleaning the others
                log(f"teardown of {d}: {e}")
        self.live.clear()


# ------------------------------------------------------------------------------------------ samples
def lazy_sample(roots: Roots, reg, img: dict, i: int, sequence: str | None, repo: str = "bench/ws") -> dict:
    """A fresh root: lazy pull + create + first exec (timed), then the sequence; registry blob bytes."""
    from shoal import Sandbox
    from shoal.registry import pull

    h = roots.new()
    try:
        task = task_layer(h, i)
        mark = reg.mark()
        t0 = time.perf_counter()
        pull(h.store, f"{reg.addr}/{repo}:{img['name']}", plain_http=True, lazy=True)
        t_pull = time.perf_counter() - t0
        with Sandbox.create(f"{repo}:{img['name']}", layers=[task], root=h.settings.root, memory_mb=1024) as sb:
            t_create = time.perf_counter() - t0
            r = sb.commands.run(FIRST_EXEC)
            t_first = time.perf_counter() - t0
            assert r.exit_code == 0, r
            first_bytes = reg.blob_bytes(mark)
            out = {"image": img["name"], "pull_s": t_pull, "create_s": t_create, "first_exec_s": t_first,
                   "first_exec_bytes": first_bytes, "t0_epoch": time.time() - (time.perf_counter() - t0)}
            if sequence:
                t1 = time.perf_counter()
                r = sb.commands.run(img[sequence], timeout=600)
                out.update({"sequence": sequence, "sequence_s": time.perf_counter() - t1,
                            "sequence_exit": r.exit_code, "bytes": reg.blob_bytes(mark)})
                if r.exit_code != 0:
                    log(f"  {img['name']} {sequence}: exit {r.exit_code}: {(r.stdout + r.stderr)[-300:]}")
        return out
    finally:
        roots.drop(h)


def full_sample(roots: Roots, reg, img: dict, i: int, repo: str = "bench/ws") -> dict:
    from shoal import Sandbox
    from shoal.registry import pull

    h = roots.new()
    try:
        task = task_layer(h, i)
        mark = reg.mark()
        t0 = time.perf_counter()
        pull(h.store, f"{reg.addr}/{repo}:{img['name']}", plain_http=True)
        t_pull = time.perf_counter() - t0
        with Sandbox.create(f"{repo}:{img['name']}", layers=[task], root=h.settings.root, memory_mb=1024) as sb:
            r = sb.commands.run(FIRST_EXEC)
            t_first = time.perf_counter() - t0
            assert r.exit_code == 0, r
        return {"image": img["name"], "pull_s": t_pull, "first_exec_s": t_first, "bytes": reg.blob_bytes(mark)}
    finally:
        roots.drop(h)


def read_all(sb) -> tuple[float, int]:
    drop_caches()
    t = time.perf_counter()
    r = sb.commands.run(READ_ALL, timeout=900)
    dt = time.perf_counter() - t
    assert r.exit_code == 0, r
    return dt, int(r.stdout.strip())


def warm_sample(roots: Roots, reg, src, img: dict) -> dict:
    """MiB/s reading all of /usr: lazy cold (from the registry), lazy warm (chunks cached), local."""
    from shoal import Sandbox
    from shoal.registry import pull

    h = roots.new()
    try:
        pull(h.store, f"{reg.addr}/bench/ws:{img['name']}", plain_http=True, lazy=True)
        out: dict = {"image": img["name"], "lazy_warm_mib_s": [], "local_mib_s": []}
        with Sandbox.create(f"bench/ws:{img['name']}", root=h.settings.root) as sb:
            dt, n = read_all(sb)
            out["bytes_read"] = n
            out["lazy_cold_mib_s"] = n / dt / 2**20
            for _ in range(3):
                dt, _n = read_all(sb)
                out["lazy_warm_mib_s"].append(n / dt / 2**20)
        with Sandbox.create(img["ref"], root=src.settings.root) as sb:
            for _ in range(3):
                dt, _n = read_all(sb)
                out["local_mib_s"].append(n / dt / 2**20)
        return out
    finally:
        roots.drop(h)


def promoted_sample(roots: Roots, reg, img: dict) -> dict:
    """A fresh root whose daemon completes each layer in the background (SHOAL_LAZY_COMPLETE=1, off by
    default; the bytes rows never use it): once every chunk is cached the layers are promoted to local
    image files, and a NEW sandbox reads all of /usr from those (page cache dropped)."""
    from shoal import Sandbox
    from shoal.registry import pull

    os.environ["SHOAL_LAZY_COMPLETE"] = "1"
    h = roots.new()
    try:
        t0 = time.perf_counter()
        res = pull(h.store, f"{reg.addr}/bench/ws:{img['name']}", plain_http=True, lazy=True)
        with Sandbox.create(f"bench/ws:{img['name']}", root=h.settings.root) as sb:
            assert sb.commands.run(FIRST_EXEC).exit_code == 0
            deadline = time.monotonic() + 300
            while not all(h.store.image_path(d).exists() for d in res.lazy) and time.monotonic() < deadline:
                time.sleep(0.2)
            t_promoted = time.perf_counter() - t0
            assert all(h.store.location(d) == "local" for d in res.lazy)
            out: dict = {"image": img["name"], "promoted_after_s": t_promoted, "promoted_mib_s": [],
                         "fuse_mib_s": []}
            with Sandbox.create(f"bench/ws:{img['name']}", root=h.settings.root) as sb2:  # new: local mounts
                for _ in range(3):
                    dt, n = read_all(sb2)
                    out["promoted_mib_s"].append(n / dt / 2**20)
            for _ in range(2):  # the first sandbox, still on its lazy mounts
                dt, n = read_all(sb)
                out["fuse_mib_s"].append(n / dt / 2**20)
        return out
    finally:
        os.environ.pop("SHOAL_LAZY_COMPLETE", None)
        roots.drop(h)


def record_prefetch(roots: Roots, reg, img: dict, i: int, repo: str) -> None:
    """Another host's first run of the image (lazy pull, first exec, agent sequence), whose prefetch
    lists it publishes to the registry (`push --prefetch-only`): what later cold starts find there."""
    from shoal import Sandbox
    from shoal.registry import pull, push

    h = roots.new()
    try:
        task = task_layer(h, i)
        ref = f"{reg.addr}/{repo}:{img['name']}"
        pull(h.store, ref, plain_http=True, lazy=True)
        with Sandbox.create(f"{repo}:{img['name']}", layers=[task], root=h.settings.root, memory_mb=1024) as sb:
            sb.commands.run(FIRST_EXEC)
            sb.commands.run(img["agent"], timeout=600)
        push(h.store, f"{repo}:{img['name']}", ref, plain_http=True, prefetch_only=True)
    finally:
        roots.drop(h)


RECORD_READAHEAD_KB = 0


def record_access(roots: Roots, reg, src, images: list[dict], chunk_kb: int,
                  readahead_kb: int = RECORD_READAHEAD_KB) -> None:
    """For `--relayout`: every image as built in bench/ws-rec; ONE other root's first run of the timing
    images (first exec + agent + tests sequence, one after another) records what it read, and
    publishes it there. The 7 other images' own layers get no list (they go up as built); their base
    layers get the timing images' order: a held-out check. The recording root's daemon reads ahead
    `readahead_kb` on its FUSE file (round 6: 0, so the list holds what the run read, not the
    kernel's read-ahead around it; it was the daemon's 1 MiB before)."""
    from shoal import Sandbox
    from shoal.registry import pull, push

    for img in images:
        push(src.store, img["ref"], f"{reg.addr}/bench/ws-rec:{img['name']}", plain_http=True,
             lazy_chunk_size=chunk_kb << 10)
    saved = os.environ.get("SHOAL_LAZY_READAHEAD_KB")
    os.environ["SHOAL_LAZY_READAHEAD_KB"] = str(readahead_kb)  # the recording root's daemon starts with it
    h = roots.new()
    try:
        for n, name in enumerate(TIMING_IMAGES):
            img = next(x for x in images if x["name"] == name)
            pull(h.store, f"{reg.addr}/bench/ws-rec:{name}", plain_http=True, lazy=True)
            with Sandbox.create(f"bench/ws-rec:{name}", layers=[task_layer(h, 30_000 + n)], root=h.settings.root,
                                memory_mb=1024) as sb:
                for cmd in (FIRST_EXEC, img["agent"], img["tests"]):
                    sb.commands.run(cmd, timeout=600)
        time.sleep(1)  # the recorder's last byte ranges reach its files
        for name in TIMING_IMAGES:
            push(h.store, f"bench/ws-rec:{name}", f"{reg.addr}/bench/ws-rec:{name}", plain_http=True,
                 prefetch_only=True)
    finally:
        roots.drop(h)
        if saved is None:
            os.environ.pop("SHOAL_LAZY_READAHEAD_KB", None)
        else:
            os.environ["SHOAL_LAZY_READAHEAD_KB"] = saved


def fanout_sample(roots: Roots, reg, images: list[dict], n: int, m: int, chunk: int = 128 << 10) -> dict:
    """n sandboxes on m never-seen images at once, in one fresh root, every registry read through a
    counting proxy: how often each (blob, range) was requested."""
    from registryctl import trust
    from servers import FaultProxy

    from shoal import Sandbox
    from shoal.registry import pull

    proxy = FaultProxy(reg.port)
    trust(proxy.addr)
    h = roots.new()
    try:
        for img in images[:m]:
            pull(h.store, f"{proxy.addr}/bench/ws:{img['name']}", plain_http=True, lazy=True)
        tasks = [task_layer(h, i) for i in range(n)]
        proxy.requests.clear()
        lat: list[float] = []
        fails: list[str] = []
        lock = threading.Lock()

        def one(i: int) -> None:
            img = images[i % m]
            t = time.perf_counter()
            try:
                with Sandbox.create(f"bench/ws:{img['name']}", layers=[tasks[i]], root=h.settings.root,
                                    memory_mb=512) as sb:
                    r = sb.commands.run(img["agent"], timeout=600)
                ok = r.exit_code == 0
                why = (r.stdout + r.stderr)[-200:]
            except Exception as e:  # counted, reported
                ok, why = False, repr(e)[:200]
            with lock:
                lat.append(time.perf_counter() - t)
                if not ok:
                    fails.append(f"{i}: {why}")

        t0 = time.perf_counter()
        with ThreadPoolExecutor(n) as ex:
            list(ex.map(one, range(n)))
        wall = time.perf_counter() - t0
        # every chunk each Range GET covered (coalesced and multi-range GETs cover several): how often
        # each (blob, chunk) was fetched in all
        per_chunk: Counter = Counter()
        range_gets = 0
        for meth, p, rng in proxy.requests:
            if meth != "GET" or "/blobs/" not in p or not rng:
                continue
            range_gets += 1
            for part in rng.removeprefix("bytes=").split(","):
                lo, hi = (int(x) for x in part.strip().split("-"))
                for c in range(lo // chunk, hi // chunk + 1):
                    per_chunk[(p.split("?")[0], c)] += 1
        return {"sandboxes": n, "images": m, "wall_s": wall, "p50_s": statistics.median(lat), "failures": len(fails),
                "failure_samples": fails[:3], "range_gets": range_gets, "distinct_chunks": len(per_chunk),
                "chunk_fetches": sum(per_chunk.values()), "max_gets_per_chunk": max(per_chunk.values() or [0]),
                "chunks_fetched_twice": sum(1 for v in per_chunk.values() if v > 1)}
    finally:
        roots.drop(h)
        proxy.stop()


# ------------------------------------------------------------------------------------------ docker
def docker_prepare(src, reg, images: list[dict], env: dict) -> dict[str, int]:
    """`docker import` of each image's merged tree, pushed to the registry; returns compressed bytes."""
    sizes = {}
    for img in images:
        tag = f"{reg.addr}/bench/docker-ws:{img['name']}"
        mounts = src.store.ensure_mounted(img["layers"])
        merged = Path(tempfile.mkdtemp(prefix="shoal-lbm-"))
        try:
            lower = ":".join(str(m) for m in reversed(mounts))
            subprocess.run(["mount", "-t", "overlay", "overlay", "-o", f"lowerdir={lower}", str(merged)], check=True)
            tar = subprocess.Popen(["tar", "-C", str(merged), "-c", "."], stdout=subprocess.PIPE)
            subprocess.run(["docker", "import", "-", tag], stdin=tar.stdout, check=True, capture_output=True, env=env)
            tar.wait()
        finally:
            subprocess.run(["umount", str(merged)], capture_output=True, check=False)
            merged.rmdir()
        subprocess.run(["docker", "push", tag], check=True, capture_output=True, env=env)
        with reg.client() as cl:
            m = cl.get_manifest("bench/docker-ws", img["name"]).json()
        sizes[img["name"]] = sum(int(d["size"]) for d in m["layers"])
        subprocess.run(["docker", "rmi", "-f", tag], capture_output=True, env=env, check=False)
    return sizes


def docker_sample(reg, img: dict, env: dict) -> dict:
    tag = f"{reg.addr}/bench/docker-ws:{img['name']}"
    subprocess.run(["docker", "rmi", "-f", tag], capture_output=True, env=env, check=False)
    mark = reg.mark()
    t0 = time.perf_counter()
    subprocess.run(["docker", "pull", "-q", tag], check=True, capture_output=True, env=env)
    t_pull = time.perf_counter() - t0
    r = subprocess.run(["docker", "run", "--rm", "--network=none", tag, "sh", "-c", FIRST_EXEC],
                       capture_output=True, text=True, env=env, check=False)
    t_first = time.perf_counter() - t0
    assert r.returncode == 0, r.stderr
    out = {"image": img["name"], "pull_s": t_pull, "first_exec_s": t_first, "bytes": reg.blob_bytes(mark)}
    subprocess.run(["docker", "rmi", "-f", tag], capture_output=True, env=env, check=False)
    return out


# ------------------------------------------------------------------------------------------ report
def _ratio_per_run(res: dict, slow: str, fast: str) -> list[float]:
    """Per run: the ratio of that run's p50s (same run, same timing images)."""
    s = res["samples"]
    out = []
    for r in range(res["config"]["runs"]):
        a = [x["first_exec_s"] for x in s[fast] if x["run"] == r and x["image"] in TIMING_IMAGES]
        b = [x["first_exec_s"] for x in s[slow] if x["run"] == r]
        if a and b:
            out.append(statistics.median(b) / statistics.median(a))
    return out


def _fractions(res: dict, key: str) -> dict:
    img_bytes = res["image_bytes"]
    s = res["samples"].get(key) or []
    frac = {seq: [x["bytes"] / img_bytes[x["image"]] for x in s if x.get("sequence") == seq]
            for seq in ("agent", "tests")}
    return {k: spread(v) for k, v in frac.items() if v}


def _cold(res: dict, lazy: str, full: str) -> dict:
    s = res["samples"]
    a = [x["first_exec_s"] for x in s[lazy]]
    b = [x["first_exec_s"] for x in s[full]]
    return {"lazy": spread(a), "full_pull": spread(b), "speedup_p50": statistics.median(b) / statistics.median(a),
            "speedup_per_run": spread(_ratio_per_run(res, full, lazy) or [0.0]),
            "lazy_pull_s": spread([x["pull_s"] for x in s[lazy]]),
            "full_pull_s": spread([x["pull_s"] for x in s[full]])}


def summarize(res: dict) -> dict:
    s = res["samples"]
    img_bytes = res["image_bytes"]
    out = {
        "cold_first_exec_s": _cold(res, "lazy", "full"),
        "bytes_fraction": _fractions(res, "lazy"),
        "bytes_first_exec_fraction": spread([x["first_exec_bytes"] / img_bytes[x["image"]] for x in s["lazy"]]),
        "warm_read": {
            "lazy_warm_mib_s": spread([statistics.median(x["lazy_warm_mib_s"]) for x in s["warm"]]),
            "local_mib_s": spread([statistics.median(x["local_mib_s"]) for x in s["warm"]]),
            "lazy_cold_mib_s": spread([x["lazy_cold_mib_s"] for x in s["warm"]]),
            "ratio": spread([statistics.median(x["lazy_warm_mib_s"]) / statistics.median(x["local_mib_s"])
                             for x in s["warm"]]),
        },
        "fanout": {"wall_s": spread([x["wall_s"] for x in s["fanout"]]),
                   "max_gets_per_chunk": max(x["max_gets_per_chunk"] for x in s["fanout"]),
                   "chunks_fetched_twice": sum(x["chunks_fetched_twice"] for x in s["fanout"]),
                   "failures": sum(x["failures"] for x in s["fanout"]),
                   "distinct_chunks": spread([x["distinct_chunks"] for x in s["fanout"]])},
    }
    if s.get("lazy_pf"):
        pf = [x for x in s["lazy_pf"]]
        out["prefetch"] = {"cold_first_exec_s": spread([x["first_exec_s"] for x in pf]),
                           "speedup_p50": statistics.median(x["first_exec_s"] for x in s["full"])
                           / statistics.median(x["first_exec_s"] for x in pf),
                           "bytes_fraction": _fractions(res, "lazy_pf")}
    if s.get("promoted"):
        # the same image's local read (the warm sample of the same run) is the reference
        local = {x["run"]: statistics.median(x["local_mib_s"]) for x in s["warm"]}
        out["promoted"] = {
            "promoted_mib_s": spread([statistics.median(x["promoted_mib_s"]) for x in s["promoted"]]),
            "fuse_mib_s": spread([statistics.median(x["fuse_mib_s"]) for x in s["promoted"]]),
            "ratio": spread([statistics.median(x["promoted_mib_s"]) / local[x["run"]] for x in s["promoted"]
                             if x["run"] in local]),
            "promoted_after_s": spread([x["promoted_after_s"] for x in s["promoted"]])}
    if s.get("lazy_alt"):
        alt = s["lazy_alt"]
        out["alt_chunks"] = {"chunk_kb": res["config"]["alt_chunk_kb"],
                             "cold_first_exec_s": spread([x["first_exec_s"] for x in alt]),
                             "bytes_fraction": _fractions(res, "lazy_alt")}
    if s.get("docker"):
        d = [x["first_exec_s"] for x in s["docker"]]
        out["docker"] = {"pull_run_s": spread(d), "pull_s": spread([x["pull_s"] for x in s["docker"]]),
                         "bytes": spread([x["bytes"] for x in s["docker"]]),
                         "lazy_speedup_p50": statistics.median(d) / statistics.median(x["first_exec_s"]
                                                                                      for x in s["lazy"])}
    if s.get("shaped_lazy"):
        sh = {"link": res["config"]["shaped_link"], "cold": _cold(res, "shaped_lazy", "shaped_full"),
              "cold_prefetch": _cold(res, "shaped_lazy_pf", "shaped_full"),
              **({"cold_noprefix": _cold(res, "shaped_lazy_noprefix", "shaped_full")}
                 if s.get("shaped_lazy_noprefix") else {}),
              "bytes_agent": spread([x["bytes"] / img_bytes[x["image"]] for x in s["shaped_lazy"]])}
        if s.get("shaped_docker"):
            d = [x["first_exec_s"] for x in s["shaped_docker"]]
            sh["docker"] = {"pull_run_s": spread(d),
                            "lazy_speedup_p50": statistics.median(d) / sh["cold"]["lazy"]["median"],
                            "lazy_prefetch_speedup_p50": statistics.median(d) / sh["cold_prefetch"]["lazy"]["median"]}
        out["shaped"] = sh
    return out


def _zygote_on() -> bool:
    from shoal.lazy import zygote

    return zygote.enabled()


def _fast_built() -> bool:
    from shoal.lazy import fastread

    return os.environ.get("SHOAL_LAZY_FAST", "1") != "0" and (fastread.BUILD_DIR / fastread.library_name()).is_file()


def goal(ok: bool, text: str) -> str:
    return f"{text}: {'met' if ok else 'not met'}"


def _s(m: dict, fmt: str = ".2f", scale: float = 1.0, unit: str = "") -> str:
    f = lambda x: format(x * scale, fmt)  # noqa: E731
    return f"{f(m['median'])} [{f(m['min'])}–{f(m['max'])}]{unit}"


def _cold_row(label: str, c: dict, other: str) -> list[str]:
    return [label, _s(c["lazy"], unit=" s"),
            f"{other}: {_s(c['full_pull'], unit=' s')}; lazy {c['speedup_p50']:.1f}× faster (per run "
            f"{c['speedup_per_run']['min']:.1f}–{c['speedup_per_run']['max']:.1f})",
            goal(c["lazy"]["median"] <= 1.5, "≤ 1.5 s p50") + "; " + goal(c["speedup_p50"] >= 5, "≥ 5× faster")]


def readme_rows(j: dict) -> list[list[str]]:
    """README table: figure | Shoal, lazy | the other side | goal (median [min–max] over samples)."""
    sm = j["summary"]
    ck = j["config"]["chunk_kb"]
    c, w, fo = sm["cold_first_exec_s"], sm["warm_read"], sm["fanout"]
    nolist = "no prefetch list" + (" (the layers' start-up prefix, marked by `push --relayout`, fetched at once)"
                                   if j["config"].get("layout_prefetch") else "")
    rows = [_cold_row(f"cold start → first exec, never-seen image, {nolist} ({ck} KiB chunks; pull + "
                      "create + `python3 -c pass`), loopback", c, "full pull + start")]
    if "prefetch" in sm:
        p = sm["prefetch"]
        rows.append(["the same with a prefetch list published in the registry by an earlier run elsewhere",
                     _s(p["cold_first_exec_s"], unit=" s"), f"lazy {p['speedup_p50']:.1f}× faster than full pull",
                     goal(p["cold_first_exec_s"]["median"] <= 1.5, "≤ 1.5 s p50") + "; "
                     + goal(p["speedup_p50"] >= 5, "≥ 5× faster")])
    if "docker" in sm:
        d = sm["docker"]
        rows.append(["the same, Docker: `docker pull` + `docker run --rm` from the same registry, loopback", "",
                     f"{_s(d['pull_run_s'], unit=' s')} (lazy {d['lazy_speedup_p50']:.1f}× faster; "
                     f"{d['bytes']['median'] / 2**20:.0f} MiB gzip fetched)", "reported beside"])
    if "shaped" in sm:
        sh = sm["shaped"]
        mbit, rtt = j["config"]["link_mbit"], j["config"]["link_rtt_ms"]
        rows.append(_cold_row(f"over a shaped link ({mbit} Mbit/s, +{rtt:g} ms RTT): cold start → first exec, "
                              + nolist, sh["cold"], "full pull + start over the link"))
        if "cold_noprefix" in sh:
            rows.append(_cold_row("shaped link, no prefetch list and the layers' start-up prefix not fetched "
                                  "(`SHOAL_LAZY_LAYOUT_PREFETCH=0`: round 5's path)", sh["cold_noprefix"],
                                  "full pull + start over the link"))
        rows.append(_cold_row("shaped link, with the published prefetch list", sh["cold_prefetch"],
                              "full pull + start over the link"))
        if "docker" in sh:
            d = sh["docker"]
            rows.append(["shaped link, Docker: `docker pull` + `docker run --rm`", "",
                         f"{_s(d['pull_run_s'], unit=' s')} (lazy {d['lazy_speedup_p50']:.1f}× faster, "
                         f"{d['lazy_prefetch_speedup_p50']:.1f}× with the list)", "reported beside"])
    for seq, label in (("agent", "agent tool-call sequence"), ("tests", "project's quick tests")):
        if seq in sm["bytes_fraction"]:
            b = sm["bytes_fraction"][seq]
            rows.append([f"bytes fetched from the registry through the {label}, % of the image ({ck} KiB chunks, "
                         "no prefetch list)", _s(b, ".1f", 100, " %"), f"full pull: 100 % ({j['image_mib']:.0f} MiB)",
                         goal(b["max"] <= 0.15, "≤ 15 %")])
    if "prefetch" in sm:
        for seq in ("agent", "tests"):
            b = sm["prefetch"]["bytes_fraction"].get(seq)
            if b:
                how = ("recorded by a first run of first exec + agent sequence; its start-up part prefetched"
                       if j["config"].get("prefetch_startup_only") else "recorded from the agent sequence")
                rows.append([f"the same with the prefetch list ({how}): {seq} sequence",
                             _s(b, ".1f", 100, " %"), "", goal(b["max"] <= 0.15, "≤ 15 %")])
    if "alt_chunks" in sm:
        sc = sm["alt_chunks"]
        rows.append([f"with {sc['chunk_kb']} KiB chunks (what `lazyreg` pushed): cold start → first exec, no list",
                     _s(sc["cold_first_exec_s"], unit=" s"), "", goal(sc["cold_first_exec_s"]["median"] <= 1.5,
                                                                       "≤ 1.5 s p50")])
        for seq in ("agent", "tests"):
            b = sc["bytes_fraction"][seq]
            rows.append([f"{sc['chunk_kb']} KiB chunks: bytes fetched through the {seq} sequence, % of the image",
                         _s(b, ".1f", 100, " %"), "", goal(b["max"] <= 0.15, "≤ 15 %")])
    rows.append(["warm read of all of /usr through the lazy mount (chunks cached, page cache dropped), MiB/s",
                 _s(w["lazy_warm_mib_s"], ".0f"), f"local layer: {_s(w['local_mib_s'], '.0f')}; ratio "
                 f"{_s(w['ratio'], '.2f')}", goal(w["ratio"]["median"] >= 0.8, "within 20 %")])
    if "promoted" in sm:
        pr = sm["promoted"]
        rows.append(["warm read by a new sandbox after promotion to local image files (background completion "
                     "on, `SHOAL_LAZY_COMPLETE=1`; off by default and in every bytes row), MiB/s",
                     _s(pr["promoted_mib_s"], ".0f"), f"ratio to the local layer {_s(pr['ratio'], '.2f')}; "
                     f"promoted {_s(pr['promoted_after_s'], '.1f', unit=' s')} after the pull",
                     goal(pr["ratio"]["median"] >= 0.8, "within 20 %")])
    rows.append(["first (cold) read of all of /usr, every chunk from the registry, MiB/s",
                 _s(w["lazy_cold_mib_s"], ".0f"), f"local layer: {_s(w['local_mib_s'], '.0f')}", ""])
    rows.append([f"{j['config']['fanout']} sandboxes on {j['config']['fanout_images']} never-seen images at once "
                 "(agent sequence)", f"{_s(fo['wall_s'], '.1f', unit=' s')} wall; {fo['failures']} failures",
                 f"most GETs of one chunk: {fo['max_gets_per_chunk']}; chunks fetched twice: "
                 f"{fo['chunks_fetched_twice']}", goal(fo["max_gets_per_chunk"] <= 1, "no chunk fetched twice")])
    return rows


def plot(j: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sm = j["summary"]
    c = sm["cold_first_exec_s"]
    ck = j["config"]["chunk_kb"]
    groups = [("loopback", [(f"lazy\n{ck} KiB", c["lazy"], "tab:green")])]
    if "prefetch" in sm:
        groups[0][1].append(("lazy +\nprefetch list", sm["prefetch"]["cold_first_exec_s"], "tab:olive"))
    if "alt_chunks" in sm:
        groups[0][1].append((f"lazy\n{sm['alt_chunks']['chunk_kb']} KiB", sm["alt_chunks"]["cold_first_exec_s"],
                             "tab:cyan"))
    groups[0][1].append(("full pull", c["full_pull"], "tab:blue"))
    if "docker" in sm:
        groups[0][1].append(("docker", sm["docker"]["pull_run_s"], "tab:gray"))
    if "shaped" in sm:
        sh = sm["shaped"]
        g = [("lazy", sh["cold"]["lazy"], "tab:green"), ("lazy +\nlist", sh["cold_prefetch"]["lazy"], "tab:olive"),
             ("full pull", sh["cold"]["full_pull"], "tab:blue")]
        if "docker" in sh:
            g.append(("docker", sh["docker"]["pull_run_s"], "tab:gray"))
        groups.append((f"{j['config']['link_mbit']} Mbit/s, +{j['config']['link_rtt_ms']:g} ms RTT", g))
    fig, axes = plt.subplots(1, len(groups) + 1, figsize=(5 * (len(groups) + 1), 4.2))
    for ax, (title, bars) in zip(axes, groups):
        xs = range(len(bars))
        ax.bar(xs, [m["median"] for _, m, _ in bars], color=[col for _, _, col in bars], capsize=4,
               yerr=[[m["median"] - m["min"] for _, m, _ in bars], [m["max"] - m["median"] for _, m, _ in bars]])
        ax.set_xticks(list(xs), [n for n, _, _ in bars], fontsize=8)
        ax.axhline(1.5, ls="--", c="k", lw=0.8)
        ax.set_ylabel("cold start → first exec, s")
        ax.set_title(f"{title} (~{j['image_mib']:.0f} MiB image)", fontsize=9)
    b = axes[-1]
    sets = [(f"{ck} KiB", sm["bytes_fraction"], "tab:green")]
    if "prefetch" in sm:
        sets.append((f"{ck} KiB + list", sm["prefetch"]["bytes_fraction"], "tab:olive"))
    if "alt_chunks" in sm:
        sets.append((f"{sm['alt_chunks']['chunk_kb']} KiB", sm["alt_chunks"]["bytes_fraction"], "tab:cyan"))
    keys = [k for k in ("agent", "tests") if k in sm["bytes_fraction"]]
    width = 0.8 / len(sets)
    for g, (label, fr, color) in enumerate(sets):
        pos = [x + (g - (len(sets) - 1) / 2) * width for x in range(len(keys))]
        b.bar(pos, [fr[k]["median"] * 100 for k in keys], width,
              yerr=[[(fr[k]["median"] - fr[k]["min"]) * 100 for k in keys],
                    [(fr[k]["max"] - fr[k]["median"]) * 100 for k in keys]], capsize=4, color=color, label=label)
    b.legend(fontsize=8)
    b.axhline(15, ls="--", c="k", lw=0.8)
    b.set_xticks(range(len(keys)), [f"{k} sequence" for k in keys])
    b.set_ylabel("bytes fetched, % of the image")
    b.set_title("what a lazily loaded sandbox reads", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def refanout(args) -> None:
    from registryctl import RegistryServer, trust

    from shoal import Host
    from shoal.registry import push

    out = Path(args.out)
    res = json.loads(out.read_text())
    src = Host.get(args.src_root)
    images = prepare_images(src)
    reg = RegistryServer(tls=False, auth=False, workdir=Path("/var/tmp"))
    trust(reg.addr)  # its Shoal images load lazily (shoal.lazy.trust: no registry is trusted by default)
    roots = Roots()
    try:
        for img in images[:args.fanout_images]:
            push(src.store, img["ref"], f"{reg.addr}/bench/ws:{img['name']}", plain_http=True,
                 lazy_chunk_size=res["config"]["chunk_kb"] << 10)
        loads, samples = [], []
        for run in range(res["config"]["runs"]):
            loads.append(os.getloadavg()[0])
            cfg = res["config"]
            samples.append({"run": run, **fanout_sample(roots, reg, images, cfg["fanout"], cfg["fanout_images"],
                                                        cfg["chunk_kb"] << 10)})
            log(f"  {samples[-1]}")
        res["samples"]["fanout"] = samples
        res["fanout_rerun"] = {"date": time.strftime("%Y-%m-%d %H:%M"), "loadavg_1m_per_run": loads,
                               "why": "fan-out re-measured alone, counting every chunk each Range GET covered"}
        res["summary"] = summarize(res)
        out.write_text(json.dumps(res, indent=1) + "\n")
        plot(res, out.with_suffix(".png"))
        log(f"updated {out}")
    finally:
        roots.close()
        reg.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--src-root", default="/var/lib/shoal-bench", help="root with (or to build) the workspaces")
    ap.add_argument("--fanout", type=int, default=64)
    ap.add_argument("--fanout-images", type=int, default=8)
    ap.add_argument("--no-docker", action="store_true")
    ap.add_argument("--chunk-kb", type=int, default=128, help="chunk of the pushed chunk indexes (push's default)")
    ap.add_argument("--readahead-kb", type=int, default=None, help="the lazy daemon's FUSE read-ahead "
                    "(default: the daemon's, 1 MiB)")
    ap.add_argument("--alt-chunk-kb", type=int, default=1024, help="also measure lazy samples with chunks of "
                    "this size; 0: not")
    ap.add_argument("--link-mbit", type=int, default=1000, help="also measure over a shaped link to the registry "
                    "(bench/netlink.py) of this rate; 0: not")
    ap.add_argument("--link-rtt-ms", type=float, default=1.0)
    ap.add_argument("--quick", action="store_true", help="a smoke test: the timing images only")
    ap.add_argument("--relayout", type=int, default=1, help="1: push layers laid out in first-read order (a "
                    "recorded first run of the timing images, `push --relayout`); 0: as mkfs.erofs built them")
    ap.add_argument("--out", default=str(RESULTS / "lazy.json"))
    ap.add_argument("--refanout", action="store_true", help="only re-measure the fan-out rows of --out (its "
                    "samples replaced, the rest kept; the JSON says when and at what load)")
    args = ap.parse_args()
    if args.refanout:
        refanout(args)
        return

    from registryctl import RegistryServer, trust

    from shoal import Host
    from shoal.registry import push

    if args.readahead_kb:
        os.environ["SHOAL_LAZY_READAHEAD_KB"] = str(args.readahead_kb)
    else:
        os.environ.pop("SHOAL_LAZY_READAHEAD_KB", None)
    from shoal.lazy import readahead as _ra

    ra_env = {"SHOAL_LAZY_MISS_READAHEAD_KB": os.environ.get("SHOAL_LAZY_MISS_READAHEAD_KB", str(_ra.DEFAULT_KB)),
              "SHOAL_LAZY_MISS_CLUSTER_KB": os.environ.get("SHOAL_LAZY_MISS_CLUSTER_KB", str(_ra.DEFAULT_CLUSTER_KB)),
              "SHOAL_LAZY_MISS_READAHEAD_BUDGET_PCT": os.environ.get("SHOAL_LAZY_MISS_READAHEAD_BUDGET_PCT",
                                                                     str(_ra.DEFAULT_BUDGET_PCT)),
              "SHOAL_LAZY_PREFETCH_STARTUP": os.environ.get("SHOAL_LAZY_PREFETCH_STARTUP", "1")}
    for var in ("SHOAL_LAZY_COMPLETE", "SHOAL_LAZY_PREFETCH_GAP_KB", "SHOAL_LAZY_TRACE", "SHOAL_LAZY_FAST",
                "SHOAL_LAZY_ZYGOTE", "SHOAL_LAZY_THREADS", "SHOAL_LAZY_LAYOUT_PREFETCH",
                "SHOAL_LAZY_LAYOUT_PREFETCH_MAX_PCT"):
        os.environ.pop(var, None)  # the defaults are what is measured (the promotion row sets COMPLETE itself)
    t_start = time.time()
    load_before = os.getloadavg()[0]
    uptime_before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    src = Host.get(args.src_root)
    log("workspace images (cached in the source root after the first build)")
    images = prepare_images(src)
    by_name = {x["name"]: x for x in images}
    reg = RegistryServer(tls=False, auth=False, workdir=Path("/var/tmp"))
    trust(reg.addr)  # its Shoal images load lazily (shoal.lazy.trust: no registry is trusted by default)
    roots = Roots()
    dockerd = None
    link = sreg = None
    keys = ("lazy", "lazy_alt", "lazy_pf", "full", "docker", "warm", "promoted", "fanout",
            "shaped_lazy", "shaped_lazy_pf", "shaped_full", "shaped_docker", "shaped_lazy_noprefix")
    samples: dict[str, list] = {k: [] for k in keys}
    loads: list[float] = []
    try:
        log(f"registry at {reg.addr}; pushing {len(images)} images to bench/ws:<name>")
        image_bytes = {}
        lay: dict = {}
        if args.relayout:  # layers laid out in the order a first run elsewhere read them (push --relayout)
            record_access(roots, reg, src, images, args.chunk_kb)
            lay = {"relayout": True, "access_from": "bench/ws-rec"}
        for img in images:
            res = push(src.store, img["ref"], f"{reg.addr}/bench/ws:{img['name']}", plain_http=True,
                       lazy_chunk_size=args.chunk_kb << 10, **lay)
            image_bytes[img["name"]] = sum(x.size for x in res.layers)
        for name in TIMING_IMAGES:  # a repository of their own, where prefetch lists get published
            push(src.store, by_name[name]["ref"], f"{reg.addr}/bench/ws-pf:{name}", plain_http=True,
                 lazy_chunk_size=args.chunk_kb << 10, **lay)
            if args.alt_chunk_kb:
                push(src.store, by_name[name]["ref"], f"{reg.addr}/bench/ws-alt:{name}", plain_http=True,
                     lazy_chunk_size=args.alt_chunk_kb << 10, **lay)
        log("prefetch lists: a first run of each timing image, published to bench/ws-pf")
        for n, name in enumerate(TIMING_IMAGES):
            record_prefetch(roots, reg, by_name[name], 10_000 + n, "bench/ws-pf")
        if args.link_mbit:
            from netlink import ShapedLink, shaped_registry

            link = ShapedLink(args.link_mbit, args.link_rtt_ms)
            link.up()
            sreg = shaped_registry(reg, link)
            trust(link.ns_ip, link.host_ip)  # the shaped relay, on the veth, in front of reg
            log(f"shaped registry at {sreg.addr}: {link.describe()}")
        docker_env: dict = {}
        docker_sizes: dict = {}
        if not args.no_docker:
            from docker_engine import PrivateDockerd

            dockerd = PrivateDockerd(prefix="shoal-lazybench-",
                                     insecure_registries=(sreg.addr,) if sreg is not None else ())
            if dockerd.up():
                docker_env = dockerd.env()
                log("docker: importing and pushing the timing images")
                docker_sizes = docker_prepare(src, reg, [by_name[n] for n in TIMING_IMAGES], docker_env)
            else:
                log(f"docker side skipped: {dockerd.error}")
                dockerd = None
        k = 0
        for run in range(args.runs):
            loads.append(os.getloadavg()[0])
            log(f"run {run + 1}/{args.runs}: cold starts (load {loads[-1]:.1f})")
            for name in TIMING_IMAGES:
                img = by_name[name]
                for seq in ("agent", "tests"):
                    samples["lazy"].append({"run": run, **lazy_sample(roots, reg, img, k, seq)})
                    samples["lazy_pf"].append({"run": run, **lazy_sample(roots, reg, img, k + 1, seq,
                                                                         repo="bench/ws-pf")})
                    k += 2
                if args.alt_chunk_kb:
                    for seq in ("agent", "tests"):
                        samples["lazy_alt"].append(
                            {"run": run, **lazy_sample(roots, reg, img, k, seq, repo="bench/ws-alt")})
                        k += 1
                samples["full"].append({"run": run, **full_sample(roots, reg, img, k)})
                k += 1
                if dockerd is not None:
                    samples["docker"].append({"run": run, **docker_sample(reg, img, docker_env)})
                if sreg is not None:
                    samples["shaped_lazy"].append({"run": run, **lazy_sample(roots, sreg, img, k, "agent")})
                    samples["shaped_lazy_pf"].append({"run": run, **lazy_sample(roots, sreg, img, k + 1, "agent",
                                                                                repo="bench/ws-pf")})
                    samples["shaped_full"].append({"run": run, **full_sample(roots, sreg, img, k + 2)})
                    # the same without the layers' start-up prefix (round 5's no-list path): the cold start only
                    os.environ["SHOAL_LAZY_LAYOUT_PREFETCH"] = "0"
                    try:
                        samples["shaped_lazy_noprefix"].append({"run": run, **lazy_sample(roots, sreg, img, k + 3,
                                                                                          None)})
                    finally:
                        os.environ.pop("SHOAL_LAZY_LAYOUT_PREFETCH", None)
                    k += 4
                    if dockerd is not None:
                        samples["shaped_docker"].append({"run": run, **docker_sample(sreg, img, docker_env)})
                line = [(key, samples[key][-1]["first_exec_s"]) for key in keys
                        if samples[key] and samples[key][-1].get("run") == run and "first_exec_s" in samples[key][-1]
                        and samples[key][-1].get("image") == name]
                log("  " + name + ": " + ", ".join(f"{key} {v:.2f} s" for key, v in line))
            if run == 0 and not args.quick:  # every other image, once: bytes for both sequences
                for img in images:
                    if img["name"] in TIMING_IMAGES:
                        continue
                    for seq in ("agent", "tests"):
                        samples["lazy"].append({"run": run, **lazy_sample(roots, reg, img, k, seq)})
                        k += 1
                    log(f"  {img['name']}: bytes {samples['lazy'][-2]['bytes'] / image_bytes[img['name']]:.1%} / "
                        f"{samples['lazy'][-1]['bytes'] / image_bytes[img['name']]:.1%}")
        # the heavy parts after every cold start: 64 sandboxes at once leave the machine loaded for a while
        for run in range(args.runs):
            log(f"run {run + 1}: warm read")
            samples["warm"].append({"run": run, **warm_sample(roots, reg, src, by_name[TIMING_IMAGES[run % 3]])})
            log(f"  {samples['warm'][-1]}")
            samples["promoted"].append({"run": run, **promoted_sample(roots, reg, by_name[TIMING_IMAGES[run % 3]])})
            log(f"  {samples['promoted'][-1]}")
        for run in range(args.runs):
            log(f"run {run + 1}: {args.fanout} sandboxes on {args.fanout_images} never-seen images")
            samples["fanout"].append({"run": run, **fanout_sample(roots, reg, images, args.fanout,
                                                                  args.fanout_images, args.chunk_kb << 10)})
            log(f"  {samples['fanout'][-1]}")
        res = {
            "date": time.strftime("%Y-%m-%d"), "command": "python bench/lazy.py " + " ".join(sys.argv[1:]),
            "host": {"cores": os.cpu_count(), "kernel": platform.release(), "loadavg_1m_before": load_before,
                     "loadavg_1m_after": os.getloadavg()[0], "loadavg_1m_per_run": loads,
                     "uptime_before": uptime_before,
                     "uptime_after": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()},
            "config": {"runs": args.runs, "fanout": args.fanout, "fanout_images": args.fanout_images,
                       "timing_images": list(TIMING_IMAGES), "chunk_kb": args.chunk_kb,
                       "alt_chunk_kb": args.alt_chunk_kb, "relayout": bool(args.relayout),
                       "readahead_kb": int(os.environ.get("SHOAL_LAZY_READAHEAD_KB", "1024")),
                       "first_exec": FIRST_EXEC, "read_all": READ_ALL,
                       "daemon_start": "forked by the host's lazy zygote" if _zygote_on() else "a new process per root",
                       "warm_path": "C fast path" if _fast_built() else "Python",
                       "registry": "docker-registry (distribution 2.8, Debian), loopback, plain HTTP, no auth",
                       "shaped_link": link.describe() if link is not None else None,
                       "link_mbit": args.link_mbit, "link_rtt_ms": args.link_rtt_ms,
                       # read-ahead on first touches (shoal.lazy.readahead; off unless set in the environment)
                       "miss_readahead_kb": int(ra_env["SHOAL_LAZY_MISS_READAHEAD_KB"]),
                       "miss_cluster_kb": int(ra_env["SHOAL_LAZY_MISS_CLUSTER_KB"]),
                       "miss_readahead_budget_pct": float(ra_env["SHOAL_LAZY_MISS_READAHEAD_BUDGET_PCT"]),
                       # a published list's start-up part only (chunks read before the first command ended)
                       "prefetch_startup_only": ra_env["SHOAL_LAZY_PREFETCH_STARTUP"] != "0",
                       # without a list, a relaid layer's start-up prefix (io.shoal.layer.startup-bytes) is
                       # fetched at once (round 6); the shaped_lazy_noprefix rows turn it off
                       "layout_prefetch": True,
                       # the FUSE read-ahead of the root that records the relayout's access lists
                       "record_readahead_kb": RECORD_READAHEAD_KB},
            "image_bytes": image_bytes, "image_mib": statistics.median(image_bytes.values()) / 2**20,
            "docker_image_gzip_bytes": docker_sizes, "wall_s": time.time() - t_start, "samples": samples,
        }
        res["summary"] = summarize(res)
        out = Path(args.out)
        out.write_text(json.dumps(res, indent=1) + "\n")
        plot(res, out.with_suffix(".png"))
        for row in readme_rows(res):
            print(" | ".join(row))
        log(f"wrote {out} ({res['wall_s']:.0f} s)")
    finally:
        roots.close()
        if dockerd is not None:
            dockerd.down()
        if sreg is not None:
            sreg.close()
        if link is not None:
            link.down()
        reg.close()


if __name__ == "__main__":
    main()
