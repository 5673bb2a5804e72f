"""The gvisor backend through the Host (the contract), on the real runsc: lifecycle, commands,
sessions, processes, files, limits, TTLs, snapshot/fork, network and isolation."""
from __future__ import annotations

import io
import os
import shutil
import signal
import subprocess
import tarfile
import time

import pytest

from shoal.core.contract import (
    CreateRequest,
    ExecRequest,
    ForkRequest,
    NetworkRequest,
    SandboxState,
    SessionRequest,
    SnapshotRequest,
    StartRequest,
    TimeoutRequest,
)
from shoal.core.errors import (
    BackendUnavailable,
    CommandTimeout,
    FileOpError,
    InvalidArgument,
    PathOutsideSandbox,
    SandboxError,
    SandboxNotFound,
    SessionClosed,
)

pytestmark = pytest.mark.skipif(shutil.which("runsc") is None,
                                reason="runsc (gVisor) is not installed: `apt-get install -y runsc`")


def create(host, base_image, **kw):
    kw.setdefault("memory_mb", 256)
    kw.setdefault("disk_mb", 64)
    return host.create(CreateRequest(image=base_image, backend="gvisor", **kw))


@pytest.fixture
def gv(host, base_image):
    info = create(host, base_image)
    yield info.id
    try:
        host.kill(info.id)
    except SandboxNotFound:
        pass


def run(host, sid, *argv, **kw):
    return host.exec(sid, ExecRequest(argv=list(argv), **kw))


def sh(host, sid, script, **kw):
    return run(host, sid, "/bin/sh", "-c", script, **kw)


def wait_gone(host, sid, within: float) -> SandboxNotFound:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            host.info(sid)
        except SandboxNotFound as e:
            return e
        time.sleep(0.1)
    raise AssertionError(f"{sid} still alive after {within} s")


# ------------------------------------------------------------------ lifecycle and exec
def test_create_info_list_and_exec(host, gv):
    info = host.info(gv)
    assert info.id.startswith(f"gv-{host.settings.host_tag}-") and info.backend == "gvisor"
    assert info.state == SandboxState.RUNNING and info.memory_bytes and info.memory_bytes > 0
    assert gv in {i.id for i in host.list()}
    r = sh(host, gv, "echo out; echo err >&2; exit 3")
    assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (3, "out\n", "err\n", False)
    # it really is gVisor's kernel, not the host's
    assert "gVisor" in sh(host, gv, "dmesg").stdout


def test_env_cwd_and_missing_program(host, gv):
    r = sh(host, gv, 'echo "$PATH|$HOME|$HOSTNAME|$LANG|$FOO|$(pwd)"', env={"FOO": "a,b=c"}, cwd="/etc")
    assert r.stdout == f"/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin|/root|{gv}|C.UTF-8|a,b=c|/etc\n"
    assert sh(host, gv, "pwd").stdout == "/\n"  # cwd None = the sandbox's workdir
    r = run(host, gv, "/no/such/program")
    assert r.exit_code == 127 and "no such file" in r.stderr.lower()


def test_streaming_stdin_and_output_cap(host, gv):
    chunks: list[tuple[float, str]] = []
    t0 = time.monotonic()
    r = host.exec(gv, ExecRequest(argv=["/bin/sh", "-c", "echo first; sleep 1; echo second"]),
                  on_stdout=lambda s: chunks.append((time.monotonic() - t0, s)))
    assert "".join(c for _, c in chunks) == r.stdout == "first\nsecond\n"
    assert chunks[0][1].startswith("first") and chunks[0][0] < r.duration_s - 0.5  # arrived before the end
    assert run(host, gv, "cat", stdin=b"\x00bytes in").stdout == "\x00bytes in"
    r = sh(host, gv, "yes | head -c 100000", output_cap=1000)
    assert r.stdout_truncated and r.stdout_bytes == 100000 and len(r.stdout) < 1200
    assert r.stdout.startswith("y\ny\n") and r.stdout.endswith("y\n")


def test_timeout_kills_the_whole_tree(host, gv):
    r = sh(host, gv, "sleep 30 & sleep 31", timeout=1)
    assert r.timed_out and r.exit_code == 137 and r.signal == 9 and r.duration_s < 10
    ps = run(host, gv, "ps").stdout
    assert "sleep 30" not in ps and "sleep 31" not in ps, ps


