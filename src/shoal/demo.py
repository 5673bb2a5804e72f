"""`make demo`: build a busybox base layer and a second layer on top, start sandboxes, run commands
in them, show that they are isolated from each other and from the host, print the startup table;
then build the Debian base, the Python toolchain and 8 real workspaces and run a burst over them
against Docker (bench/burst.py; its environments are cached under /var/lib/shoal-bench)."""
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


def main() -> None:
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
    from .sdk.remote import Client

    env = dict(os.environ, SHOAL_ROOT=str(root))
    env.pop("SHOAL_URL", None)
    daemon = subprocess.Popen([sys.executable, "-m", "shoal.cli", "serve"], env=env)
    sock = root / "shoald.sock"
    for _ in range(300):
        try:
            if sock.exists() and Client(f"unix://{sock}").json("GET", "/v1/health")["ok"]:
                break
        except Exception:
            pass
        time.sleep(0.05)
    url = f"unix://{sock}"
    admin = Client(url)
    key = admin.json("POST", "/v1/tenants", json={"name": "demo-team", "quotas": {"sandboxes": 10}})["api_key"]
    other = admin.json("POST", "/v1/tenants", json={"name": "other-team"})["api_key"]
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
    t.add_row(c.id, "ps (only its own processes)", " | ".join(c.commands.run("ps -o pid,args").stdout.strip().splitlines()))
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
    args = [sys.executable, str(bench), "--n", "100", "--batch", "100", "--docker-n", "10",
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
             "--out", str(results / "burst.json")]
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


if __name__ == "__main__":
    main()
