"""Sandbox lifecycle, exec, sessions, files, pause/resume, TTLs and cleanup."""
from __future__ import annotations

import asyncio
import io
import os
import signal
import tarfile
import time
from pathlib import Path

import pytest

from shoal import AsyncSandbox, CommandTimeout, Host, Sandbox, SandboxNotFound, SessionClosed, WarmPool

# every test here that makes its sandboxes with `sandbox` / `make_sandbox` runs on every backend;
# the ones that look at the container backend's own machinery say so
pytestmark = pytest.mark.all_backends
container_only = pytest.mark.backends("container")


def test_exec_argv_shell_env_cwd_stdin(sandbox):
    r = sandbox.commands.run(["echo", "a b"])
    assert (r.exit_code, r.stdout) == (0, "a b\n")
    r = sandbox.commands.run("echo $FOO; pwd; exit 3", env={"FOO": "bar"}, cwd="/tmp")
    assert r.stdout == "bar\n/tmp\n" and r.exit_code == 3
    assert sandbox.commands.run("cat", stdin="piped in").stdout == "piped in"
    r = sandbox.commands.run("echo oops >&2")
    assert r.stderr == "oops\n" and r.stdout == ""
    r = sandbox.commands.run(["no-such-binary"])
    assert r.exit_code == 127 and "no-such-binary" in r.stderr


def test_timeout_kills_the_process_group(sandbox):
    r = sandbox.commands.run("sleep 30 & sleep 30; echo never", timeout=0.5)
    assert r.timed_out and r.exit_code == 137 and "never" not in r.stdout
    assert r.duration_s < 5
    time.sleep(0.2)
    ps = sandbox.commands.run("ps -o pid,args").stdout
    assert "sleep 30" not in ps  # the background child died with the group
    with pytest.raises(CommandTimeout):
        sandbox.commands.run("sleep 5", timeout=0.2, check=True)


def test_output_is_capped_and_flagged(sandbox):
    r = sandbox.commands.run("yes | head -c 5000000", output_cap=10000)
    assert r.stdout_truncated and r.stdout_bytes == 5_000_000
    assert len(r.stdout) < 11000 and "truncated by shoal" in r.stdout
    small = sandbox.commands.run("echo hi", output_cap=10000)
    assert not small.stdout_truncated


def test_streaming_callbacks_and_iterator(sandbox):
    seen = []
    r = sandbox.commands.run("for i in 1 2 3; do echo $i; sleep 0.05; done", on_stdout=seen.append)
    assert "".join(seen) == r.stdout == "1\n2\n3\n" and len(seen) >= 2
    events = list(sandbox.commands.stream("echo out; echo err >&2"))
    assert events[-1].exit_code == 0
    assert {(e.stream, e.text) for e in events[:-1]} == {("stdout", "out\n"), ("stderr", "err\n")}


def test_background_command_handle(sandbox):
    h = sandbox.commands.start("for i in 1 2 3 4 5; do echo line$i; sleep 0.1; done")
    assert h.pid and h.pid > 1 and h.poll() is None
    time.sleep(0.25)
    first = h.output()
    assert first.stdout.startswith("line1")
    r = h.wait(5)
    assert r.exit_code == 0 and h.poll() == 0
    rest = h.output(since=first.cursor)
    assert first.stdout + rest.stdout == "".join(f"line{i}\n" for i in range(1, 6))
    h2 = sandbox.commands.start("sleep 60")
    h2.kill()
    assert h2.wait(5).exit_code == 137


def test_session_keeps_cwd_env_and_survives_errors(sandbox):
    with sandbox.sessions.create() as s:
        s.run("mkdir -p /work/proj && cd /work/proj")
        s.run("export GREETING=hello; COUNT=41")
        r = s.run("pwd; echo $GREETING $((COUNT+1))")
        assert r.stdout == "/work/proj\nhello 42\n" and r.exit_code == 0
        bad = s.run("echo 'unterminated")
        assert bad.exit_code != 0 and "unterminated" in bad.stderr.lower() or bad.exit_code == 2
        assert s.run("false").exit_code == 1
        assert s.run("printf 'no newline'").stdout == "no newline"
        t = s.run("sleep 30", timeout=0.5)
        assert t.timed_out
        assert s.run("echo still here; pwd").stdout == "still here\n/work/proj\n"
        with pytest.raises(SessionClosed):
            s.run("exit 0")


