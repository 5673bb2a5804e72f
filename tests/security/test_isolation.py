"""Attempts to break out of or harm the host from inside a sandbox. Each must fail."""
from __future__ import annotations

import os
import socket
import time

import pytest

from shoal import SandboxNotFound
from shoal.core.errors import FileOpError, PathOutsideSandbox

from .conftest import probe_results

# Every escape attempt here runs on every backend (container, gvisor, and containers through shoald).
# Where a backend stops an attempt by other means (gVisor serves syscalls from its own user-space
# kernel, the Sentry, not the host's), the test checks that backend's evidence; docs/backends.md
# lists each difference with its reason.
pytestmark = pytest.mark.all_backends(fleet=True)  # fleet: created and driven through a fleet's gateways
container_only = pytest.mark.backends("container", "http", "fleet")

# Calls gVisor implements inside the Sentry: they succeed there, but what they create (a user or
# mount namespace, a raw socket with no network attached, an io_uring) belongs to the Sentry's own
# kernel, not the host's.
SENTRY_LOCAL = {"unshare_user", "unshare_mnt", "raw_socket"}


def _probe(sb) -> dict[str, str]:
    return probe_results(sb)


DENIED = ["mount", "umount", "unshare_user", "unshare_mnt", "clone_newuser", "ptrace_init", "kexec_load",
          "init_module", "finit_module", "delete_module", "bpf", "keyctl", "add_key", "perf_event_open",
          "ioctl_xfs_swapext", "ioctl_ficlone", "ioctl_tiocsti", "open_by_handle_at", "raw_socket", "setns",
          "reboot", "swapon", "mknod_dev", "sethostname"]


def test_dangerous_syscalls_are_denied(probed, backend_kind):
    results = _probe(probed)
    for name in DENIED:
        if backend_kind == "gvisor":
            if name not in SENTRY_LOCAL:
                assert results[name] != "OK", f"{name} succeeded inside the sandbox"
            continue
        assert results[name] != "OK", f"{name} succeeded inside the sandbox"
        assert results[name] in ("EPERM", "EACCES", "ENOSYS"), f"{name}: {results[name]}"
    assert results["socket_inet_ok"] == "OK"  # the probe itself works
    assert os.uname().nodename != "renamed"


def test_capabilities_are_reduced_and_no_new_privs(probed, backend_kind):
    status = probed.commands.run("cat /proc/self/status").stdout
    fields = dict(l.split(":\t", 1) for l in status.splitlines() if ":\t" in l)
    cap_eff = int(fields["CapEff"], 16)
    assert cap_eff & (1 << 21) == 0  # CAP_SYS_ADMIN
    assert cap_eff & (1 << 13) == 0  # CAP_NET_RAW
    assert cap_eff & (1 << 16) == 0  # CAP_SYS_MODULE
    assert int(fields["CapBnd"], 16) == cap_eff
    if backend_kind == "gvisor":
        return  # no_new_privs and seccomp apply to the Sentry on the host, not inside its kernel
    assert fields["NoNewPrivs"].strip() == "1"
    assert fields["Seccomp"].strip() == "2"


def test_cannot_see_host_processes_or_files(probed, tmp_path):
    secret = tmp_path / "host-secret-7c1f"
    secret.write_text("top secret")
    ps = probed.commands.run("ps -o pid,args").stdout
    pids = [int(l.split()[0]) for l in ps.splitlines()[1:]]
    assert pids and max(pids) < 100 and os.getpid() not in pids  # a PID namespace: small pids, none of ours
    assert "pytest" not in ps
    found = probed.commands.run("find / -xdev -name 'host-secret-*' 2>/dev/null; ls /tmp").stdout
    assert "host-secret" not in found
    assert "agent.sock" not in probed.commands.run("find / -name 'agent.sock*' 2>/dev/null").stdout
    environ = probed.commands.run("cat /proc/1/environ").stdout
    assert not [k for k in os.environ if k != "HOME" and f"{k}=" in environ], environ  # nothing of the host


