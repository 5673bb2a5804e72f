#!/usr/bin/env python3
"""Output flood through shoald: `yes` for a long, bounded time, daemon memory / fds / disk sampled.

The long version of tests/security/test_output_flood.py (same two floods, same samples), with its
figures written to bench/results/flood.json for the README:

  - a background `yes` whose output the client polls once a second (ring buffers in the daemon);
  - a loop of blocking execs of `yes` that each run until their 3 s timeout (capped capture).

Measured over the flood (after a 5 s warm-up): bytes produced, the daemon's RSS (start, max, end),
its open fds, the bytes it wrote to storage (/proc/<pid>/io), the free space of the file system
under the Shoal root (host-wide: other processes count too), and /v1/health latency.

  python bench/flood.py --seconds 300
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE.parent / "tests"))
from daemonctl import start_daemon  # noqa: E402
from roots import wipe_root  # noqa: E402

from shoal import Host  # noqa: E402
from shoal.layers.busybox import make_busybox_tree  # noqa: E402
from shoal.backends.http import HttpBackend  # noqa: E402

RESULTS = HERE / "results"


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def write_bytes(pid: int) -> int:
    """Bytes this process caused to be written to storage (/proc/<pid>/io)."""
    with open(f"/proc/{pid}/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("write_bytes:"))


def free_mib(path: Path) -> float:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize / 2**20


def flood(seconds: float, root: Path) -> dict:
    host = Host.get(root)
    with tempfile.TemporaryDirectory() as d:
        host.store.build_from_dir(make_busybox_tree(Path(d) / "bb"), source="busybox", name="busybox")
    host.store.create_image("busybox:flood", ["busybox"])
    proc = start_daemon(root)
    pid = proc.pid
    sock = root / "shoald.sock"
    c = HttpBackend(f"unix://{sock}", "")  # root on the socket: the admin
    raw = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://x", timeout=30)
    stop = threading.Event()
    execs: list[dict] = []
    try:
        sb = c.json("POST", "/sandboxes", json={"image": "busybox:flood", "cpu": 1})
        p = f"/sandboxes/{sb['id']}"

        def exec_flood() -> None:
            while not stop.is_set():
                execs.append(c.json("POST", f"{p}/exec", json={"argv": ["yes"], "timeout": 3,
                                                               "output_cap": 64 * 1024}))

        hid = c.json("POST", f"{p}/commands", json={"argv": ["yes"]})["id"]
        worker = threading.Thread(target=exec_flood, daemon=True)
        worker.start()
        time.sleep(5)  # warm-up: buffers reach their caps, thread pools are spawned
        rss0, fds0, free0, wb0 = rss_mib(pid), len(os.listdir(f"/proc/{pid}/fd")), free_mib(root), write_bytes(pid)
        rss, health_ms, cursor, lost, polls = [], [], [0, 0], 0, 0
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            out = c.json("GET", f"{p}/commands/{hid}", params={"since_out": cursor[0], "since_err": cursor[1]})
            if out["exit_code"] is not None:
                raise RuntimeError("the background flood ended early")
            cursor, lost, polls = out["cursor"], lost + out["lost_bytes"], polls + 1
            t = time.perf_counter()
            raw.get("/v1/health").raise_for_status()
            health_ms.append((time.perf_counter() - t) * 1000)
            rss.append(rss_mib(pid))
            time.sleep(1)
        elapsed = time.monotonic() - t0
        stop.set()
        worker.join(10)
        c.call("DELETE", p)
        fds1, free1, rss1, wb1 = len(os.listdir(f"/proc/{pid}/fd")), free_mib(root), rss_mib(pid), write_bytes(pid)
        exec_bytes = sum(r["stdout_bytes"] for r in execs)
        return {
            "seconds": round(elapsed, 1),
            "background_bytes": cursor[0], "background_lost_unread_bytes": lost, "polls": polls,
            "execs": len(execs), "exec_bytes": exec_bytes,
            "exec_all_timed_out_and_truncated": all(r["timed_out"] and r["stdout_truncated"] for r in execs),
            "exec_max_kept_chars": max((len(r["stdout"]) for r in execs), default=0),
            "total_bytes": cursor[0] + exec_bytes,
            "rss_mib": {"start": round(rss0, 1), "max": round(max(rss), 1), "end": round(rss1, 1)},
            "fds": {"start": fds0, "end": fds1},
            "daemon_bytes_written_to_storage": wb1 - wb0,
            # host-wide: other processes on the machine write to the same file system
            "free_disk_mib": {"start": round(free0), "end": round(free1)},
            "health_ms": {"p50": round(statistics.median(health_ms), 2), "max": round(max(health_ms), 2),
                          "n": len(health_ms)},
        }
    finally:
        stop.set()
        proc.terminate()
        proc.wait(20)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=300)
    ap.add_argument("--out", default=str(RESULTS / "flood.json"))
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="shoal-flood-", dir="/tmp"))  # short: socket paths live here
    try:
        res = {"date": time.strftime("%Y-%m-%d"), "script": "bench/flood.py", "cores": os.cpu_count(),
               **flood(args.seconds, root)}
    finally:
        wipe_root(root)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
