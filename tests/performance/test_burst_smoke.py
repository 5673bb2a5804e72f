"""Smoke run of the burst benchmark (N=32 over busybox workspaces, Shoal sides only: tmpfs and disk upper).

The full comparison against Docker is bench/burst.py; here we check that the script runs end to end,
every task passes, and its accounting is sane. No timing assertions: these machines are shared."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "burst.py"


def test_burst_smoke(tmp_path, bench_root):
    out = tmp_path / "burst.json"
    root = bench_root
    r = subprocess.run([sys.executable, str(BENCH), "--workspaces", "busybox", "--m", "4", "--sweep", "32",
                        "--runs", "1", "--sides", "shoal,shoal-disk", "--root", str(root), "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    for side in ("shoal", "shoal-disk"):  # tmpfs and disk uppers
        row = res["rows"][0]["sides"][side]
        assert row["runs"][0]["n"] == 32 and row["failed"] == 0
        assert row["wall_s"]["median"] > 0 and row["p50_ms"]["median"] > 0
    # the disk upper's writes reach the block layer (a tmpfs upper's may not): the counter must see them
    assert res["rows"][0]["sides"]["shoal-disk"]["bytes_written"]["min"] > 0
    snap = res["snapshot_fork"]
    for upper in ("tmpfs", "disk"):
        assert set(snap["snapshot_ms"][upper]) == {"1MB", "10MB", "100MB"}
    assert snap["fork_failed"] == {"10": 0, "100": 0}
    assert 0.9 < snap["disk_upper"]["usable_fraction"] <= 1
    assert out.with_suffix(".png").stat().st_size > 1000
