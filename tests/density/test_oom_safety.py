"""Memory safety of a full host (issue 16, Safety): the OOM killer takes sandbox processes, never
shoald, the supervisors or the host; an OOM kill is reported (ExecResult.oom_killed, or the tombstone
`oom` under oom_kill="sandbox"); sandbox code cannot make itself less killable.

Allocations are busybox `dd bs=<N>M`: dd allocates and fills an N MiB buffer, anonymous memory that
the sandbox's memory cgroup is charged for."""
from __future__ import annotations

import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
from daemonctl import start_daemon
from roots import teardown_root

from shoal import Host, Sandbox
from shoal.core.errors import SandboxOutOfMemory
from shoal.layers.busybox import make_busybox_tree


def alloc(mib: int) -> str:
    return f"dd if=/dev/zero of=/dev/null bs={mib}M count=1"


def test_command_past_its_limit_is_oom_killed_and_the_sandbox_lives_on(host, base_image):
    with Sandbox.create(base_image, memory_mb=48, disk_mb=16, root=host.settings.root) as sb:
        r = sb.commands.run(alloc(200), timeout=30)
        assert r.oom_killed, r
        assert r.exit_code == 137 and r.signal == 9
        # the sandbox (its init, the supervisor) survived: it still runs commands and says why
        again = sb.commands.run("echo alive", timeout=10)
        assert again.stdout == "alive\n" and not again.oom_killed
        small = sb.commands.run(alloc(8), timeout=30)
        assert small.exit_code == 0 and not small.oom_killed
        # a SIGKILL that is not the OOM killer's is not reported as one
        killed = sb.commands.run("sh -c 'kill -9 $$'", timeout=10)
        assert killed.exit_code == 137 and not killed.oom_killed
        # background commands say it too
        bg = sb.commands.start(alloc(200))
        res = bg.wait(30)
        assert res.oom_killed and res.exit_code == 137, res
        bg2 = sb.commands.start("sleep 30")
        bg2.kill()
        assert not bg2.wait(10).oom_killed


def test_oom_kill_sandbox_policy_ends_it_with_tombstone_oom(host, base_image):
    sb = Sandbox.create(base_image, memory_mb=48, disk_mb=16, root=host.settings.root, oom_kill="sandbox")
    assert sb.info().limits.oom_kill == "sandbox"
    with pytest.raises(SandboxOutOfMemory, match="ran out of memory: its limit of 48 MiB"):
        sb.commands.run(alloc(200), timeout=30)
    tomb = (host.settings.tombstones_dir / sb.id).read_text()
    assert tomb == "oom 48"
    with pytest.raises(SandboxOutOfMemory):
        sb.info()


def wait_for_tombstone(host, sandbox_id: str, timeout: float = 15.0) -> str | None:
    path = host.settings.tombstones_dir / sandbox_id
    deadline = time.monotonic() + timeout
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return path.read_text() if path.exists() else None


def test_oom_kill_sandbox_policy_ends_it_for_a_process_shoal_did_not_start(host, base_image):
    """A session's own child, started by the shell inside the sandbox, not by Shoal: only the
    supervisor can see its OOM kill (on v1 the kernel's notification comes before the kill is
    counted, so the supervisor looks again). Nobody waits on any handle; the sandbox still ends."""
    sb = Sandbox.create(base_image, memory_mb=48, disk_mb=16, root=host.settings.root, oom_kill="sandbox")
    session = sb.sessions.create()
    session.run(f"({alloc(200)}) >/dev/null 2>&1 &", timeout=10)
    assert wait_for_tombstone(host, sb.id) == "oom 48"
    with pytest.raises(SandboxOutOfMemory, match="its limit of 48 MiB"):
        sb.info()


def test_oom_kill_sandbox_policy_ends_it_for_a_background_command_nobody_waits_on(host, base_image):
    sb = Sandbox.create(base_image, memory_mb=48, disk_mb=16, root=host.settings.root, oom_kill="sandbox")
    sb.commands.start(alloc(200))
    assert wait_for_tombstone(host, sb.id) == "oom 48"


def test_a_kill_through_shoal_is_not_taken_for_an_oom(host, base_image):
    sb = Sandbox.create(base_image, memory_mb=48, disk_mb=16, root=host.settings.root, oom_kill="sandbox")
    r = sb.commands.run("true", timeout=10)
    assert r.exit_code == 0
    sb.kill()
    assert (host.settings.tombstones_dir / sb.id).read_text() == "killed"


def host_can_lower_oom_scores() -> bool:
    """Whether root here really holds CAP_SYS_RESOURCE (some hosts, e.g. a VM's root in a restricted
    user namespace or under an LSM, refuse every oom_score_adj under 0 even to root)."""
    r = subprocess.run(["sh", "-c", "echo -1 > /proc/self/oom_score_adj"], capture_output=True)
    return r.returncode == 0


