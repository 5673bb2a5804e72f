"""`make demo`: the bundled SWE task suite through the agent loop (`swe_demo`).

Builds (once, cached under $SHOAL_DEMO_ROOT, default /var/lib/shoal-bench) the Debian base, the
Python toolchain and the workspaces the tasks come from; runs every task with the oracle and the
null policy (and a real model when $SHOAL_LLM_URL is set) on rollout worker processes, with a
progress bar; prints the resolve table (by policy and by bug type); writes the episodes as JSONL
and Parquet; and replays one finished episode from the trajectory log to show fast-forward.

`python -m shoal.demo --platform` is the platform tour: layers, sandboxes, isolation, the daemon
and its API, the startup/API/burst benchmarks against Docker."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from . import Host, Sandbox
from .layers.busybox import make_busybox_tree

console = Console()


def platform_demo() -> None:
    root = Path(os.environ.get("SHOAL_ROOT") or tempfile.mkdtemp(prefix="shoal-demo-", dir="/tmp"))
    console.print(Panel.fit(f"Shoal demo — state root {root}", style="bold cyan"))
    host = Host.get(root)

    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        base = host.store.build_from_dir(make_busybox_tree(Path(d) / "base"), source="busybox", name="busybox")
        tool = Path(d) / "toolkit"
        (tool / "usr/local/bin").mkdir(parents=True)
        (tool / "usr/local/bin/greet").write_text("#!/bin/sh\necho \"hello from the toolkit layer, $(hostname)\"\n")
        os.chmod(tool / "usr/local/bin/greet", 0o755)
        (tool / "etc").mkdir()
        (tool / "etc/motd").write_text("toolkit layer sits on top of busybox\n")
        toolkit = host.store.build_from_dir(tool, source="demo toolkit", name="demo-toolkit")
        console.print(f"built layers in {time.perf_counter() - t0:.2f}s: busybox {base.short} "
                      f"({base.image_bytes // 1024} KiB EROFS), toolkit {toolkit.short}")
    host.store.create_image("demo:latest", ["busybox", "demo-toolkit"])

    # the daemon: started here, stopped at the end; everything below goes through its HTTP API
    from .backends.http import HttpBackend
    from .server.ensure import answering

    env = dict(os.environ, SHOAL_ROOT=str(root))
    env.pop("SHOAL_URL", None)
    sock = root / "shoald.sock"  # a private socket: the host daemon's /run/shoal/shoald.sock is left alone
    daemon = subprocess.Popen([sys.executable, "-m", "shoal.cli", "serve", "--socket", str(sock)], env=env)
    for _ in range(600):
        if answering(sock):
            break
        time.sleep(0.05)
    url = f"unix://{sock}"
    admin = HttpBackend(url, "")  # root on the socket: the admin
    key = admin.json("POST", "/tenants", json={"name": "demo-team", "quotas": {"sandboxes": 10}})["api_key"]
    other = admin.json("POST", "/tenants", json={"name": "other-team"})["api_key"]
    console.print(f"shoald listening on {sock}; tenants demo-team and other-team created (keys shown once)")
    try:
        _sandboxes_through_api(url, key, other)
    finally:
        daemon.terminate()
        daemon.wait(30)
        console.print("shoald stopped")
    _benchmarks(root, host)


def _sandboxes_through_api(url: str, key: str, other_key: str) -> None:
    t0 = time.perf_counter()
    boxes = [Sandbox.create("demo:latest", url=url, api_key=key, memory_mb=128, disk_mb=64, ttl=300)
             for _ in range(3)]
    console.print(f"created 3 sandboxes through the API in {(time.perf_counter() - t0) * 1000:.1f} ms")
    t = Table("sandbox", "command", "output")
    for sb in boxes:
        t.add_row(sb.id, "greet", sb.commands.run("greet").stdout.strip())
    a, b, c = boxes
    a.commands.run("echo secret-of-a > /root/note; rm /bin/ls")
    t.add_row(a.id, "cat /root/note (a wrote it)", a.commands.run("cat /root/note").stdout.strip())
    t.add_row(b.id, "cat /root/note", (b.commands.run("cat /root/note 2>&1").stdout.strip()))
    t.add_row(b.id, "ls / (a deleted /bin/ls)", " ".join(b.commands.run("ls /").stdout.split()))
    t.add_row(c.id, "ps (only its own processes)",
              " | ".join(c.commands.run("ps -o pid,args").stdout.strip().splitlines()))
    t.add_row(c.id, "ip link (no network)", " ".join(c.commands.run("ls /sys/class/net").stdout.split()))
    t.add_row(c.id, "mount -t tmpfs x /mnt", c.commands.run("mount -t tmpfs x /mnt 2>&1").stdout.strip())
    with c.sessions.create() as s:
        s.run("cd /tmp && export STEP=1")
        t.add_row(c.id, "session: cd /tmp; export; then pwd", s.run("pwd; echo STEP=$STEP").stdout.replace("\n", " "))
    console.print(t)
    seen_by_other = [i.id for i in Sandbox.list(url=url, api_key=other_key)]
    console.print(f"other-team sees {len(seen_by_other)} of demo-team's sandboxes (tenants are isolated)")
    for sb in boxes:
        sb.kill()
    console.print(f"killed all three; live sandboxes now: {len(Sandbox.list(url=url, api_key=key))}")


def _benchmarks(root: Path, host: Host) -> None:
    console.print(Panel.fit("startup benchmark (bench/startup.py, reduced iterations)", style="bold cyan"))
    bench = Path(__file__).resolve().parents[2] / "bench" / "startup.py"
    results = Path(tempfile.mkdtemp(prefix="shoal-demo-results-"))  # the committed results stay as they are
    args = [sys.executable, str(bench), "--n", "10", "--runs", "3", "--shoal-n", "100", "--batch", "100",
            "--out", str(results / "startup.json")]
    if os.environ.get("SHOAL_DEMO_NO_DOCKER"):
        args.append("--no-docker")
    subprocess.run(args, check=False)

    console.print(Panel.fit("shoald API: latency and 200 sandboxes held through it (bench/api.py)",
                            style="bold cyan"))
    subprocess.run([sys.executable, str(bench.parent / "api.py"), "--n", "100", "--hold", "200", "--churn-s", "5",
                    "--out", str(results / "api.json")], check=False)

    console.print(Panel.fit("composable environments: Debian base + Python toolchain + 8 real workspaces, "
                            "then a burst against Docker (bench/burst.py, reduced N)", style="bold cyan"))
    burst = Path(__file__).resolve().parents[2] / "bench" / "burst.py"
    bargs = [sys.executable, str(burst), "--m", "8", "--sweep", os.environ.get("SHOAL_DEMO_BURST", "32,64"),
             "--runs", "1", "--out", str(results / "burst.json")]
    if os.environ.get("SHOAL_DEMO_NO_DOCKER"):
        bargs.append("--no-docker")
    subprocess.run(bargs, check=False)
    console.print(f"demo results (JSON + PNG) in {results}")
    if not os.environ.get("SHOAL_ROOT"):
        host.gc()
        host.store.gc(keep_named=False)  # unmount and drop the demo's layers; nothing stays mounted
        host.store.close()
        import shutil

        shutil.rmtree(root, ignore_errors=True)


def swe_demo() -> None:
    from .server.ensure import serving
    from .tasks.swe import load_suite
    from .tasks.swe.suite import prepare_suite, summary

    root = Path(os.environ.get("SHOAL_DEMO_ROOT", "/var/lib/shoal-bench"))
    console.print(Panel.fit(f"Shoal demo: SWE tasks with executable rewards, through the agent loop\n"
                            f"environments cached under {root}", style="bold cyan"))
    host = Host.get(root)
    tasks = load_suite()
    s = summary(tasks)
    t0 = time.perf_counter()
    # the operator's step (root, in-process): every image the episodes and graders start from
    with console.status("building the Debian base, the Python toolchain and the workspaces (first run only) ...") as st:
        prepare_suite(host, tasks, lambda what, i, n: st.update(f"preparing {what} ({i}/{n}) ..."))
    console.print(f"environments and task images ready in {time.perf_counter() - t0:.1f} s")
    tab = Table(title=f"bundled suite: {s['tasks']} tasks over {s['repos']} repos (SWE-smith-style injected bugs, "
                      f"each validated)")
    tab.add_column("repo")
    tab.add_column("tasks", justify="right")
    for repo, n in s["by_repo"].items():
        tab.add_row(repo, str(n))
    tab.add_row("[dim]bug types[/]", ", ".join(f"{k} {v}" for k, v in sorted(s["by_bug_type"].items())))
    console.print(tab)

    policies: list[dict] = [{"kind": "oracle"}, {"kind": "null"}]
    if os.environ.get("SHOAL_LLM_URL"):
        policies.append({"kind": "chat", "url": os.environ["SHOAL_LLM_URL"],
                         "model": os.environ.get("SHOAL_LLM_MODEL", "default"),
                         "api_key": os.environ.get("SHOAL_LLM_API_KEY")})
        console.print(f"real model: {policies[-1]['model']} at {policies[-1]['url']}")
    work = Path(tempfile.mkdtemp(prefix="shoal-swe-demo-"))
    with serving(root, work / "shoald.sock", work / "shoald.log") as url:
        swe_rollout(tasks, policies, work, url)
        if os.environ.get("SHOAL_DEMO_DESKTOP", "1") != "0":
            from .tasks.desktop.demo import desktop_demo

            desktop_demo(host, work, url, console)


def desktop_only() -> None:
    """`python -m shoal.demo --desktop`: the desktop section alone."""
    from .server.ensure import serving
    from .tasks.desktop.demo import desktop_demo

    root = Path(os.environ.get("SHOAL_DEMO_ROOT", "/var/lib/shoal-bench"))
    work = Path(tempfile.mkdtemp(prefix="shoal-desktop-demo-"))
    with serving(root, work / "shoald.sock", work / "shoald.log") as url:
        desktop_demo(Host.get(root), work, url, console)


def swe_rollout(tasks: list, policies: list[dict], work: Path, url: str) -> None:
    """The rollout half of the SWE demo: workers are clients of the shoald at `url` (they would run
    as any user in the `shoal` group), as is the fast-forward at the end."""
    import asyncio
    import json

    from .backends import open_backend
    from .rollout.episode import run_episode
    from .rollout.policy import make_policy
    from .rollout.runner import Rollout, resolve_table, write_jsonl, write_parquet
    from .trajlog import TrajectoryLog

    ro = Rollout(work / "rollout.db")
    for p in policies:
        ro.submit(tasks, p, prefix=p["kind"])
    workers = int(os.environ.get("SHOAL_DEMO_WORKERS", "2"))
    ro.start_workers(workers, url=url, concurrency=2, log_dir=work)
    console.print(f"{workers} rollout workers, clients of shoald at {url}")
    t0 = time.perf_counter()
    try:
        counts = ro.wait(title=f"episodes on {workers} workers")
    finally:
        ro.stop_workers()
    wall = time.perf_counter() - t0
    recs = ro.records()
    res = Table(title=f"resolve table: {counts['done']} episodes in {wall:.0f} s "
                      f"({counts['done'] / wall:.2f}/s), {counts['failed']} failed, {counts['paused']} paused")
    for col in ("policy", "episodes", "resolved", "resolve rate", "partial", "mean steps", "mean episode s"):
        res.add_column(col, justify="right" if col != "policy" else "left")
    for row in resolve_table(recs):
        res.add_row(row["policy"], str(row["episodes"]), str(row["resolved"]), f"{100 * row['resolve_rate']:.1f}%",
                    str(row["partial"]), f"{row['mean_steps']:.1f}", f"{row['mean_episode_s']:.2f}")
    console.print(res)
    by_type = Table(title="resolve rate by bug type")
    by_type.add_column("bug type")
    pols = sorted({r["policy"] for r in recs})
    for p in pols:
        by_type.add_column(p, justify="right")
    for bt in sorted({r["labels"]["bug_type"] for r in recs}):
        cells = []
        for p in pols:
            sel = [r for r in recs if r["policy"] == p and r["labels"]["bug_type"] == bt]
            cells.append(f"{sum(r['resolved'] for r in sel)}/{len(sel)}")
        by_type.add_row(bt, *cells)
    console.print(by_type)
    jl, pq = write_jsonl(recs, work / "episodes.jsonl"), write_parquet(recs, work / "episodes.parquet")
    console.print(f"episodes: {jl} and {pq}; trajectory log: {ro.log_path}")

    # fast-forward: run a finished episode again from its log: nothing executes, the model is not asked
    first = next(r for r in recs if r["policy"] == "oracle")
    task = next(t for t in tasks if t.instance_id == first["instance_id"])
    t0 = time.perf_counter()
    again = asyncio.run(run_episode(task, make_policy({"kind": "oracle"}, task), TrajectoryLog(ro.log_path),
                                    open_backend(url), first["episode_id"]))
    console.print(Panel.fit(
        f"episode {first['episode_id']} ({task.instance_id}) run again from the trajectory log in "
        f"{time.perf_counter() - t0:.2f} s (live: {first['timings']['wall_s']:.2f} s)\n"
        f"replayed {json.dumps(again.replayed)}, executed {json.dumps(again.executed)}, "
        f"re-applied to a new sandbox: {again.restored_ops} ops; same reward: {again.reward == first['reward']}",
        title="fast-forward", style="green"))


def main() -> None:
    if "--platform" in sys.argv[1:]:
        platform_demo()
    elif "--desktop" in sys.argv[1:]:
        desktop_only()
    else:
        swe_demo()


if __name__ == "__main__":
    main()