def test_files_api_roundtrip(sandbox, tmp_path):
    f = sandbox.files
    f.write("/work/a/b/c.txt", "hello")
    assert f.read("/work/a/b/c.txt") == "hello"
    assert sandbox.commands.run("cat /work/a/b/c.txt").stdout == "hello"
    st = f.stat("/work/a/b/c.txt")
    assert st.type == "file" and st.size == 5
    assert [e.name for e in f.list("/work/a")] == ["b"]
    src = tmp_path / "up"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "x.py").write_text("print('x')")
    assert f.upload("/dst", src) >= 3
    assert sandbox.commands.run("cat /dst/up/sub/x.py").stdout == "print('x')"
    data = f.download("/dst/up")
    names = tarfile.open(fileobj=io.BytesIO(data)).getnames()
    assert "up/sub/x.py" in names
    f.remove("/work/a/b/c.txt")
    assert not f.exists("/work/a/b/c.txt")
    # a whole tree goes, and a symlink planted in it is removed, not followed
    sandbox.commands.run("mkdir -p /work/t/x/y && echo 1 > /work/t/x/y/z && ln -s /bin /work/t/bin", check=True)
    f.remove("/work/t")
    assert not f.exists("/work/t") and f.exists("/bin/sh")


def test_writes_never_reach_layers_or_other_sandboxes(make_sandbox, base_image, host):
    digest = host.store.get_image(base_image).layers[0]
    image_before = host.store.image_path(digest).read_bytes()
    with make_sandbox() as a, make_sandbox() as b:
        a.commands.run("echo changed > /etc/hosts; rm /bin/ls; echo new > /newfile")
        assert b.files.read("/etc/hosts").startswith("127.0.0.1")
        assert b.files.exists("/bin/ls") and not b.files.exists("/newfile")
    assert host.store.image_path(digest).read_bytes() == image_before
    assert "changed" not in (host.store.mount_path(digest) / "etc/hosts").read_text()


def test_pause_and_resume(sandbox, host, backend_kind):
    # each count lands by rename, so a read never sees a half-written file (a pause can fall mid-write)
    h = sandbox.commands.start("i=0; while true; do i=$((i+1)); echo $i > /tmp/c; mv /tmp/c /tmp/count; "
                               "sleep 0.02; done")
    time.sleep(0.3)
    sandbox.pause()
    assert sandbox.info().state.value == "paused"
    frozen_at = sandbox.files.read("/tmp/count")
    time.sleep(0.4)
    assert sandbox.files.read("/tmp/count") == frozen_at  # nothing ran while frozen
    sandbox.resume()
    time.sleep(0.3)
    assert int(sandbox.files.read("/tmp/count")) > int(frozen_at)
    sandbox.pause()
    assert sandbox.commands.run("echo auto").stdout == "auto\n"  # a request resumes transparently
    assert sandbox.info().state.value == "running"
    if backend_kind == "gvisor":  # a session across a pause: see docs/backends.md ("sessions and pause")
        h.close()
        return
    with sandbox.sessions.create() as s:
        sandbox.pause()
        assert s.run("echo from-session", timeout=5).stdout == "from-session\n"  # sessions resume too
    h.close()


def test_absolute_ttl_ends_sandbox(make_sandbox):
    sb = make_sandbox(ttl=1.0)
    assert sb.commands.run("echo alive").stdout == "alive\n"
    time.sleep(1.6)
    with pytest.raises(SandboxNotFound, match="absolute TTL"):
        sb.commands.run("echo late")


def test_idle_ttl_counts_running_commands_as_activity(make_sandbox):
    sb = make_sandbox(idle_ttl=1.0)
    r = sb.commands.run("sleep 1.5; echo done")  # longer than idle_ttl, but busy
    assert r.stdout == "done\n"
    time.sleep(0.5)
    assert sb.commands.run("echo still").stdout == "still\n"
    time.sleep(1.6)
    with pytest.raises(SandboxNotFound, match="idle TTL"):
        sb.commands.run("echo late")


def test_set_timeout_replaces_ttls(make_sandbox):
    sb = make_sandbox(ttl=1.0)
    sb.set_timeout(ttl=None, idle_ttl=None)
    time.sleep(1.4)
    assert sb.commands.run("echo kept").stdout == "kept\n"
    sb.kill()