def test_no_network_but_loopback(probed):
    # a server on the host's loopback is not the sandbox's loopback
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    try:
        r = probed.commands.run(f"nc -w 1 127.0.0.1 {port} </dev/null; echo rc=$?", timeout=10)
        assert "rc=0" not in r.stdout
        links = probed.commands.run("ls /sys/class/net").stdout.split()
        assert links == ["lo"]
        # the sandbox's own loopback works
        r = probed.commands.run("(nc -l -p 8080 > /tmp/got &) ; sleep 0.2; echo hi | nc -w 1 127.0.0.1 8080; "
                                "sleep 0.2; cat /tmp/got", timeout=10)
        assert "hi" in r.stdout
    finally:
        srv.close()


def test_fork_bomb_is_stopped_by_pids_limit(probed, host_for, make_sandbox, backend_kind):
    try:
        r = probed.commands.run("bomb() { bomb | bomb & }; bomb; sleep 2", timeout=4)
    except SandboxNotFound:
        assert backend_kind == "gvisor"  # under ptrace the bomb can end the whole sandbox (docs/backends.md)
    else:
        assert "can't fork" in r.stderr or "Resource temporarily unavailable" in r.stderr
        if backend_kind != "gvisor":
            pids_now = host_for(probed).backend("container").cgroups.pids_current(probed.id)
            assert pids_now is not None and pids_now <= 64
        time.sleep(0.5)
        probed.commands.run("kill -9 -1", timeout=5)
    other = make_sandbox()  # the host still creates sandboxes
    assert other.commands.run("echo fine").stdout == "fine\n"


def test_memory_bomb_is_killed_inside_the_sandbox_only(probed, make_sandbox, backend_kind):
    bystander = make_sandbox()
    try:
        r = probed.commands.run("awk 'BEGIN { s = \"xxxxxxxxxxxxxxxx\"; while (1) s = s s }'", timeout=30)
    except SandboxNotFound:
        assert backend_kind == "gvisor"  # the OOM killer ends the whole gVisor sandbox (docs/backends.md)
    else:
        assert r.exit_code == 137 and r.signal == 9 and not r.timed_out
        assert probed.commands.run("echo survived").stdout == "survived\n"
    assert bystander.commands.run("echo unharmed").stdout == "unharmed\n"


def test_disk_fill_is_bounded(probed, host_for):
    r = probed.commands.run("dd if=/dev/zero of=/fill bs=1M count=100 2>&1; ls -l /fill", timeout=30)
    assert "No space left" in r.stdout
    size = probed.files.stat("/fill").size
    assert 8 * 1024 * 1024 <= size <= 16 * 1024 * 1024
    # the upper is a tmpfs on the host: it is the 16 MiB cap that stopped dd (the host disk is not
    # involved at all), and the cap is on the host side of the mount, out of the sandbox's reach
    st = os.statvfs(host_for(probed).backend(probed.info().backend).upper_dir(probed.id))
    assert st.f_blocks * st.f_frsize <= 16 * 1024 * 1024
    assert st.f_bavail * st.f_frsize < 1024 * 1024
    # space comes back when the file goes
    r = probed.commands.run("rm /fill && dd if=/dev/zero of=/again bs=1M count=8 2>&1; echo rc=$?", timeout=30)
    assert "rc=0" in r.stdout


def _sys_file_writable_on_the_host() -> str:
    """A /sys file that exists here and root may write: writing its own current value back changes
    nothing, so a broken protection cannot harm the host."""
    for p in ("/sys/kernel/mm/transparent_hugepage/defrag", "/sys/kernel/mm/transparent_hugepage/enabled",
              "/sys/kernel/rcu_expedited", "/sys/block/loop0/queue/read_ahead_kb"):
        if os.path.exists(p) and os.access(p, os.W_OK):
            return p
    pytest.fail("no writable /sys file on this host to try")