# ------------------------------------------------------------------ sessions and processes
def test_session_state_persists_and_timeout_keeps_the_shell(host, gv):
    with host.open_session(gv, SessionRequest(env={"S": "1"})) as s:
        assert s.shell == "/bin/sh"
        assert s.run("cd /etc; X=42; export Y=7").exit_code == 0
        r = s.run("echo $X $Y $S; pwd; false")
        assert (r.stdout, r.exit_code) == ("42 7 1\n/etc\n", 1)
        assert s.run("syntax error (").exit_code != 0  # the shell survives a syntax error
        r = s.run("sleep 30", timeout=1)
        assert r.timed_out and r.exit_code == 137
        assert s.run("echo $X").stdout == "42\n"
        with pytest.raises(SessionClosed):
            s.run("exit 0")
    with pytest.raises(SessionClosed):
        s.run("true")


def test_background_process(host, gv):
    p = host.start(gv, StartRequest(argv=["/bin/sh", "-c", "echo a; sleep 0.5; echo b >&2; sleep 0.5; echo c"]))
    try:
        assert p.pid and p.pid > 1
        out = p.output()
        deadline = time.monotonic() + 5
        while "a" not in out.stdout and time.monotonic() < deadline:
            time.sleep(0.05)
            out = p.output()
        assert out.stdout == "a\n" and out.exit_code is None
        r = p.wait(10)
        assert (r.exit_code, r.stdout, r.stderr) == (0, "a\nc\n", "b\n")
        assert p.output(out.cursor).stdout == "c\n" and p.poll() == 0
    finally:
        p.close()
    q = host.start(gv, StartRequest(argv=["sleep", "60"]))
    try:
        with pytest.raises(CommandTimeout):
            q.wait(0.3)
        q.kill(15)
        assert q.wait(10).exit_code == 128 + 15
    finally:
        q.close()
    t = host.start(gv, StartRequest(argv=["sleep", "60"], timeout=0.5))
    try:
        r = t.wait(10)
        assert r.timed_out and r.exit_code == 137
    finally:
        t.close()


# ------------------------------------------------------------------ files
def test_files_roundtrip_both_ways(host, gv):
    assert host.write_file(gv, "/work/dir/a.txt", b"hello", mode=0o600) == 5
    assert run(host, gv, "cat", "/work/dir/a.txt").stdout == "hello"  # host write seen inside at once
    host.write_file(gv, "/work/dir/a.txt", b"changed")
    assert run(host, gv, "cat", "/work/dir/a.txt").stdout == "changed"
    assert host.write_file(gv, "/tmp/t", b"tmp too") and run(host, gv, "cat", "/tmp/t").stdout == "tmp too"
    sh(host, gv, "echo inside > /work/dir/b.txt; mkdir -p /work/dir/sub")
    assert host.read_file(gv, "/work/dir/b.txt") == b"inside\n"  # sandbox write seen on the host
    names = {e.name: e.type for e in host.list_files(gv, "/work/dir")}
    assert names == {"a.txt": "file", "b.txt": "file", "sub": "dir"}
    st = host.stat_file(gv, "/work/dir/a.txt")
    assert st.size == 7 and st.mode == 0o600
    host.mkdir(gv, "/work/new/deep")
    assert sh(host, gv, "test -d /work/new/deep").exit_code == 0
    host.remove_file(gv, "/work/dir/b.txt")
    assert sh(host, gv, "test -e /work/dir/b.txt").exit_code == 1
    with pytest.raises(FileOpError):
        host.read_file(gv, "/work/nothing")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        data = b"from tar"
        ti = tarfile.TarInfo("pkg/f.txt")
        ti.size = len(data)
        tf.addfile(ti, io.BytesIO(data))
    assert host.upload_tar(gv, "/up", buf.getvalue()) == 1
    assert run(host, gv, "cat", "/up/pkg/f.txt").stdout == "from tar"
    with tarfile.open(fileobj=io.BytesIO(host.download_tar(gv, "/up"))) as tf:
        assert tf.extractfile("up/pkg/f.txt").read() == b"from tar"