def test_sandbox_cannot_lower_its_oom_score(host, base_image):
    """Init and every command start at +500 (commands +600), and 500 is a floor the sandbox cannot go
    under: lowering oom_score_adj needs CAP_SYS_RESOURCE, which no sandbox process holds."""
    privileged = host_can_lower_oom_scores()
    with Sandbox.create(base_image, memory_mb=64, disk_mb=16, root=host.settings.root) as sb:
        assert sb.commands.run("cat /proc/self/oom_score_adj").stdout.strip() == "600"
        assert sb.commands.run("cat /proc/1/oom_score_adj").stdout.strip() == "500"
        # where the host itself cannot set a floor under its own 0, the kernel's floor is 0: the
        # sandbox still cannot go under it, and so never under shoald or the supervisors
        refused = ("-1000", "-900", "-1", "0", "499") if privileged else ("-1000", "-900", "-1")
        for target in ("self", "1"):
            for value in refused:
                r = sb.commands.run(f"echo {value} > /proc/{target}/oom_score_adj", timeout=10)
                assert r.exit_code != 0, (target, value, r)
        # through the legacy file too (oom_adj -17 = disable)
        assert sb.commands.run("echo -17 > /proc/self/oom_adj").exit_code != 0
        assert sb.commands.run("cat /proc/1/oom_score_adj").stdout.strip() == "500"
        # raising is allowed (a process may volunteer)
        r = sb.commands.run("echo 900 > /proc/self/oom_score_adj && cat /proc/self/oom_score_adj")
        assert r.stdout.strip() == "900"
        if not privileged:
            pytest.skip("this host refuses root an oom_score_adj under 0 (no effective CAP_SYS_RESOURCE): "
                        "the 500 floor and the supervisor's -900 cannot be set here; the rest held")
        meta = host.backend("container")._load(sb.id)  # type: ignore[attr-defined]
        assert Path(f"/proc/{meta['sup_pid']}/oom_score_adj").read_text().strip() == "-900"
        r = sb.commands.run("echo 900 > /proc/self/oom_score_adj && echo 500 > /proc/self/oom_score_adj && "
                            "cat /proc/self/oom_score_adj")
        assert r.stdout.strip() == "500"


def test_daemon_protection_moves_it_apart_and_lowers_its_score():
    """protect_daemon: shoald's own memory cgroup (v2: memory.min), oom_score_adj -900 where root may
    set it; a daemon someone else placed (systemd, a harness) is left where it is."""
    from shoal.server.protect import _memory_hierarchy, current_memory_cgroup, protect_daemon

    hier = _memory_hierarchy()
    if hier is None:
        pytest.skip("no memory cgroup controller on this host")
    version, mount = hier
    name = f"shoal-system-test-{os.getpid()}"
    child = subprocess.Popen(["sleep", "60"])
    try:
        before = current_memory_cgroup(child.pid)
        left = protect_daemon(name, 64, pid=child.pid)  # move=None: placed by someone unless at "/"
        assert current_memory_cgroup(child.pid) == before
        assert left.cgroup == before
        p = protect_daemon(name, 64, move=True, pid=child.pid)
        assert current_memory_cgroup(child.pid) == f"/{name}" == p.cgroup
        if version == 2:
            assert (mount / name / "memory.min").read_text().strip() == str(64 << 20)
            assert p.memory_min_mb == 64
        adj = Path(f"/proc/{child.pid}/oom_score_adj").read_text().strip()
        if host_can_lower_oom_scores():
            assert adj == "-900" and p.oom_score_adj == -900
        else:  # said, not silently skipped
            assert adj == "0" and any("oom_score_adj" in r for r in p.refused)
    finally:
        child.kill()
        child.wait()
        for _ in range(100):
            try:
                (mount / name).rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.02)


# ------------------------------------------------------------------ all sandboxes together
AGGREGATE_MB = 256


@pytest.fixture(scope="module")
def bounded_daemon(tmp_path_factory):
    """shoald on a root of its own whose sandboxes may use AGGREGATE_MB together (the config file's
    [density] sandboxes_memory_mb), each allowed far more on its own."""
    root = Path(tempfile.mkdtemp(prefix="shoal-oom-", dir="/tmp"))
    cfg = root / "config.toml"
    cfg.write_text(f"[density]\nsandboxes_memory_mb = {AGGREGATE_MB}\n")
    old = os.environ.get("SHOAL_CONFIG")
    os.environ["SHOAL_CONFIG"] = str(cfg)
    try:
        host = Host.get(root)
        # no swap for these sandboxes: with a swap device on the host (a zram another test set up) the
        # kernel would push the zero-filled buffers out instead of killing, and nothing would be tested
        parent = host.backend("container").cgroups.parent_memory_dir()  # type: ignore[attr-defined]
        if (parent / "memory.swap.max").exists():
            (parent / "memory.swap.max").write_text("0")
        elif (parent / "memory.memsw.limit_in_bytes").exists():
            (parent / "memory.limit_in_bytes").write_text(str(AGGREGATE_MB << 20))
            (parent / "memory.memsw.limit_in_bytes").write_text(str(AGGREGATE_MB << 20))
        tree = make_busybox_tree(tmp_path_factory.mktemp("busybox-oom"))
        host.store.build_from_dir(tree, source="busybox", name="busybox")
        host.store.create_image("busybox:oom", ["busybox"])
        proc = start_daemon(root, env={"SHOAL_CONFIG": str(cfg)})
    finally:
        if old is None:
            os.environ.pop("SHOAL_CONFIG", None)
        else:
            os.environ["SHOAL_CONFIG"] = old
    sock = root / "shoald.sock"
    yield {"root": root, "url": f"unix://{sock}", "sock": sock, "proc": proc, "host": host}
    proc.terminate()
    proc.wait(20)
    teardown_root(root)


