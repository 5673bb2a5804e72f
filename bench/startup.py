#!/usr/bin/env python3
"""Startup benchmark: Shoal against Docker and runc, each pair paying the same costs.

Three comparisons, every sample running `true` in a fresh sandbox/container made from the same
busybox rootfs (shoal.layers.busybox), network off, removed afterwards:

  CLI vs CLI (a fresh process from the shell, process start and teardown included)
    cli_shoal           `shoal run IMG -- true` with a warm shoald: Python start, the stdlib fast
                        path (shoal.cli_fast), create + streamed exec + delete over the Unix socket
    cli_docker          `docker run --rm --network=none IMG true` (Debian docker.io CLI + dockerd)
    cli_shoal_no_daemon `shoal run --in-process IMG -- true`: no daemon; shoal.cli_fast imports the
                        SDK and the host (not typer/rich), then creates, execs and kills in-process
  SDK vs SDK (inside one long-lived Python process, client reused)
    sdk_shoal           Sandbox.create(IMG, url="unix://…/shoald.sock") + commands.run(["true"]) + kill()
    sdk_docker          docker SDK: containers.run(IMG, ["sleep", "3600"], detach=True,
                        network_mode="none") + exec_run(["true"]) + remove(force=True)
    sdk_shoal_in_process  Sandbox.create(IMG, root=…) + commands.run(["true"]) + kill(), no daemon
                        (no daemon hop, so it favours Shoal: shown, not used for the headline)
  gVisor, SDK vs SDK (both through their daemon, the same runsc binary and flags)
    sdk_shoal_gvisor    Sandbox.create(IMG, url=…, backend="gvisor") + commands.run(["true"]) + kill()
    sdk_docker_gvisor   containers.run(IMG, sleep, detach, network none, runtime="runsc") + exec_run + remove
  runtime vs runtime (a fresh process from the shell, no engine daemon on either side)
    runtime_shoal       = cli_shoal_no_daemon (Shoal's runtime driven by a fresh process: Python
                        start + imports + shoal-init launch + exec + kill and teardown)
    runtime_runc        `runc run --bundle B ID` of an unpacked OCI bundle (create, start, wait,
                        delete: runc removes the container when it exits)

All sides run interleaved in the same run (one sample of each row per round, the row order rotated
each round), `--runs` times; each row reports p50/p99 over all samples and the min/median/max of
the per-run p50. It also keeps Shoal's own in-process figures (cold create -> exec, warm pool,
exec, session command, creations/s) under "shoal".

Writes bench/results/startup.json and startup.png; `--readme README.md` rewrites the README's
"Startup" section from the JSON (readme_section()).
"""
from __future__ import annotations

import argparse
import compileall
import json
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from shoal import Host, Sandbox, WarmPool  # noqa: E402
from shoal.layers.busybox import make_busybox_tree  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from docker_engine import PrivateDockerd  # noqa: E402

console = Console()
RESULTS = Path(__file__).parent / "results"
REPO = Path(__file__).resolve().parents[1]
IMAGE = "bench:busybox"
GOAL_CLI_P50_MS = 60.0
GOAL_CLI_SPEEDUP = 2.0


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def summary(xs_s: list[float]) -> dict:
    ms = [x * 1000 for x in xs_s]
    return {"n": len(ms), "p50_ms": round(statistics.median(ms), 3), "p99_ms": round(pct(ms, 0.99), 3),
            "mean_ms": round(statistics.fmean(ms), 3)}