def test_files_cannot_reach_the_host(host, gv, tmp_path):
    secret = tmp_path / "host-secret"
    secret.write_text("host only")
    sh(host, gv, f"ln -s {secret} /work/link; ln -s /etc /work/etc-link; ln -s ../../../../.. /work/up")
    with pytest.raises(FileOpError):  # resolved inside the sandbox root, where it does not exist
        host.read_file(gv, "/work/link")
    with pytest.raises(FileOpError):
        host.read_file(gv, f"/work/up{secret}")
    with pytest.raises((FileOpError, PathOutsideSandbox)):
        host.read_file(gv, f"/../../../..{secret}")
    # writing through a symlink to /etc lands in the sandbox's /etc, never the host's
    host.write_file(gv, "/work/etc-link/shoal-gv-probe", b"x")
    assert not os.path.exists("/etc/shoal-gv-probe")
    assert run(host, gv, "cat", "/etc/shoal-gv-probe").stdout == "x"
    bad = io.BytesIO()
    with tarfile.open(fileobj=bad, mode="w") as tf:
        ti = tarfile.TarInfo("../../escape")
        tf.addfile(ti, io.BytesIO(b""))
    with pytest.raises(PathOutsideSandbox):
        host.upload_tar(gv, "/work", bad.getvalue())


# ------------------------------------------------------------------ pause, TTL, kill
def test_pause_resume_and_any_request_resumes(host, gv):
    sh(host, gv, "(while :; do echo t >> /work/ticks; sleep 0.1; done) >/dev/null 2>&1 &")
    time.sleep(0.5)
    host.pause(gv)
    assert host.info(gv).state == SandboxState.PAUSED
    upper = host.backend("gvisor").upper_dir(gv) / "work" / "ticks"
    n = len(upper.read_bytes())  # on the host: read_file would resume the sandbox
    time.sleep(0.6)
    assert len(upper.read_bytes()) == n  # frozen
    host.resume(gv)
    assert host.info(gv).state == SandboxState.RUNNING
    host.pause(gv)
    assert run(host, gv, "echo", "hi").stdout == "hi\n"  # a request resumes it
    assert host.info(gv).state == SandboxState.RUNNING


def test_ttl_idle_ttl_and_set_ttl(host, base_image):
    a = create(host, base_image, ttl=2)
    b = create(host, base_image, idle_ttl=2)
    c = create(host, base_image)
    try:
        # a request in flight is activity: a 3 s command outlives a 2 s idle TTL
        assert sh(host, b.id, "sleep 3; echo done").stdout == "done\n"
        assert "absolute TTL" in str(wait_gone(host, a.id, 10))
        assert host.info(b.id).state == SandboxState.RUNNING
        assert "idle TTL" in str(wait_gone(host, b.id, 10))
        info = host.set_ttl(c.id, TimeoutRequest(ttl=1))
        assert info.ttl == 1
        assert "absolute TTL" in str(wait_gone(host, c.id, 10))
        with pytest.raises(SandboxNotFound, match="TTL"):
            run(host, c.id, "true")
    finally:
        for s in (a, b, c):
            try:
                host.kill(s.id)
            except SandboxNotFound:
                pass


def test_kill_releases_everything(host, base_image):
    info = create(host, base_image)
    be = host.backend("gvisor")
    state = be.base / info.id
    assert os.path.ismount(state / "rootfs")
    meta = be._load(info.id)
    t0 = time.monotonic()
    host.kill(info.id)
    assert time.monotonic() - t0 < 0.5  # the release runs in the background (the Sentry exits slowly)
    with pytest.raises(SandboxNotFound, match="killed"):
        host.info(info.id)
    assert info.id not in {i.id for i in host.list()}
    assert be.wait_released(15)
    assert not state.exists() and not os.path.exists(f"/sys/fs/cgroup/memory{meta['cgroup_path']}")
    assert not os.path.exists(f"/proc/{meta['sandbox_pid']}/root/bin")
    with pytest.raises(SandboxNotFound, match="killed"):
        host.kill(info.id)
    with pytest.raises(SandboxNotFound):
        host.info("gv-nothere-000000000000")


def test_sweep_reaps_a_sandbox_whose_supervisor_died(host, base_image):
    info = create(host, base_image)
    be = host.backend("gvisor")
    meta = be._load(info.id)
    os.kill(meta["sup_pid"], signal.SIGKILL)
    time.sleep(0.2)
    assert info.id in be.sweep()
    with pytest.raises(SandboxNotFound, match="supervisor died"):
        host.info(info.id)
    assert not os.path.exists(be.base / info.id)
    assert not [n for n in os.listdir(be.runsc_root) if info.id in n]  # runsc's own state too
    # runsc state left without a sandbox dir (a crash between the two) is deleted as well
    other = create(host, base_image)
    state = be.base / other.id
    os.kill(be._load(other.id)["sup_pid"], signal.SIGKILL)
    for sub in ("rootfs", "upper"):
        subprocess.run(["umount", "-l", str(state / sub)], check=True)
    shutil.rmtree(state)
    assert [n for n in os.listdir(be.runsc_root) if other.id in n]
    be.sweep()
    assert not [n for n in os.listdir(be.runsc_root) if other.id in n]
    assert not os.path.exists(f"/proc/{meta['sandbox_pid']}/root/bin")  # runsc's sandbox process is gone


