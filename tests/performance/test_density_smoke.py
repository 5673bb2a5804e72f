"""Smoke run of the density benchmark (--quick: shell profile, 8 sandboxes, Shoal only).

The fill to thousands and the Docker side are bench/density.py's real runs; here we check that the
script runs end to end, holds what it created, and its accounting is sane. No timing assertions."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "density.py"


def test_density_quick(tmp_path, bench_root):
    out = tmp_path / "density.json"
    root = bench_root
    r = subprocess.run([sys.executable, str(BENCH), "--quick", "--root", str(root), "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    run = res["profiles"]["shell"]["sides"]["shoal"]["runs"][0]
    assert run["n_held"] == 8 and run["stop"] == "--max 8 reached" and not run["errors"]
    last = run["steps"][-1]
    assert last["n"] == 8
    assert last["create_ms"]["p50"] > 0 and last["exec_ms"]["count"] == 3
    # each idle shell sandbox holds init + sh in its cgroup, and memory; the client holds fds for it
    # (host-wide process and memory deltas are not asserted: the machine is shared)
    assert last["cgroup_tasks_per_sb"] == 2
    assert last["cgroup_per_sb"]["anon"] > 0 and last["mounts_in_sandbox"] > 3
    assert last["client"]["fds_per_sb"] >= 1
    assert "threads (pid_max / threads-max)" in last["limits"]
    assert any(v for v in last["pagecache_bytes"].values())  # busybox is in the page cache
    assert "docker" not in res["profiles"]["shell"]["sides"]
    # the first create's launch steps were kept (every 50th is): Python's, shoal-init's, and the rest
    launch = run["launch"]
    first = launch["ordinary_by_tenth"][0]
    assert first["samples"] >= 1 and {"cgroup_dirs", "clone", "rootfs", "returned", "outside"} <= set(first["p50_ms"])
    assert out.with_suffix(".png").stat().st_size > 1000
    # everything was killed: no live sandbox left under the bench root
    left = [p for p in (root / "sandboxes").iterdir()] if (root / "sandboxes").exists() else []
    assert left == []


def test_density_idle_pipeline_pauses_each_sandbox(tmp_path, bench_root):
    """--idle-pipeline (the dense python fills' mode): each sandbox is paused by a background worker
    once it has been ready for --pipeline-idle-s, while the fill goes on; at the end of the fill every
    one of them is paused, as the backend itself reports (info().state), not as the bench counted."""
    out = tmp_path / "density.json"
    r = subprocess.run([sys.executable, str(BENCH), "--quick", "--idle-pipeline", "--pipeline-idle-s", "0.2",
                        "--root", str(bench_root), "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run = json.loads(out.read_text())["profiles"]["shell"]["sides"]["shoal"]["runs"][0]
    assert run["n_held"] == 8 and not run["errors"], run["errors"]
    pipe = run["idle_pipeline"]
    assert pipe["paused"] == 8 and pipe["paused_now"] == 8, pipe
    assert pipe["reclaimed"] == 0  # no --reclaim: pausing only
    # the exec probes of the last step resumed some; the step itself was measured with all 8 paused
    assert run["paused_during_fill"] == 8
