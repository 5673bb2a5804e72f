"""The pure helpers of bench/density.py: parsing, per-sandbox deltas, steps, the stop rule, spreads."""
from __future__ import annotations

import errno
import importlib.util
import os
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "density.py"


@pytest.fixture(scope="module")
def d():
    spec = importlib.util.spec_from_file_location("density_bench", BENCH)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["density_bench"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_pct_and_spread(d):
    xs = [float(i) for i in range(1, 101)]
    assert d.pct(xs, 0.5) == 51.0 and d.pct(xs, 0.99) == 99.0 and d.pct(xs, 0) == 1.0 and d.pct(xs, 1) == 100.0
    assert d.pct([5.0], 0.99) == 5.0
    with pytest.raises(ValueError):
        d.pct([], 0.5)
    assert d.spread([3.0, 1.0, 2.0]) == {"min": 1.0, "median": 2.0, "max": 3.0, "n": 3}
    with pytest.raises(ValueError):
        d.spread([])
    s = d.lat_stats([0.001, 0.002, 0.003])
    assert s["p50"] == pytest.approx(2.0) and s["max"] == pytest.approx(3.0) and s["count"] == 3
    assert d.lat_stats([]) is None


def test_parse_meminfo_and_per_sandbox(d):
    text = "MemTotal:       1000 kB\nMemAvailable:    600 kB\nAnonPages:        10 kB\nHugePages_Total:       0\n"
    m = d.parse_meminfo(text)
    assert m["MemTotal"] == 1000 * 1024 and m["used"] == 400 * 1024 and m["HugePages_Total"] == 0
    after = dict(m, used=m["used"] + 10 * 2**20, AnonPages=m["AnonPages"] + 4 * 2**20)
    per = d.per_sandbox(m, after, 4, ("used", "AnonPages", "Missing"))
    assert per == {"used": 2.5 * 2**20, "AnonPages": 2**20}
    with pytest.raises(ValueError):
        d.per_sandbox(m, after, 0, ("used",))


def test_cgroup_totals_v1_and_v2(d):
    v1 = d.parse_memory_stat("rss 1\ntotal_rss 100\ntotal_cache 50\ntotal_shmem 7\ntotal_mapped_file 3\n")
    assert d.cgroup_totals(v1, kmem=9) == {"anon": 100, "file": 50, "shmem": 7, "mapped_file": 3, "kernel": 9}
    assert "kernel" not in d.cgroup_totals(v1)
    v2 = d.parse_memory_stat("anon 10\nfile 20\nkernel 5\nshmem 1\nfile_mapped 2\n")
    assert d.cgroup_totals(v2) == {"anon": 10, "file": 20, "shmem": 1, "mapped_file": 2, "kernel": 5}
    old_v2 = d.parse_memory_stat("anon 10\nfile 20\nslab 4\nkernel_stack 2\npagetables 1\n")
    assert d.cgroup_totals(old_v2)["kernel"] == 7


def test_fill_steps(d):
    assert d.fill_steps(2000) == [10, 20, 50, 100, 200, 500, 1000, 1500, 2000]
    assert d.fill_steps(8) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert d.fill_steps(10)[-1] == 10 and d.fill_steps(600)[-1] == 600 and 450 in d.fill_steps(600)
    with pytest.raises(ValueError):
        d.fill_steps(0)


def test_stop_rule(d):
    kw = dict(n=5, max_n=100, free_frac=0.5, free_min=0.1, recent_create_s=[0.01] * 50, p99_max_s=1.0, limits={})
    assert d.stop_reason(**kw) is None
    assert "free memory" in d.stop_reason(**dict(kw, free_frac=0.05))
    assert "create p99" in d.stop_reason(**dict(kw, recent_create_s=[0.01] * 40 + [2.0] * 10))
    assert d.stop_reason(**dict(kw, recent_create_s=[2.0] * 49)) is None  # judged on a full window of 50
    lim = d.limit_usage({"kernel/pid_max": 1000, "kernel/threads-max": 5000}, {"threads": 960})
    assert lim["threads (pid_max / threads-max)"]["limit"] == 1000
    assert "kernel limit near: threads" in d.stop_reason(**dict(kw, limits=lim))
    assert "--max 100" in d.stop_reason(**dict(kw, n=100))
    # the shared host's guard: an absolute MemAvailable floor, off unless asked for
    gib = 1 << 30
    assert d.stop_reason(**dict(kw, avail_bytes=4 * gib)) is None
    assert "shared-host guard: MemAvailable 4.0 GiB < 5 GiB" in d.stop_reason(
        **dict(kw, avail_bytes=4 * gib, avail_min_bytes=5 * gib))
    assert d.stop_reason(**dict(kw, avail_bytes=6 * gib, avail_min_bytes=5 * gib)) is None


def test_limit_usage_uses_client_nofile(d):
    lim = d.limit_usage({}, {"client_fds": 900, "client_nofile": 1000, "inotify": 10})
    assert lim["client fds (RLIMIT_NOFILE)"]["frac"] == pytest.approx(0.9)
    assert lim["inotify instances (max_user_instances)"]["limit"] == 128  # the kernel default when unread
    assert "maps per process (vm.max_map_count)" not in lim  # no usage read, no row


def test_classify_error(d):
    assert "EAGAIN" in d.classify_error(OSError(errno.EAGAIN, "Resource temporarily unavailable"))
    assert "EMFILE" in d.classify_error(RuntimeError("launch: Too many open files"))
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise RuntimeError("mount failed") from inner
    except RuntimeError as outer:
        assert "ENOSPC" in d.classify_error(outer)
    assert d.classify_error(ValueError("bad image")).startswith("create failed: ValueError")


def test_parse_fincore_and_tune_plan(d):
    assert d.parse_fincore("4096\n") == 4096 and d.parse_fincore("") == 0
    plan = d.tune_plan({"kernel/pid_max": 32768, "vm/max_map_count": 2000000}, {"kernel/pid_max": 4194304,
                                                                                "vm/max_map_count": 1048576})
    assert plan == {"kernel/pid_max": (32768, 4194304)}  # raises only, never lowers


def test_summarize_spread_over_common_steps(d):
    def run(n_held, used):
        steps = [{"n": n, "meminfo_per_sb": {"used": used * 2**20, "AnonPages": 0}, "create_ms": {"p50": n / 10},
                  "tasks_per_sb": 3.0} for n in (10, 20) if n <= n_held]
        return {"n_held": n_held, "steps": steps}

    s = d.summarize([run(20, 1.0), run(20, 2.0), run(10, 3.0)])
    assert s["runs"] == 3 and s["n_held"] == {"min": 10, "median": 20, "max": 20, "n": 3}
    assert [r["n"] for r in s["by_step"]] == [10]  # only the steps every run reached
    assert s["last_common"]["mem_used_mib"] == {"min": 1.0, "median": 2.0, "max": 3.0, "n": 3}
    assert "cg_anon_mib" not in s["last_common"]  # absent in the runs: no made-up figure


def test_parse_filefrag(d):
    text = """Filesystem type is: e0f5e1e2
File size of /m/usr/bin/python3.11 is 6834488 (6836224 blocks of 1 bytes)
 ext:     logical_offset:        physical_offset: length:   expected: flags:
   0:        0.. 6832127:    7794688..  14626815: 6832128:
   1:  6832128.. 6834487:   14626880..  14629239:   2360:   14626816: last,not_aligned,inline,eof
/m/usr/bin/python3.11: 2 extents found
"""
    assert d.parse_filefrag(text) == [(7794688, 6832128), (14626880, 2360)]
    assert d.parse_filefrag("") == []


def test_mincore_bytes_sees_what_was_read(d, tmp_path):
    f = tmp_path / "f"
    f.write_bytes(b"x" * (64 * 4096))
    with open(f, "rb") as fh:  # just written: in the page cache
        fh.read()
    assert d.mincore_bytes(f, [(0, 4096)]) == 4096
    assert d.mincore_bytes(f, [(4096 * 10, 3 * 4096)]) == 3 * 4096
    fd = os.open(f, os.O_RDONLY)
    os.fsync(fd)  # dirty pages cannot be dropped
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # drop them: mincore must say so
    os.close(fd)
    assert d.mincore_bytes(f, [(0, 64 * 4096)]) < 64 * 4096


def test_double_cache_probe_tells_the_mount_options_apart(d, tmp_path):
    """The page-cache check on a real file-backed EROFS mount: by default a read fills both the mount's
    page cache and the backing file's; with `directio` only the mount's. Were the probe blind (mincore on
    the wrong range, a cache it cannot see), one of these would fail."""
    from shoal.layers import erofs

    if os.geteuid() != 0 or not erofs.mkfs_available():
        pytest.skip("needs root and mkfs.erofs")
    src = tmp_path / "tree"
    (src / "bin").mkdir(parents=True)
    (src / "bin" / "blob").write_bytes(os.urandom(1 << 20))
    image = tmp_path / "layer.erofs"
    erofs.build_image(src, image)
    res = d.double_cache_probe(image, "bin/blob")
    default = res["default"]["after_one_read"]
    assert default["in_mount_cache"] >= 1 << 20 and default["in_backing_file_cache"] >= 1 << 20  # cached twice
    if "skipped" in res["directio"]:
        pytest.skip(f"kernel without EROFS directio: {res['directio']['skipped']}")
    direct = res["directio"]["after_one_read"]
    assert direct["in_mount_cache"] >= 1 << 20 and direct["in_backing_file_cache"] < 64 << 10  # once


def test_project_limits(d):
    step = {"attributed_per_sb": {"tasks": 3.0}, "mounts_host_per_sb": 1.5, "files_per_sb": 10.0,
            "inotify_per_sb": 0.0, "client": {"fds_per_sb": 5.0}}
    p = d.project_limits(step, 20000, {"kernel/pid_max": 32768, "kernel/threads-max": 190000,
                                       "fs/mount-max": 100000, "fs/file-max": 1 << 40,
                                       "fs/inotify/max_user_instances": 128}, nofile=20000)
    pid = p["kernel.pid_max / kernel.threads-max (tasks)"]
    assert pid["needed"] == 60000 and pid["limit"] == 32768 and not pid["fits"]
    assert p["fs.mount-max (mounts in the host namespace)"]["fits"]
    assert not p["RLIMIT_NOFILE of the client process"]["fits"]  # 5 fds x 20,000 > 20,000
    assert p["fs.inotify.max_user_instances"]["fits"]


def test_summarize_end_of_fill_and_python_goal(d):
    """--idle-pipeline runs carry the host once every sandbox was paused (`end`): summarized over runs,
    only where every run has it; the python goal cell compares the sides' median counts."""
    def run(n_held, used, end=True):
        step = {"n": n_held, "meminfo_per_sb": {"used": used * 2**20}, "create_ms": {"p50": 5.0}}
        return {"n_held": n_held, "steps": [step], "end": dict(step, meminfo_per_sb={"used": used / 4 * 2**20},
                                                                create_ms=None) if end else None}

    s = d.summarize([run(1000, 8.0), run(1200, 4.0)])
    assert s["end"]["n"]["median"] == 1100 and s["end"]["mem_used_mib"]["max"] == 2.0
    assert "create_p50_ms" not in s["end"]  # no creates after the fill: no latency made up
    assert "end" not in d.summarize([run(1000, 8.0), run(1200, 4.0, end=False)])

    def sides(shoal, docker, shoal_stop="free memory 9.9% < 10%", docker_stop="create p99 1003 ms > 1000 ms"):
        def held(v):  # an int: one run; a list: the runs' counts
            xs = v if isinstance(v, list) else [v]
            return {"median": sorted(xs)[len(xs) // 2], "min": min(xs), "max": max(xs), "n": len(xs)}
        return {k: {"summary": {"n_held": held(v)}, "runs": [{"stop": why}]}
                for k, v, why in (("shoal", shoal, shoal_stop), ("docker", docker, docker_stop)) if v}

    assert d.python_held_goal(sides(3100, 700)) == ("≥ 3,000: met; ≥ 3× Docker: 4.4× median to median, 4.4× "
                                                    "Shoal's fewest to Docker's most (met)")
    assert d.python_held_goal(sides(1500, 600)) == ("≥ 3,000: not met, 1,500 short; ≥ 3× Docker: 2.5× median to "
                                                    "median, 2.5× Shoal's fewest to Docker's most (not met)")
    # "met" only where every run meets it; the ratio's worst case is Shoal's fewest against Docker's most
    three = d.python_held_goal(sides([2734, 3503, 3546], [650, 700, 800]))
    assert three.startswith("≥ 3,000: met at the median, not in every run (the fewest 2,734, 266 short)")
    assert "5.0× median to median, 3.4× Shoal's fewest to Docker's most (met)" in three
    assert "met in every run (3; the fewest 3,100)" in d.python_held_goal(sides([3100, 3200, 3300], [700]))
    assert "(met at the median, not run for run)" in d.python_held_goal(sides([2000, 3500, 3600], [700, 800, 900]))
    assert d.python_held_goal(sides(1500, 600, "--fill-budget-s 450 reached")).endswith(
        "(a floor: Shoal's fills ended at their cap, not at the stop rule)")
    assert "both sides' fills were capped" in d.python_held_goal(sides(600, 378, "--max 600 reached",
                                                                      "--docker-fill-budget-s 150 reached"))
    assert "not measured" in d.python_held_goal(sides(1500, None))


def test_slab_objects_reads_one_cache(d):
    text = ("slabinfo - version: 2.1\n# name <active_objs> <num_objs> ...\n"
            "dma-kmalloc-1k 0 0 1024 16 4 : tunables 0 0 0 : slabdata 0 0 0\n"
            "kmalloc-1k 850 896 1024 16 4 : tunables 0 0 0 : slabdata 56 56 0\n")
    assert d.slab_objects("kmalloc-1k", text) == 850
    assert d.slab_objects("kmalloc-2k", text) is None


@pytest.mark.skipif(os.geteuid() != 0 or not Path("/sys/fs/cgroup/freezer").is_dir(),
                    reason="needs root and the v1 freezer")
def test_kill_cgroup_tasks_kills_frozen_tasks_too(d):
    """The Docker teardown's last resort: every task under the parent dies, frozen ones included."""
    import subprocess
    import time

    name = f"shoal-density-killtest-{os.getpid()}"
    made = []
    procs = [subprocess.Popen(["sleep", "300"]) for _ in range(2)]
    try:
        for ctl in ("freezer", "pids"):
            child = Path("/sys/fs/cgroup", ctl, name, "c")
            child.mkdir(parents=True)
            made += [child, child.parent]
            for p in procs:
                (child / "cgroup.procs").write_text(str(p.pid))
        (Path("/sys/fs/cgroup/freezer", name, "c") / "freezer.state").write_text("FROZEN")
        assert d.kill_cgroup_tasks(name) == 2
        deadline = time.monotonic() + 10
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(p.returncode == -9 for p in procs)
    finally:
        state = Path("/sys/fs/cgroup/freezer", name, "c", "freezer.state")
        if state.exists():
            state.write_text("THAWED")  # else a frozen task never reaps below
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for c in made:
            for _ in range(50):
                try:
                    c.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)