# ------------------------------------------------------------------ snapshot and fork
def test_snapshot_and_fork_through_the_host(host, gv):
    host.write_file(gv, "/work/state.txt", b"v1")
    sh(host, gv, "echo made-inside > /root/inside.txt")
    snap = host.snapshot(gv, SnapshotRequest())
    assert snap.source_sandbox == gv and snap.size > 0
    reply = host.fork(gv, ForkRequest(n=2))
    assert not reply.failed and len(reply.sandboxes) == 2
    try:
        ids = set()
        for child in reply.sandboxes:
            assert child.id.startswith("gv-") and child.backend == "gvisor"
            assert run(host, child.id, "cat", "/work/state.txt", "/root/inside.txt").stdout == "v1made-inside\n"
            ids.add(run(host, child.id, "cat", "/etc/machine-id").stdout)
        assert len(ids) == 2
        host.write_file(reply.sandboxes[0].id, "/work/state.txt", b"child")
        assert host.read_file(gv, "/work/state.txt") == b"v1"  # children are independent
    finally:
        for child in reply.sandboxes:
            host.kill(child.id)
    assert host.info(gv).state == SandboxState.RUNNING  # frozen only during the capture


# ------------------------------------------------------------------ limits
def test_memory_limit_ends_the_sandbox_as_a_whole(host, base_image):
    info = create(host, base_image, memory_mb=96)
    try:
        r = None
        try:
            r = sh(host, info.id, 'x=$(head -c 1048576 /dev/zero | tr "\\0" a); while :; do x="$x$x"; done',
                   timeout=60)
        except SandboxNotFound as e:
            assert "out of memory" in str(e)
        if r is not None:  # the Sentry may also fail the allocation inside, killing only the command
            assert r.exit_code != 0
    finally:
        try:
            host.kill(info.id)
        except SandboxNotFound:
            pass


def test_pids_limit_stops_a_fork_bomb(host, base_image):
    info = create(host, base_image, pids=20)
    try:
        r = sh(host, info.id, "for i in $(seq 40); do sleep 5 & done; wait; echo done", timeout=30)
        assert "can't fork" in r.stderr or "Resource temporarily unavailable" in r.stderr
        assert run(host, info.id, "echo", "alive").stdout == "alive\n"
    finally:
        host.kill(info.id)


def test_limits_are_in_the_oci_bundle(host, base_image):
    import json

    info = create(host, base_image, memory_mb=200, cpu=0.5, pids=33)
    try:
        cfg = json.loads((host.backend("gvisor").base / info.id / "bundle" / "config.json").read_text())
        res = cfg["linux"]["resources"]
        assert res["memory"]["limit"] == 200 << 20 and res["cpu"]["quota"] == 50_000
        assert {"type": "RLIMIT_NPROC", "hard": 33, "soft": 33} in cfg["process"]["rlimits"]
    finally:
        host.kill(info.id)


# ------------------------------------------------------------------ network and isolation
def test_no_network_by_default(host, gv):
    devs = sh(host, gv, "cat /proc/net/dev").stdout
    assert "lo" in devs and "eth" not in devs
    assert host.get_network(gv).allow == []
    with pytest.raises(BackendUnavailable, match="egress"):
        host.set_network(gv, NetworkRequest(allow=["1.1.1.1:443"]))
    assert host.set_network(gv, NetworkRequest()).allow == []
    r = sh(host, gv, "wget -T 2 -q -O- http://1.1.1.1/ 2>&1", timeout=20)
    assert r.exit_code != 0


def test_isolation_from_host_processes_mounts_and_kernel_knobs(host, gv):
    ps = run(host, gv, "ps").stdout
    pids = [int(line.split()[0]) for line in ps.splitlines()[1:]]
    assert pids and max(pids) < 1000 and len(pids) < 10  # its own pid namespace: no host process
    assert "python" not in ps and "runsc" not in ps
    mounts = run(host, gv, "cat", "/proc/mounts").stdout
    assert str(host.settings.root) not in mounts and "erofs" not in mounts
    assert sh(host, gv, "echo b > /proc/sysrq-trigger").exit_code != 0
    assert sh(host, gv, "echo 3 > /proc/sys/vm/drop_caches").exit_code != 0
    assert sh(host, gv, "mount -t tmpfs x /mnt").exit_code != 0  # no CAP_SYS_ADMIN
    assert sh(host, gv, "ls /dev").stdout.split() != sorted(os.listdir("/dev"))