def _leftovers(host, sandbox_id: str, init_pid: int) -> list[str]:
    found = []
    for line in open("/proc/self/mountinfo"):
        if sandbox_id in line:
            found.append("mount: " + line.split()[4])
    for cg in host.backend("container").cgroups.dirs(sandbox_id):
        if cg.exists():
            found.append(f"cgroup: {cg}")
    try:
        stat = open(f"/proc/{init_pid}/stat").read()
        if stat[stat.rindex(")") + 2] not in "ZX":  # a zombie waiting for the host's init is gone
            found.append(f"process {init_pid}")
    except FileNotFoundError:
        pass
    if (host.settings.sandboxes_dir / sandbox_id).exists():
        found.append("state dir")
    return found


@container_only
def test_kill_releases_everything(root, base_image, host):
    sb = Sandbox.create(base_image, root=root)
    sb.commands.start("sleep 100")
    info = sb.info()
    assert _leftovers(host, sb.id, info.init_pid)  # sanity: it does hold things while alive
    sb.kill()
    assert _leftovers(host, sb.id, info.init_pid) == []
    with pytest.raises(SandboxNotFound, match="killed"):
        sb.commands.run("true")


@container_only
def test_ttl_expiry_releases_everything(root, base_image, host):
    sb = Sandbox.create(base_image, root=root, ttl=0.5)
    pid = sb.info().init_pid
    deadline = time.time() + 5
    while _leftovers(host, sb.id, pid) and time.time() < deadline:
        time.sleep(0.05)
    assert _leftovers(host, sb.id, pid) == []


@container_only
def test_sweep_reaps_orphans_after_supervisor_crash(root, base_image, host):
    sb = Sandbox.create(base_image, root=root)
    meta = host.backend("container")._load(sb.id)
    os.kill(meta["sup_pid"], signal.SIGKILL)  # the "host crash": nobody will clean up
    time.sleep(0.1)
    assert os.path.exists(f"/proc/{meta['init_pid']}")
    reaped = host.backend("container").sweep()
    assert sb.id in reaped
    assert _leftovers(host, sb.id, meta["init_pid"]) == []


def test_warm_pool_acquire(make_sandbox, backend_kind, root, base_image, request):
    kw = {"url": request.getfixturevalue("matrix_daemon")} if backend_kind == "http" else \
        {"url": "local", "root": root, "backend": backend_kind}
    with WarmPool(base_image, size=2, **kw) as pool:
        pool.wait_ready(30)
        sb = pool.acquire(ttl=60)
        assert sb.commands.run("echo warm").stdout == "warm\n"
        assert sb.info().ttl == 60
        sb.kill()
        pool.wait_ready(30)  # refilled


def test_async_sandbox_mirrors_sync(make_sandbox):
    async def main():
        async with AsyncSandbox(make_sandbox(memory_mb=128)) as sb:
            r = await sb.commands.run("echo async")
            assert r.stdout == "async\n"
            await sb.files.write("/x", "y")
            assert await sb.files.read("/x") == "y"
            s = await sb.sessions.create()
            await s.run("cd /tmp")
            assert (await s.run("pwd")).stdout == "/tmp\n"
            await s.close()
            chunks = [ev async for ev in sb.commands.stream("echo 1; echo 2")]
            assert chunks[-1].exit_code == 0 and "".join(c.text for c in chunks[:-1]) == "1\n2\n"
            h = await sb.commands.start("echo bg")
            assert (await h.wait(5)).stdout == "bg\n"
            await sb.pause()
            await sb.resume()
            results = await asyncio.gather(*(sb.commands.run(f"echo {i}") for i in range(8)))
            assert [r.stdout for r in results] == [f"{i}\n" for i in range(8)]

    asyncio.run(main())


@container_only
def test_limits_are_applied(root, base_image, host):
    with Sandbox.create(base_image, root=root, memory_mb=96, pids=77, cpu=0.5) as sb:
        cg = host.backend("container").cgroups
        d = cg._dir
        if cg.version == 1:
            mem = int((d("memory", sb.id) / "memory.limit_in_bytes").read_text())
            quota = int((d("cpu", sb.id) / "cpu.cfs_quota_us").read_text())
        else:
            mem = int((d("memory", sb.id) / "memory.max").read_text())
            quota = int((d("cpu", sb.id) / "cpu.max").read_text().split()[0])
        assert mem == 96 * 1024 * 1024 and quota == 50_000
        assert (d("pids", sb.id) / "pids.max").read_text().strip() == "77"
        assert cg.parent.startswith("shoal-")  # this root's own cgroup parent