def test_sandboxes_together_past_the_aggregate_limit_are_oom_killed_not_shoald(bounded_daemon):
    d = bounded_daemon
    host: Host = d["host"]
    be = host.backend("container")
    assert be.cgroups.parent_memory_limit_mb() == AGGREGATE_MB  # type: ignore[attr-defined]

    lat: list[float] = []
    errors: list[str] = []
    stop = threading.Event()

    def probe() -> None:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(d["sock"])), base_url="http://x",
                          timeout=5) as c:
            while not stop.is_set():
                t0 = time.perf_counter()
                try:
                    r = c.get("/v1/health")
                    if r.status_code != 200:
                        errors.append(f"HTTP {r.status_code}")
                except httpx.HTTPError as e:
                    errors.append(repr(e))
                lat.append(time.perf_counter() - t0)
                time.sleep(0.01)

    boxes = [Sandbox.create("busybox:oom", memory_mb=200, disk_mb=16, url=d["url"]) for _ in range(4)]
    t = threading.Thread(target=probe)
    t.start()
    try:
        # each asks 120 MiB, under its own 200 MiB; four together ask 480 MiB of the 256 allowed. Each
        # holds its buffer (dd copies it over and over) until the OOM killer or the test ends it, so
        # the total is reached however far apart a loaded host starts them (CI run of 2026-12-01:
        # a fixed 3 s hold did not overlap under load and nothing was killed)
        hold = "dd if=/dev/zero of=/dev/null bs=120M count=1000000"
        handles = [sb.commands.start(hold) for sb in boxes]
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and all(h.poll() is None for h in handles):
            time.sleep(0.1)
        results: list = []
        for h in handles:
            if h.poll() is None:
                h.kill()
            results.append(h.wait(15))
    finally:
        stop.set()
        t.join()
    killed = [r for r in results if r is not None and r.oom_killed]
    assert killed, results
    # shoald answered all along and still does; every sandbox is still there (policy "command")
    assert d["proc"].poll() is None
    assert not errors, errors[:5]
    lat.sort()
    p99 = lat[int(len(lat) * 0.99) - 1]
    print(f"health during the fill: n={len(lat)} p50={lat[len(lat) // 2] * 1e3:.1f} ms p99={p99 * 1e3:.1f} ms "
          f"max={lat[-1] * 1e3:.1f} ms; {len(killed)}/{len(boxes)} commands OOM-killed")
    # generous (the 100 ms goal is measured by bench/oom_fill.py, not asserted here); a guest under
    # software emulation (make test-vm without KVM) runs 10-30x slower
    assert p99 < (5.0 if os.environ.get("SHOAL_VM_ACCEL") == "tcg" else 1.0)
    for sb in boxes:
        assert sb.commands.run("echo ok", timeout=10).stdout == "ok\n"
        sb.kill()


def test_aggregate_oom_under_sandbox_policy_says_shared(bounded_daemon):
    """With oom_kill="sandbox", a sandbox whose process the aggregate limit killed ends with the
    tombstone `oom <aggregate MiB> shared`, and its error says it was all sandboxes together."""
    d = bounded_daemon
    host: Host = d["host"]
    holder = Sandbox.create("busybox:oom", memory_mb=200, disk_mb=256, url=d["url"])
    victim = Sandbox.create("busybox:oom", memory_mb=200, disk_mb=16, url=d["url"], oom_kill="sandbox")
    try:
        # the holder keeps 150 MiB in its tmpfs upper (charged to it, but no process's RSS, so the OOM
        # killer picks the victim's 150 MiB dd); 300 > 256 together, each well under its own 200
        assert holder.commands.run("dd if=/dev/zero of=/tmp/x bs=1M count=150", timeout=30).exit_code == 0
        with pytest.raises(SandboxOutOfMemory, match=f"together reached their limit of {AGGREGATE_MB} MiB"):
            victim.commands.run(alloc(150), timeout=30)
        assert (host.settings.tombstones_dir / victim.id).read_text() == f"oom {AGGREGATE_MB} shared"
        assert holder.commands.run("echo ok", timeout=10).stdout == "ok\n"
    finally:
        holder.kill()