def test_bad_requests_are_typed_errors(host, gv):
    with pytest.raises(SandboxNotFound):
        host.exec("gv-../../etc", ExecRequest(argv=["true"]))
    with pytest.raises(InvalidArgument):
        sh(host, gv, "true", env={"A=B": "x"})


def test_disk_upper_and_its_size_cap(host, base_image):
    info = create(host, base_image, upper="disk", disk_mb=16)
    try:
        assert info.limits.upper == "disk"
        r = sh(host, info.id, "dd if=/dev/zero of=/work/big bs=1M count=64 2>&1; echo rc=$?", timeout=60)
        assert "No space left" in r.stdout or "rc=1" in r.stdout, r.stdout
        assert sh(host, info.id, "rm /work/big; echo ok > /work/f; cat /work/f").stdout == "ok\n"
        snap = host.snapshot(info.id, SnapshotRequest())
        assert snap.size > 0
    finally:
        host.kill(info.id)


def test_init_stdio_cannot_fill_the_host(host, gv):
    # pid 1's stdio come from `runsc create`: they must lead nowhere on the host
    r = sh(host, gv, "head -c 1000000 /dev/zero > /proc/1/fd/2; echo rc=$?; head -c 1000 /dev/zero > /proc/1/fd/1")
    state = host.backend("gvisor").base / gv
    assert all(p.stat().st_size < 100_000 for p in state.rglob("*") if p.is_file() and "upper" not in p.parts
               and "rootfs" not in p.parts), r


def test_an_image_without_a_shell_is_a_clear_error(host, make_layer):
    digest = make_layer({"data/file.txt": "no shell here"})
    with pytest.raises(SandboxError, match="/bin/sh"):
        host.create(CreateRequest(layers=[digest], backend="gvisor"))


def test_pid1_ignores_signals_and_has_no_environment(host, gv):
    r = sh(host, gv, "for s in 1 2 3 10 12 13 14 15 34 64; do kill -$s 1; done; kill -9 -1; echo sent")
    assert r.stdout == "sent\n"
    assert run(host, gv, "echo", "alive").stdout == "alive\n"
    # nothing of the host or of the sandbox's env (runsc itself adds HOME)
    assert sh(host, gv, "tr '\\0' ' ' < /proc/1/environ").stdout.split() in ([], ["HOME=/root"])
    # orphans are reaped: no zombie is left behind
    sh(host, gv, "for i in 1 2 3 4 5; do sleep 0.1 & done")
    time.sleep(1)
    assert " Z " not in run(host, gv, "ps", "-o", "pid,stat,comm").stdout


def test_pid1_killed_from_inside_ends_the_sandbox_with_a_reason(host, base_image):
    info = create(host, base_image)
    try:
        sh(host, info.id, "kill -9 1")
    except SandboxNotFound:
        pass
    assert "pid 1 exited" in str(wait_gone(host, info.id, 10))


def test_a_fork_bomb_is_contained(host, base_image):
    info = create(host, base_image, pids=64, memory_mb=128)
    try:
        r = sh(host, info.id, "bomb() { bomb | bomb & }; bomb; sleep 2; echo done", timeout=4)
        assert "can't fork" in r.stderr or r.timed_out
    except SandboxNotFound as e:  # under ptrace the Sentry may run out of host threads, or of its
        # memory cgroup (the Sentry's own memory is charged there too): either ends only this sandbox
        assert "process limit" in str(e) or "ran out of memory" in str(e)
    other = create(host, base_image)  # the host is fine
    try:
        assert run(host, other.id, "echo", "fine").stdout == "fine\n"
    finally:
        host.kill(other.id)
        try:
            host.kill(info.id)
        except SandboxNotFound:
            pass


def test_memory_bytes_counts_the_tmpfs_upper(host, base_image):
    info = create(host, base_image, disk_mb=128, memory_mb=512)
    try:
        before = host.info(info.id).memory_bytes
        assert sh(host, info.id, "dd if=/dev/zero of=/work/f bs=1M count=64 2>/dev/null && echo ok").stdout == "ok\n"
        assert host.info(info.id).memory_bytes - before > 48 << 20
    finally:
        host.kill(info.id)
