"""Smoke run of the burst benchmark (N=32 over busybox workspaces, Shoal side only).

The full comparison against Docker is bench/burst.py; here we check that the script runs end to end,
every task passes, and its accounting is sane. No timing assertions: these machines are shared."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "burst.py"


def test_burst_smoke(tmp_path):
    out = tmp_path / "burst.json"
    root = Path("/tmp") / f"shoal-burst-smoke-{tmp_path.name[-8:]}"
    try:
        r = subprocess.run([sys.executable, str(BENCH), "--workspaces", "busybox", "--m", "4", "--sweep", "32",
                            "--no-docker", "--root", str(root), "--out", str(out)],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        res = json.loads(out.read_text())
        row = res["sweep"][0]["shoal"]
        assert row["n"] == 32 and row["failed"] == 0
        assert row["wall_s"] > 0 and row["p50_ms"] > 0 and row["bytes_written"] >= 0
        snap = res["snapshot_fork"]
        assert set(snap["snapshot_ms"]) == {"1MB", "10MB", "100MB"}
        assert snap["fork_100_failed"] == 0 and snap["fork_10_failed"] == 0
        assert out.with_suffix(".png").stat().st_size > 1000
    finally:
        from shoal import Host

        host = Host.get(root)
        for info in host.runtime.list():
            host.runtime.kill(info.id)
        host.store.gc(keep_named=False)
        subprocess.run(["rm", "-rf", str(root)])