# The host's /dev/null as it was before any test made a sandbox (test modules are imported at
# collection, before any test runs): creating a sandbox must not change it either.
_DEV_NULL = os.stat("/dev/null")


def test_masked_proc_entries_do_not_reach_the_hosts_dev_null(probed):
    """Neither the sandbox's start nor its root may change the host's /dev/null: a masked /proc file
    that is the host's inode would let root chmod/chown it through /proc/keys, and runsc chowns the
    stdio it is handed to the sandbox user. Either breaks every host program that opens /dev/null."""
    before = _DEV_NULL
    try:
        r = probed.commands.run("for f in /proc/keys /proc/timer_list /proc/kcore /proc/sched_debug; do "
                                "chmod 000 $f; chown 65534:65534 $f; done 2>&1; echo done")
        after = os.stat("/dev/null")
        assert (after.st_mode, after.st_uid, after.st_gid) == (before.st_mode, before.st_uid, before.st_gid), r.stdout
    finally:  # a broken protection must not leave the host broken
        os.chmod("/dev/null", before.st_mode & 0o7777)
        os.chown("/dev/null", before.st_uid, before.st_gid)


def test_proc_and_sys_are_hardened(probed, backend_kind):
    r = probed.commands.run("wc -c /proc/kpagecgroup /proc/kpageflags /proc/timer_list /proc/kcore 2>&1")
    lines = [l for l in r.stdout.splitlines() if "total" not in l]
    assert len(lines) == 4 and all(l.strip().startswith("0 ") or "No such" in l for l in lines), r.stdout
    # on the host these have content: the mask (or gVisor's own /proc, which has no such files),
    # not the kernel, empties them in the sandbox
    for f in ("/proc/timer_list", "/proc/keys"):
        with open(f, "rb") as fh:
            assert fh.read(64), f
        out = probed.commands.run(["sh", "-c", f"wc -c {f} 2>&1"]).stdout
        assert out.split()[0] == "0" or "No such file" in out, (f, out)
    refused = "Operation not permitted" if backend_kind == "gvisor" else "Read-only file system"
    r = probed.commands.run("echo 3 > /proc/sys/vm/drop_caches; echo rc=$?")
    assert "rc=0" not in r.stdout and refused in r.stderr
    sys_file = _sys_file_writable_on_the_host()
    with open(sys_file) as fh:
        cur = fh.read().strip()
    cur = cur[cur.index("[") + 1:cur.index("]")] if "[" in cur else cur  # "always [madvise] never" -> madvise
    r = probed.commands.run(["sh", "-c", 'test -e "$1" && echo exists; echo "$2" > "$1"; echo rc=$?', "sh",
                             sys_file, cur])
    assert "rc=0" not in r.stdout, (sys_file, r)
    if backend_kind != "gvisor":  # gVisor's own /sys has no such file at all ("nonexistent directory")
        assert "exists" in r.stdout and "Read-only file system" in r.stderr, (sys_file, r)
    if os.path.exists("/proc/sysrq-trigger"):  # not in every kernel; sysrq 'h' only prints help
        r = probed.commands.run("echo h > /proc/sysrq-trigger; echo rc=$?")
        assert "rc=0" not in r.stdout
    devs = ["fd", "full", "null", "ptmx", "pts", "random", "shm", "stderr", "stdin", "stdout", "tty", "urandom", "zero"]
    if backend_kind == "gvisor":
        devs += ["fuse", "net"]  # gVisor's own devices, served by the Sentry: no host device is reachable
    assert probed.commands.run("ls /dev").stdout.split() == sorted(devs)