@container_only
def test_cli_run_ps_exec_kill(root, base_image):
    import subprocess
    import sys

    env = dict(os.environ, SHOAL_ROOT=str(root))
    shoal = [sys.executable, "-m", "shoal.cli"]
    r = subprocess.run(shoal + ["run", base_image, "--", "sh", "-c", "echo from-cli; exit 4"], env=env,
                       capture_output=True, text=True)
    assert r.stdout == "from-cli\n" and r.returncode == 4
    sid = subprocess.run(shoal + ["run", "-d", base_image], env=env, capture_output=True, text=True).stdout.strip()
    assert sid.startswith("sb-")
    assert sid in subprocess.run(shoal + ["ps"], env=env, capture_output=True, text=True).stdout
    r = subprocess.run(shoal + ["exec", sid, "--", "hostname"], env=env, capture_output=True, text=True)
    assert r.stdout.strip() == sid
    assert subprocess.run(shoal + ["kill", sid], env=env).returncode == 0
    r = subprocess.run(shoal + ["exec", sid, "--", "true"], env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "killed" in r.stderr


def test_cli_layers_and_images(root, tmp_path):
    import subprocess
    import sys

    env = dict(os.environ, SHOAL_ROOT=str(root))
    shoal = [sys.executable, "-m", "shoal.cli"]
    src = tmp_path / "tree"
    (src / "opt").mkdir(parents=True)
    (src / "opt" / "hello.txt").write_text("hi from cli layer")
    out = subprocess.run(shoal + ["layer", "build", str(src), "--name", "cli-layer"], env=env,
                         capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("sha256:")
    tar = tmp_path / "l.tar.gz"
    with tarfile.open(tar, "w:gz") as tf:
        tf.add(src / "opt", arcname="srv")
    out = subprocess.run(shoal + ["layer", "import", str(tar), "--name", "cli-tar"], env=env, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    made = subprocess.run(shoal + ["image", "create", "cli:1", "busybox", "cli-layer", "cli-tar"], env=env)
    assert made.returncode == 0
    assert "cli:1" in subprocess.run(shoal + ["image", "ls"], env=env, capture_output=True, text=True).stdout
    assert "cli-tar" in subprocess.run(shoal + ["layer", "ls"], env=env, capture_output=True, text=True).stdout
    r = subprocess.run(shoal + ["run", "cli:1", "--", "cat", "/opt/hello.txt", "/srv/hello.txt"], env=env,
                       capture_output=True, text=True)
    assert r.stdout == "hi from cli layerhi from cli layer"
    r = subprocess.run(shoal + ["layer", "rm", "cli-layer"], env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "cli:1" in r.stderr  # still used by the image
    assert subprocess.run(shoal + ["image", "rm", "cli:1"], env=env).returncode == 0
    assert subprocess.run(shoal + ["layer", "rm", "cli-layer"], env=env).returncode == 0
    r = subprocess.run(shoal + ["gc"], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and "removed" in r.stdout


def test_ttl_expiring_mid_command_says_why(make_sandbox):
    sb = make_sandbox(ttl=0.8)
    with pytest.raises(SandboxNotFound, match="absolute TTL"):
        sb.commands.run("sleep 5")


@container_only
def test_a_second_root_on_the_host_never_sweeps_this_roots_sandboxes(root, base_image, tmp_path):
    """Each root has its own cgroup parent: another root's orphan sweep cannot kill our sandboxes."""
    import shutil
    import tempfile

    with Sandbox.create(base_image, root=root) as sb:
        other = Path(tempfile.mkdtemp(prefix="shoal-o-", dir="/tmp"))
        try:
            rt = Host.get(other).backend("container")  # a fresh runtime sweeps its own root's orphans at start
            assert rt.cgroups.parent != Host.get(root).backend("container").cgroups.parent
            rt.sweep()
            assert sb.commands.run("echo alive").stdout == "alive\n"
        finally:
            shutil.rmtree(other, ignore_errors=True)