# ------------------------------------------------------------------------------------------ Shoal's own figures
def bench_shoal(root: Path, n: int, batch: int) -> dict:
    """Shoal in-process (no CLI, no daemon): the runtime's own latencies, one run."""
    image = IMAGE
    out: dict = {}
    for _ in range(5):  # warm caches (helper binary, layer mount, page cache)
        with Sandbox.create(image, root=root, url="local") as sb:
            sb.commands.run(["true"])

    cold = []
    for _ in range(n):
        t0 = time.perf_counter()
        sb = Sandbox.create(image, root=root, url="local")
        sb.commands.run(["true"])
        cold.append(time.perf_counter() - t0)
        sb.kill()
    out["cold_create_exec"] = summary(cold)

    execs, sess = [], []
    with Sandbox.create(image, root=root, url="local") as sb:
        for _ in range(n):
            t0 = time.perf_counter()
            sb.commands.run(["true"])
            execs.append(time.perf_counter() - t0)
        with sb.sessions.create() as s:
            s.run("cd /tmp")
            for _ in range(n * 2):
                t0 = time.perf_counter()
                s.run(":")
                sess.append(time.perf_counter() - t0)
    out["exec_true"] = summary(execs)
    out["session_cmd"] = summary(sess)

    warm = []
    with WarmPool(image, size=8, root=root, url="local") as pool:
        pool.wait_ready(60)
        for _ in range(n):
            pool.wait_ready(60)  # measure acquisition, not the refill racing us on 2 cores
            t0 = time.perf_counter()
            sb = pool.acquire()
            sb.commands.run(["true"])
            warm.append(time.perf_counter() - t0)
            sb.kill()
    out["warm_acquire_exec"] = summary(warm)

    for threads in (1, 2):
        made: list[Sandbox] = []
        lock = threading.Lock()

        def worker(k: int, made: list[Sandbox] = made, lock: threading.Lock = lock) -> None:
            for _ in range(k):
                sb = Sandbox.create(image, root=root, url="local")
                with lock:
                    made.append(sb)

        per = batch // threads
        t0 = time.perf_counter()
        ts = [threading.Thread(target=worker, args=(per,)) for _ in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        elapsed = time.perf_counter() - t0
        out[f"creations_per_s_{threads}t"] = round(len(made) / elapsed, 1)
        for sb in made:
            sb.kill()
    return out


def shoal_runs(root: Path, n: int, batch: int, runs: int) -> dict:
    """bench_shoal `runs` times: each latency keeps the pooled-run layout of one run (the median run
    by p50) plus the min/median/max of its p50 over the runs."""
    per = [bench_shoal(root, n, batch) for _ in range(runs)]
    out: dict = {}
    for key, first in per[0].items():
        if isinstance(first, dict):
            p50s = [r[key]["p50_ms"] for r in per]
            mid = sorted(per, key=lambda r: r[key]["p50_ms"])[len(per) // 2]
            out[key] = {**mid[key], "p50_runs_ms": p50s, "p50_min_ms": min(p50s),
                        "p50_median_ms": round(statistics.median(p50s), 3), "p50_max_ms": max(p50s)}
        else:
            vals = [r[key] for r in per]
            out[key] = round(statistics.median(vals), 1)
            out[f"{key}_runs"] = vals
    return out


# ------------------------------------------------------------------------------------------ engines
class Shoald:
    """`shoal serve` on a root of its own, stopped at the end."""

    def __init__(self, root: Path):
        self.root, self.sock = root, root / "shoald.sock"
        env = dict(os.environ, SHOAL_ROOT=str(root))
        env.pop("SHOAL_URL", None)
        self.log = open(root / "shoald.log", "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "shoal.cli", "serve", "--socket", str(self.sock),
                                      "--creates-per-s", "10000"], env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        while time.time() < deadline:
            if self.sock.exists():
                try:
                    Sandbox.list(url=f"unix://{self.sock}")
                    return
                except Exception:
                    pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise SystemExit(f"shoald did not start; see {root}/shoald.log")

    def down(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


def wipe(root: Path) -> None:
    """Take a Shoal root down: live sandboxes, layer mounts, files."""
    if not root.exists():
        return
    host = Host.get(root)
    for info in host.list():
        try:
            host.kill(info.id)
        except Exception as e:  # keep cleaning up; say what stayed
            console.print(f"[yellow]could not kill {info.id}: {e}[/yellow]")
    host.store.gc()
    for m in (root / "mnt").iterdir() if (root / "mnt").exists() else []:
        subprocess.run(["umount", "-l", str(m)], capture_output=True)
    shutil.rmtree(root, ignore_errors=True)


def rootfs_tar(d: str) -> str:
    make_busybox_tree(Path(d) / "root")
    tar = os.path.join(d, "rootfs.tar")
    with tarfile.open(tar, "w") as tf:
        tf.add(os.path.join(d, "root"), arcname=".")
    return tar


def shoal_image(root: Path) -> None:
    host = Host.get(root)
    with tempfile.TemporaryDirectory() as d:
        host.store.build_from_dir(make_busybox_tree(Path(d)), source="busybox", name="busybox")
    host.store.create_image(IMAGE, ["busybox"])


def runc_bundle(d: Path) -> Path:
    make_busybox_tree(d / "rootfs")
    subprocess.run(["runc", "spec"], cwd=d, check=True, capture_output=True)
    spec = json.loads((d / "config.json").read_text())
    spec["process"]["args"] = ["true"]
    spec["process"]["terminal"] = False
    (d / "config.json").write_text(json.dumps(spec))
    return d


def version(cmd: list[str], env: dict | None = None) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, env=env).stdout.strip().splitlines()[0]
    except (OSError, IndexError):
        return ""


# ------------------------------------------------------------------------------------------ rows
ROWS = {  # key -> (comparison, side, label, what one sample includes)
    "cli_shoal": ("cli", "shoal", "`shoal run IMG -- true`, warm shoald",
                  "fresh process: Python start, shoal.cli_fast, create + streamed exec + delete over shoald's "
                  "Unix socket, exit"),
    "cli_docker": ("cli", "peer", "`docker run --rm --network=none IMG true`",
                   "fresh process: docker CLI start, dockerd create + start + attach + wait + remove, exit"),
    "cli_shoal_no_daemon": ("cli_no_daemon", "shoal", "`shoal run --in-process IMG -- true`, no daemon",
                            "fresh process: Python start, shoal.cli_fast, SDK + host imports (no typer/rich), "
                            "in-process create + exec + kill, exit"),
    "sdk_shoal": ("sdk", "shoal", "Shoal SDK via shoald: create + exec `true` + kill",
                  "in a running Python process: Sandbox.create(url=unix socket) + commands.run + kill, "
                  "client reused"),
    "sdk_docker": ("sdk", "peer", "Docker SDK: run detached + exec_run `true` + remove(force)",
                   "in a running Python process: containers.run(sleep, detach, network none) + exec_run + "
                   "remove(force=True), client reused"),
    "sdk_shoal_in_process": ("sdk_in_process", "shoal", "Shoal SDK in-process: create + exec `true` + kill",
                             "in a running Python process, no daemon hop: Sandbox.create(root=) + commands.run + kill"),
    "sdk_shoal_gvisor": ("sdk_gvisor", "shoal", "Shoal SDK via shoald, backend=\"gvisor\": create + exec `true` + kill",
                         "in a running Python process: Sandbox.create(url=unix socket, backend='gvisor') + "
                         "commands.run + kill, client reused; runsc on the ptrace platform"),
    "sdk_docker_gvisor": ("sdk_gvisor", "peer", "Docker SDK, runtime=runsc: run detached + exec_run `true` + remove",
                          "in a running Python process: containers.run(sleep, detach, network none, runtime='runsc') "
                          "+ exec_run + remove(force=True), client reused; the same runsc binary"),
    "runtime_runc": ("runtime", "peer", "`runc run` of an OCI bundle (+ its delete)",
                     "fresh process: runc create + start + wait + delete, rootfs already unpacked, no engine"),
    # context, no peer: where a fresh Shoal process spends its time before any sandbox exists
    "python_start": (None, None, "`python -c pass` (the venv's interpreter)",
                     "fresh process: the interpreter's start and exit, the floor of any Python CLI"),
    "import_sdk": (None, None, "`python -c 'import shoal.sdk.sandbox'`",
                   "fresh process: the imports the no-daemon path pays (pydantic, the host, the SDK)"),
}
COMPARISONS = {  # comparison -> (Shoal row, peer row, title, short title for the plot)
    "cli": ("cli_shoal", "cli_docker", "CLI vs CLI", "CLI vs CLI"),
    "cli_no_daemon": ("cli_shoal_no_daemon", "cli_docker", "CLI, no daemon, vs docker run", "CLI, no daemon"),
    "sdk": ("sdk_shoal", "sdk_docker", "SDK vs SDK (both through their daemon)", "SDK vs SDK"),
    "sdk_in_process": ("sdk_shoal_in_process", "sdk_docker", "Shoal SDK in-process vs Docker SDK",
                       "SDK in-process\nvs Docker SDK"),
    "runtime": ("cli_shoal_no_daemon", "runtime_runc", "runtime vs runtime (fresh process, no engine daemon)",
                "runtime vs runtime"),
    "sdk_gvisor": ("sdk_shoal_gvisor", "sdk_docker_gvisor", "gVisor: SDK vs SDK (both through their daemon)",
                   "gVisor SDK vs SDK"),
}


def make_samplers(shoal_sock: Path, proc_root: Path, docker_env: dict | None, docker_cli: str,
                  bundle: Path | None) -> dict[str, Callable[[], None]]:
    """Each sampler does one full unit of work and raises on failure."""
    # the CLI reaches this benchmark's daemon by its socket; the in-process rows ask for `local` explicitly
    env_d = dict(os.environ, SHOAL_ROOT=str(shoal_sock.parent), SHOAL_URL=f"unix://{shoal_sock}")
    env_p = dict(env_d, SHOAL_ROOT=str(proc_root), SHOAL_URL="local")
    shoal = str(Path(sys.executable).with_name("shoal"))
    if not os.path.exists(shoal):
        raise SystemExit(f"{shoal} missing: install the package (make setup)")

    def sh(argv: list[str], env: dict | None) -> Callable[[], None]:
        def run() -> None:
            r = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            if r.returncode != 0:
                raise RuntimeError(f"{argv}: exit {r.returncode}: {r.stderr.decode(errors='replace')[-300:]}")
        return run

    url = f"unix://{shoal_sock}"

    def sdk_shoal() -> None:
        sb = Sandbox.create(IMAGE, url=url)
        assert sb.commands.run(["true"]).exit_code == 0
        sb.kill()

    def sdk_shoal_gvisor() -> None:
        sb = Sandbox.create(IMAGE, url=url, backend="gvisor")
        assert sb.commands.run(["true"]).exit_code == 0
        sb.kill()

    def sdk_in_process() -> None:
        sb = Sandbox.create(IMAGE, root=proc_root, url="local")
        assert sb.commands.run(["true"]).exit_code == 0
        sb.kill()

    out: dict[str, Callable[[], None]] = {
        "python_start": sh([sys.executable, "-c", "pass"], env_p),
        "import_sdk": sh([sys.executable, "-c", "import shoal.sdk.sandbox"], env_p),
        "cli_shoal": sh([shoal, "run", IMAGE, "--", "true"], env_d),
        "cli_shoal_no_daemon": sh([shoal, "run", "--in-process", IMAGE, "--", "true"], env_p),
        "sdk_shoal": sdk_shoal,
        "sdk_shoal_in_process": sdk_in_process,
    }
    if shutil.which("runsc"):
        out["sdk_shoal_gvisor"] = sdk_shoal_gvisor
    if docker_env is not None:
        import docker

        client = docker.DockerClient(base_url=docker_env.get("DOCKER_HOST", "unix:///var/run/docker.sock"))

        def sdk_docker() -> None:
            c = client.containers.run("shoal-bench-busybox:latest", ["sleep", "3600"], detach=True,
                                      network_mode="none")
            code, _ = c.exec_run(["true"])
            assert code == 0
            c.remove(force=True)

        out["cli_docker"] = sh([docker_cli, "run", "--rm", "--network=none", "shoal-bench-busybox:latest", "true"],
                               docker_env)
        out["sdk_docker"] = sdk_docker
        if shutil.which("runsc"):
            def sdk_docker_gvisor() -> None:
                c = client.containers.run("shoal-bench-busybox:latest", ["sleep", "3600"], detach=True,
                                          network_mode="none", runtime="runsc")
                code, _ = c.exec_run(["true"])
                assert code == 0
                c.remove(force=True)

            out["sdk_docker_gvisor"] = sdk_docker_gvisor
    if bundle is not None:
        counter = [0]

        def runc() -> None:
            counter[0] += 1
            sh(["runc", "run", "--bundle", str(bundle), f"shoal-bench-{os.getpid()}-{counter[0]}"], None)()

        out["runtime_runc"] = runc
    return out


def cpu_here() -> float:
    """CPU seconds of this process and of the children it has waited for (the fresh CLI processes,
    shoal-init launchers of in-process creates)."""
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def cpu_of(pid: int) -> float:
    """CPU seconds of a process and its waited-for children (shoald: its handlers and launchers)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def interleaved(samplers: dict[str, Callable[[], None]], n: int, runs: int, warmup: int = 5,
                daemon_pid: int | None = None) -> dict:
    """One sample of every row per round, the order rotated each round; `runs` runs of n rounds.
    Beside wall time, the CPU each sample cost here (client side) and in shoald (its mean: /proc
    counts in clock ticks), which the machine's load inflates far less than wall time."""
    keys = list(samplers)
    for _ in range(warmup):
        for k in keys:
            samplers[k]()
    per_run: dict[str, list[list[float]]] = {k: [] for k in keys}
    cpu = {k: 0.0 for k in keys}
    dcpu = {k: 0.0 for k in keys}
    for run in range(runs):
        times: dict[str, list[float]] = {k: [] for k in keys}
        for i in range(n):
            order = keys[i % len(keys):] + keys[:i % len(keys)]
            for k in order:
                c0, d0 = cpu_here(), cpu_of(daemon_pid) if daemon_pid else 0.0
                t0 = time.perf_counter()
                samplers[k]()
                times[k].append(time.perf_counter() - t0)
                cpu[k] += cpu_here() - c0
                dcpu[k] += (cpu_of(daemon_pid) - d0) if daemon_pid else 0.0
        for k in keys:
            per_run[k].append(times[k])
        console.print(f"run {run + 1}/{runs}: " + ", ".join(
            f"{k} {statistics.median(times[k]) * 1000:.1f}" for k in keys) + " (p50 ms)")
    out = {}
    for k in keys:
        every = [x for r in per_run[k] for x in r]
        p50s = [round(statistics.median(r) * 1000, 3) for r in per_run[k]]
        out[k] = {**summary(every), "p50_runs_ms": p50s, "p50_min_ms": min(p50s),
                  "p50_median_ms": round(statistics.median(p50s), 3), "p50_max_ms": max(p50s),
                  "cpu_here_ms_mean": round(cpu[k] / len(every) * 1000, 2),
                  "cpu_shoald_ms_mean": round(dcpu[k] / len(every) * 1000, 2)}
    return out


def headline(res: dict) -> dict:
    """What `history` keeps of a run: when, under what load, the CLI goal's two figures."""
    h, g = res.get("host", {}), res.get("goal", {})
    return {"date": res.get("date"), "command": res.get("command"), "loadavg_1m_before": h.get("loadavg_1m_before"),
            "loadavg_1m_after": h.get("loadavg_1m_after"), "cli_p50_ms": g.get("cli_p50_ms"),
            "cli_speedup": g.get("cli_speedup"), "met": g.get("met")}


def history(previous: dict, keep: int = 8) -> list[dict]:
    """The earlier runs' headlines, oldest first, this file's previous run last."""
    if "goal" not in previous:
        return list(previous.get("history", []))[-keep:]
    return [*previous.get("history", []), headline(previous)][-keep:]


def compare(rows: dict) -> dict:
    out = {}
    for name, (mine, peer, title, _) in COMPARISONS.items():
        a, b = rows.get(mine), rows.get(peer)
        if not (a and b):
            continue
        ratios = [y / x for x, y in zip(a["p50_runs_ms"], b["p50_runs_ms"])]
        out[name] = {"title": title, "shoal": mine, "peer": peer, "speedup_p50": round(b["p50_ms"] / a["p50_ms"], 2),
                     "speedup_p50_min": round(min(ratios), 2), "speedup_p50_max": round(max(ratios), 2)}
    return out


def goal(rows: dict, comps: dict) -> dict:
    cli = rows.get("cli_shoal")
    g: dict = {"cli_p50_ms_max": GOAL_CLI_P50_MS, "cli_speedup_min": GOAL_CLI_SPEEDUP}
    if not cli:
        return g
    g["cli_p50_ms"] = cli["p50_ms"]
    g["cli_speedup"] = comps.get("cli", {}).get("speedup_p50")
    gaps = []
    if cli["p50_ms"] > GOAL_CLI_P50_MS:
        over = cli["p50_ms"] - GOAL_CLI_P50_MS
        gaps.append(f"p50 {cli['p50_ms']:.1f} ms is {over:.1f} ms over {GOAL_CLI_P50_MS:g} ms")
    if g["cli_speedup"] is None:
        gaps.append("no docker run to compare against")
    elif g["cli_speedup"] < GOAL_CLI_SPEEDUP:
        gaps.append(f"{g['cli_speedup']:.2f}x faster than docker run, goal {GOAL_CLI_SPEEDUP:g}x")
    g["met"] = not gaps
    g["gap"] = "; ".join(gaps) or None
    return g


# ------------------------------------------------------------------------------------------ report
def _ms(v: float) -> str:
    return f"{v:.2f} ms" if v < 10 else f"{v:.1f} ms" if v < 100 else f"{v:.0f} ms"


ORDER = ("cli", "sdk", "runtime", "cli_no_daemon", "sdk_in_process", "sdk_gvisor")  # headline pairs first


def _spread(r: dict) -> str:
    return f"{_ms(r['p50_min_ms'])}–{_ms(r['p50_max_ms'])}"


def comparison_rows(res: dict) -> list[list[str]]:
    """The README's comparison table, one line per side: comparison, side, what runs, p50, p99,
    p50 min–max over runs, how much faster Shoal is (the ratio of the p50s over all samples, then the
    min–max of the per-run ratios, which need not bracket it)."""
    rows, comps = res["rows"], res["comparisons"]
    out = []
    for name in (n for n in ORDER if n in comps):
        c = comps[name]
        a, b = rows[c["shoal"]], rows[c["peer"]]
        sp = c["speedup_p50"]
        how = (f"**{sp:.2f}×**" if sp >= 1 else f"{sp:.2f}× (Shoal {1 / sp:.1f}× slower)") + \
            f" (per run {c['speedup_p50_min']:.2f}–{c['speedup_p50_max']:.2f})"
        peer = "Docker" if "docker" in c["peer"] else "runc"
        out.append([c["title"], "Shoal", a["label"], _ms(a["p50_ms"]), _ms(a["p99_ms"]), _spread(a), how])
        out.append(["", peer, b["label"], _ms(b["p50_ms"]), _ms(b["p99_ms"]), _spread(b), ""])
    return out


SHOAL_ROWS = (("cold_create_exec", "Shoal cold create → first exec", "≤ 25 ms p50"),
              ("warm_acquire_exec", "Shoal warm-pool acquire → exec", "≤ 5 ms p50"),
              ("exec_true", "Shoal exec of `true` in a live sandbox", ""),
              ("session_cmd", "Shoal persistent-session command overhead", "≤ 1 ms p50"))


def shoal_rows(res: dict) -> list[list[str]]:
    """The README's table of Shoal's own in-process figures: measurement, p50, p99, p50 min–max, goal."""
    s = res["shoal"]
    out = [[label, _ms(s[k]["p50_ms"]), _ms(s[k]["p99_ms"]), _spread(s[k]), goal_txt]
           for k, label, goal_txt in SHOAL_ROWS]
    r1, r2 = s["creations_per_s_1t_runs"], s["creations_per_s_2t_runs"]
    out.append(["Shoal sustained creations/s", f"{s['creations_per_s_1t']:.0f}/s (1 thread), "
                f"{s['creations_per_s_2t']:.0f}/s (2 threads)", "",
                f"{min(r1):.0f}–{max(r1):.0f}/s, {min(r2):.0f}–{max(r2):.0f}/s", "≥ 100/s"])
    return out


def md_table(header: list[str], align: str, rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|",
            *("| " + " | ".join(r) + " |" for r in rows)]


def readme_section(res: dict) -> str:
    """The README's "Startup" section, rendered from startup.json alone."""
    rows, s = res["rows"], res["shoal"]
    h, v, cfg = res["host"], res["versions"], res["config"]
    lines = [f"## Startup, measured on this machine ({res['date']}, {h['cores']} cores, Linux "
             f"{'.'.join(h['kernel'].split('.')[:2])}, cgroup v{h['cgroup']})", "",
             f"`{res['command']}` (JSON in `bench/results/startup.json`). Every sample runs `true` in a new "
             "sandbox or container made from the same busybox rootfs, network off, and removes it. All rows "
             f"run interleaved in the same run (one sample of each per round), {cfg['runs']} runs of {cfg['n']} "
             "rounds; p50 and p99 are over all samples, the spread is the min–max of the per-run p50, and "
             "\"Shoal faster\" is the ratio of the two p50s, then the min–max of the per-run ratios. Other "
             "work shared this 2-core machine during the run" + (
                 f" (1-minute load average {h['loadavg_1m_before']} before, {h['loadavg_1m_after']} after)"
                 if "loadavg_1m_before" in h else "") + ", so absolute figures move between runs; the ratios, "
             "taken from the same rounds, move less.", "",
             "<!-- numbers: startup (bench/results/startup.json) -->",
             *md_table(["comparison", "side", "what runs (one sample)", "p50", "p99", "p50, min–max over runs",
                        "Shoal faster (p50)"], "lllrrrr", comparison_rows(res))]
    g = res["goal"]
    verdict = "**met**" if g.get("met") else f"**missed**: {g.get('gap')}"
    hist = [x for x in res.get("history", []) if x.get("cli_p50_ms")]
    lines += ["", f"Goal for the CLI: `shoal run IMG -- true` with a warm daemon at p50 ≤ {g['cli_p50_ms_max']:g} ms "
              f"and ≥ {g['cli_speedup_min']:g}× faster than `docker run --rm`, in one run: {verdict} "
              f"(p50 {_ms(g['cli_p50_ms'])}" + (f", {g['cli_speedup']:.2f}×" if g.get("cli_speedup") else "") +
              ")." + (" Earlier runs of this benchmark (`history` in the JSON), most under heavier load from "
                      "other work on the machine: " + "; ".join(
                          f"p50 {_ms(x['cli_p50_ms'])}, {x['cli_speedup']:.2f}× ("
                          + (f"load {x['loadavg_1m_before']}–{x['loadavg_1m_after']}, "
                             if x.get("loadavg_1m_before") is not None else "load not recorded, ")
                          + ("met" if x.get("met") else "missed") + ")" for x in hist) + "." if hist else ""),
              "", "What each row includes "
              "(`rows.<key>` in the JSON):", ""]
    for key, r in rows.items():
        lines.append(f"- `{key}`: {r['includes']}.")
    ctx = [k for k in ("python_start", "import_sdk") if k in rows]
    if ctx:
        lines += ["", "Context (fresh processes, same rounds): " + "; ".join(
            f"{rows[k]['label']} p50 {_ms(rows[k]['p50_ms'])} ({_spread(rows[k])})" for k in ctx) + ". "
            "The runtime row's Shoal side is mostly these imports; Shoal's runtime itself is the in-process "
            "SDK row."]
    if "cpu_here_ms_mean" in rows.get("cli_shoal", {}):
        c = {k: rows[k] for k in ("cli_shoal", "cli_docker", "sdk_shoal", "python_start") if k in rows}
        lines += ["", "CPU per sample, mean (load inflates it far less than wall time): `shoal run` "
                  f"{c['cli_shoal']['cpu_here_ms_mean']:.1f} ms in the CLI process (the bare interpreter: "
                  f"{c['python_start']['cpu_here_ms_mean']:.1f} ms) + {c['cli_shoal']['cpu_shoald_ms_mean']:.1f} ms "
                  "in shoald (create, streamed exec, delete; the sandbox's own processes not counted)" +
                  (f"; `docker run` {c['cli_docker']['cpu_here_ms_mean']:.1f} ms in the docker CLI (dockerd, "
                   "containerd and the shim not counted)" if "cli_docker" in c else "") + "."]
    lines += ["", f"Versions: Shoal {v['shoal']}, Python {v['python']}, "
              f"Docker engine {v.get('docker_server') or 'n/a'} "
              f"(CLI {v.get('docker_cli') or 'n/a'}, Python SDK `docker` {v.get('docker_sdk') or 'n/a'}), "
              f"{v.get('runc') or 'runc n/a'}. Shoal's bytecode is compiled before timing, as an install "
              "leaves it.", "",
              "`shoal run` and `shoal exec` go to shoald (`$SHOAL_URL=unix://…`, else the host's "
              "`/run/shoal/shoald.sock`): that path is `shoal.cli_fast`, which imports no third-party module. "
              "With `--in-process` or `SHOAL_URL=local` (root only), or when no daemon answers, the sandbox "
              "runs in the CLI's own process through the SDK (typer and rich are imported only for the other "
              "commands). The benchmark's own daemon listens on a private socket.", "",
              f"Shoal's own figures, in-process (no CLI, no daemon; {s['cold_create_exec']['n']} samples per run, "
              f"{cfg['runs']} runs, after the rounds above):", "",
              "<!-- numbers: startup-shoal (bench/results/startup.json) -->",
              *md_table(["measurement", "p50", "p99", "p50, min–max over runs", "goal"], "lrrrl", shoal_rows(res)),
              "", "![startup latency](bench/results/startup.png)", ""]
    return "\n".join(lines)


def write_readme(path: Path, section: str) -> None:
    text = path.read_text()
    start = text.index("## Startup")
    end = text.index("\n## ", start + 1) + 1
    path.write_text(text[:start] + section.rstrip("\n") + "\n\n" + text[end:])


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, comps = res["rows"], res["comparisons"]
    names = [n for n in ORDER if n in comps]
    fig, ax = plt.subplots(figsize=(9, 0.9 + 0.75 * len(names)))
    y = 0.0
    ticks, ticklabels = [], []
    for name in names:
        c = comps[name]
        for side, color, dy in (("shoal", "#2a9d8f", 0.2), ("peer", "#e76f51", -0.2)):
            r = rows[c[side]]
            med = r["p50_median_ms"]
            err = [[med - r["p50_min_ms"]], [r["p50_max_ms"] - med]]
            ax.barh(y + dy, med, height=0.38, color=color, xerr=err, capsize=3)
            ax.text(r["p50_max_ms"] * 1.08, y + dy, f"{med:.1f} ms  {r['label'][:60]}", va="center", fontsize=7)
        ticks.append(y)
        ticklabels.append(f"{COMPARISONS[name][3]}\nShoal {c['speedup_p50']:.2f}x")
        y -= 1.2
    ax.set_yticks(ticks, ticklabels, fontsize=8)
    ax.set_xscale("log")
    lo = min(rows[comps[n][s]]["p50_min_ms"] for n in names for s in ("shoal", "peer"))
    hi = max(rows[comps[n][s]]["p50_max_ms"] for n in names for s in ("shoal", "peer"))
    ax.set_xlim(lo / 2, hi * 120)  # room for the labels, the legend right of them
    ax.axvline(GOAL_CLI_P50_MS, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("ms, log scale: median of the per-run p50, whiskers min–max over runs")
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color="#2a9d8f", label="Shoal"), Patch(color="#e76f51", label="peer"),
                       plt.Line2D([], [], color="grey", lw=0.8, ls="--", label=f"CLI goal {GOAL_CLI_P50_MS:g} ms")],
              loc="upper right", fontsize=7)
    ax.set_title(f"Start `true` in a fresh sandbox, remove it ({res['date']}, {res['host']['cores']} cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=60, help="rounds per run (one sample of every row per round)")
    ap.add_argument("--runs", type=int, default=3, help="runs (min/median/max of the p50 over them)")
    ap.add_argument("--shoal-n", type=int, default=200, help="iterations of Shoal's own in-process latencies")
    ap.add_argument("--batch", type=int, default=200, help="sandboxes per creations/s batch")
    ap.add_argument("--no-docker", action="store_true")
    ap.add_argument("--out", default=str(RESULTS / "startup.json"), help="JSON path (the PNG goes beside it)")
    ap.add_argument("--readme", default=None, help="rewrite this README's Startup section from the JSON")
    ap.add_argument("--render-only", action="store_true", help="no measuring: redraw PNG/README from --out")
    args = ap.parse_args()
    out = Path(args.out)
    if args.render_only:
        res = json.loads(out.read_text())
        plot(res, out.with_suffix(".png"))
        if args.readme:
            write_readme(Path(args.readme), readme_section(res))
        return

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-up (engines, mounts) on kill
    # bytecode as an install leaves it (pip compiles at install): an environment with
    # PYTHONDONTWRITEBYTECODE would otherwise recompile Shoal's modules in every CLI process
    compileall.compile_dir(REPO / "src" / "shoal", quiet=1)
    cg = "2" if os.path.exists("/sys/fs/cgroup/cgroup.controllers") else "1"
    argv, shown = sys.argv[1:], []
    for i, a in enumerate(argv):  # the command as README shows it: without where the output went
        if a.startswith(("--out", "--readme")) or (i and argv[i - 1] in ("--out", "--readme")):
            continue
        shown.append(a)
    res: dict = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(["bench/startup.py", *shown]),
                 "host": {"cores": os.cpu_count(), "kernel": os.uname().release, "cgroup": cg},
                 "config": {"n": args.n, "runs": args.runs, "shoal_n": args.shoal_n, "batch": args.batch,
                            "image": "busybox rootfs (shoal.layers.busybox)", "workload": "true",
                            "bytecode": "src/shoal compiled first (compileall), as an install leaves it"}}
    from shoal import __version__

    res["versions"] = {"shoal": __version__, "python": platform.python_version()}
    tmp = Path(tempfile.mkdtemp(prefix="shoal-bench-", dir="/tmp"))
    root_d, root_p = tmp / "d", tmp / "p"  # the daemon's root and the in-process one: no shared sweeps
    root_d.mkdir()
    root_p.mkdir()
    dockerd = shoald = None
    try:
        for r in (root_d, root_p):
            shoal_image(r)
        shoald = Shoald(root_d)
        docker_env = None
        docker_cli = "/usr/bin/docker" if os.path.exists("/usr/bin/docker") else (shutil.which("docker") or "docker")
        if not args.no_docker:
            dockerd = PrivateDockerd()
            if not dockerd.up():
                console.print(f"[yellow]{dockerd.error}[/yellow]")
            else:
                docker_env = dockerd.env()
                tar = rootfs_tar(str(tmp / "dockerimg"))
                subprocess.run([docker_cli, "import", tar, "shoal-bench-busybox:latest"], check=True,
                               capture_output=True, env=docker_env)
                import docker

                res["versions"].update(
                    docker_server=version([docker_cli, "version", "--format", "{{.Server.Version}}"], docker_env),
                    docker_cli=version([docker_cli, "version", "--format", "{{.Client.Version}}"], docker_env),
                    docker_sdk=docker.__version__)
        bundle = None
        if shutil.which("runc"):
            bundle = runc_bundle(tmp / "bundle")
            res["versions"]["runc"] = version(["runc", "--version"])
        samplers = make_samplers(shoald.sock, root_p, docker_env, docker_cli, bundle)
        res["host"]["loadavg_1m_before"] = round(os.getloadavg()[0], 2)
        rows = interleaved(samplers, args.n, args.runs, daemon_pid=shoald.proc.pid)
        res["host"]["loadavg_1m_after"] = round(os.getloadavg()[0], 2)  # others' work on the machine
        for key, r in rows.items():
            r.update(label=ROWS[key][2], includes=ROWS[key][3],
                     workload="no sandbox" if ROWS[key][0] is None else "`true` in a busybox rootfs, removed after")
        res["rows"] = {k: rows[k] for k in ROWS if k in rows}
        res["comparisons"] = compare(res["rows"])
        res["goal"] = goal(res["rows"], res["comparisons"])
        shoald.down()
        shoald = None
        res["shoal"] = shoal_runs(root_p, args.shoal_n, args.batch, args.runs)
        Host.get(root_p).gc()
    finally:
        if shoald:
            shoald.down()
        if dockerd:
            dockerd.down()
        for r in (root_d, root_p):
            wipe(r)
        shutil.rmtree(tmp, ignore_errors=True)

    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():  # keep the headline of earlier runs: one good run must not hide the others
        res["history"] = history(json.loads(out.read_text()))
    out.write_text(json.dumps(res, indent=2) + "\n")
    plot(res, out.with_suffix(".png"))
    section = readme_section(res)
    console.print(section, markup=False, highlight=False)
    if args.readme:
        write_readme(Path(args.readme), section)
    console.print(f"wrote {out} and {out.with_suffix('.png')}")



if __name__ == "__main__":
    main()