@container_only  # on gVisor, `kill -9 1` ends the sandbox itself (docs/backends.md)
def test_init_cannot_be_killed_or_traced_from_inside(probed):
    """The kernel drops signals to a PID namespace's init from inside unless init handles them, so
    `kill -9 1` alone proves nothing; this sends every signal (a handler added to shoal-init would
    show here), kills everything else with kill -1, and checks init's memory, fds and environment
    stay closed (init is non-dumpable)."""
    r = probed.commands.run("for s in $(seq 1 31) $(seq 34 64); do kill -$s 1 2>/dev/null; done; kill -9 -1; "
                            "echo sent")
    assert probed.commands.run("echo alive").stdout == "alive\n"
    assert probed.info().state == "running"
    res = probe_results(probed, "ptrace_init")
    assert res["ptrace_init"] == "EPERM"
    r = probed.commands.run("cat /proc/1/mem 2>&1; cat /proc/1/environ 2>&1; ls -l /proc/1/fd/3 2>&1; "
                            "ls /proc/1/root/ 2>&1")
    assert r.stdout.count("Permission denied") == 4, r.stdout


def test_cannot_kill_other_sandboxes(make_sandbox, probed):
    with make_sandbox() as other:
        other_pid = other.info().init_pid or 1
        r = probed.commands.run(f"kill -9 {other_pid}; echo rc=$?")
        assert "rc=0" not in r.stdout
        assert other.commands.run("echo ok").stdout == "ok\n"


def test_overwriting_bin_sh_affects_only_that_sandbox(make_sandbox):
    with make_sandbox() as a, make_sandbox() as b:
        a.files.remove("/bin/sh")
        a.files.write("/bin/sh", "#!/bin/busybox echo\nhacked", mode=0o755)
        assert "hacked" in a.commands.run(["cat", "/bin/sh"]).stdout
        assert b.commands.run("echo intact").stdout == "intact\n"
    with make_sandbox() as c:
        assert c.commands.run("echo intact").stdout == "intact\n"


def test_files_api_cannot_escape_the_root(sandbox, tmp_path):
    host_file = tmp_path / "host-only.txt"
    host_file.write_text("host data")
    f = sandbox.files
    for p in (f"/../../../..{host_file}", f"../../{host_file}", str(host_file)):
        with pytest.raises(FileOpError):
            f.read(p)
    # symlinks planted by the sandbox resolve inside the sandbox root
    sandbox.commands.run(f"ln -s {host_file} /tmp/abs-link; ln -s ../../../../../..{tmp_path} /tmp/rel-link")
    with pytest.raises(FileOpError):
        f.read("/tmp/abs-link")
    with pytest.raises(FileOpError):
        f.read("/tmp/rel-link/host-only.txt")
    # writing through a symlink must not create or change a host file
    target = tmp_path / "planted.txt"
    sandbox.commands.run(f"ln -s {target} /tmp/w-link; ln -s {tmp_path} /tmp/dir-link")
    with pytest.raises(FileOpError):
        f.write("/tmp/w-link", "x")
    try:
        f.write("/tmp/dir-link/planted.txt", "x")
    except FileOpError:
        pass
    assert not target.exists()
    assert host_file.read_text() == "host data"
    with pytest.raises(PathOutsideSandbox):
        f.upload("/dst", _evil_tar())


def _evil_tar() -> bytes:
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        ti = tarfile.TarInfo("../../escape.txt")
        ti.size = 1
        tf.addfile(ti, io.BytesIO(b"x"))
    return buf.getvalue()


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))


def test_output_flood_keeps_host_memory_flat(probed):
    """The current RSS, sampled through the flood (ru_maxrss is a high-water mark: earlier tests may
    have raised it past anything this flood does, and then it proves nothing)."""
    import threading

    before, peak, stop = _rss_kib(), [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_kib())
            time.sleep(0.005)

    t = threading.Thread(target=sample)
    t.start()
    try:
        r = probed.commands.run("yes", timeout=3, output_cap=64 * 1024)
    finally:
        stop.set()
        t.join()
    assert r.timed_out and r.stdout_truncated and r.stdout_bytes > 10_000_000
    assert len(r.stdout) < 70 * 1024
    assert peak[0] - before < 50 * 1024, (before, peak)  # KiB: the flood did not accumulate in the host


def test_files_api_is_not_trapped_by_fifos_devices_or_sparse_files(sandbox, backend_kind):
    sandbox.commands.run("mkfifo /tmp/trap; truncate -s 50G /tmp/sparse; mkdir -p /tmp/d; "
                         "truncate -s 20G /tmp/d/big")
    t0 = time.monotonic()
    # (a gVisor FIFO lives in the Sentry and is not on the host overlay at all: "No such file", and a
    # write there makes a plain file on the overlay; nothing can block)
    with pytest.raises(FileOpError, match="regular|No such file"):
        sandbox.files.read("/tmp/trap")  # would block forever on a blocking open
    if backend_kind != "gvisor":
        with pytest.raises(FileOpError, match="regular|No such device"):  # ENXIO: no reader, refused at once
            sandbox.files.write("/tmp/trap", "x")
    with pytest.raises(FileOpError, match="regular|No such file"):  # gVisor's /dev is the Sentry's, not on disk
        sandbox.files.read("/dev/zero")
    with pytest.raises(FileOpError, match="max_bytes"):
        sandbox.files.read("/tmp/sparse")
    with pytest.raises(FileOpError, match="max_bytes"):
        sandbox.files.download("/tmp/d")
    assert time.monotonic() - t0 < 5


def test_files_api_list_stat_and_download_do_not_follow_planted_symlinks_out(sandbox, tmp_path):
    """read and write are covered above; these are the calls that walk directories or tar them."""
    import io
    import tarfile

    (tmp_path / "host-only.txt").write_text("host data 5e1a")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "deeper.txt").write_text("host data 5e1a")
    f = sandbox.files
    sandbox.commands.run(f"mkdir -p /tmp/t; ln -s {tmp_path} /tmp/t/abs; "
                         f"ln -s ../../../../../../..{tmp_path} /tmp/t/rel; "
                         f"ln -s {tmp_path}/host-only.txt /tmp/t/file; ln -s /etc /tmp/t/etc; "
                         "ln -s /proc/1/root /tmp/t/magic")
    for p in ("/tmp/t/abs", "/tmp/t/rel", "/tmp/t/abs/sub", "/tmp/t/magic"):
        with pytest.raises(FileOpError):
            f.list(p)
    for p in ("/tmp/t/abs/host-only.txt", "/tmp/t/rel/host-only.txt", "/tmp/t/abs/sub/deeper.txt",
              "/tmp/t/magic/etc"):
        with pytest.raises(FileOpError):
            f.stat(p)
        with pytest.raises(FileOpError):
            f.download(p)
    # the links themselves are reported as links, never as what they point at on the host
    for name in ("abs", "rel", "file", "etc", "magic"):
        assert f.stat(f"/tmp/t/{name}").type == "symlink"
    # a link to /etc lists the sandbox's /etc
    assert [e.name for e in f.list("/tmp/t/etc")] == [e.name for e in f.list("/etc")]
    # downloading the directory keeps the links as links: no host byte is in the archive
    for p in ("/tmp/t", "/tmp/t/abs", "/tmp/t/file"):
        data = f.download(p)
        assert b"host data 5e1a" not in data and b"deeper" not in data
        with tarfile.open(fileobj=io.BytesIO(data)) as tf:
            members = {m.name: m for m in tf}
        assert all(m.issym() or m.isdir() for m in members.values()), members
    assert {e.name for e in f.list("/tmp/t")} == {"abs", "rel", "file", "etc", "magic"}
    # uploading into a planted directory link writes inside the sandbox, never into the host dir
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name in ("abs/evil.txt", "rel/evil.txt"):
            ti = tarfile.TarInfo(name)
            ti.size = 4
            tf.addfile(ti, io.BytesIO(b"evil"))
    with pytest.raises(FileOpError, match="No such file"):  # the link's target does not exist in the sandbox
        f.upload("/tmp/t", buf.getvalue())
    assert not (tmp_path / "evil.txt").exists()
