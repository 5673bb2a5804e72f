"""A command's `user` (ExecRequest/StartRequest.user) and PTYs (StartRequest.pty), through the contract.

A command run as a non-root user is hostile code that wants root back: a setuid-root binary root left
in the sandbox, setuid(0), writing root's files, signalling root's processes. Each must fail."""
from __future__ import annotations

import os
import subprocess
import time

import pytest

from shoal.core.contract import ExecRequest, PtySize, StartRequest
from shoal.core.errors import FileOpError, InvalidArgument, NotSupported

pytestmark = pytest.mark.all_backends

REGAIN_C = r"""
#include <stdio.h>
#include <sys/prctl.h>
#include <unistd.h>
int main(void) {
    int r = setuid(0);
    FILE *f = fopen("/etc/shadow-pwned", "w");
    printf("euid=%d setuid0=%d nnp=%d wrote=%d\n", (int)geteuid(), r, prctl(PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0),
           f != NULL);
    return 0;
}
"""


@pytest.fixture(scope="session")
def users_layer(host, tmp_path_factory):
    """/etc/passwd with `user` (1000, also in group `staff` 50), its home, and a setuid-root probe."""
    d = tmp_path_factory.mktemp("users")
    (d / "etc").mkdir()
    (d / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/sh\n")
    (d / "etc/group").write_text("root:x:0:\nstaff:x:50:user\nuser:x:1000:\n")
    (d / "home/user").mkdir(parents=True)
    os.chown(d / "home/user", 1000, 1000)
    (d / "usr/local/bin").mkdir(parents=True)
    src = d / "regain.c"
    src.write_text(REGAIN_C)
    subprocess.run(["gcc", "-static", "-O1", "-o", str(d / "usr/local/bin/regain"), str(src)], check=True)
    src.unlink()
    os.chmod(d / "usr/local/bin/regain", 0o4755)  # setuid root: the way back, were it not for no_new_privs
    return host.store.build_from_dir(d, name="security-users").digest


def run(sb, cmd: str, user: str | None = "user") -> tuple[int, str]:
    r = sb.backend.exec(sb.id, ExecRequest(argv=["/bin/sh", "-c", cmd], user=user, timeout=30))
    return r.exit_code, r.stdout + r.stderr


@pytest.mark.backends("container", "http", "gvisor")
def test_user_runs_as_its_ids(make_sandbox, users_layer):
    sb = make_sandbox(layers=[users_layer], memory_mb=128, disk_mb=16)
    code, out = run(sb, "id -u; id -g; id -G; echo $HOME $USER")
    assert code == 0, out
    assert out.split("\n")[:4] == ["1000", "1000", "1000 50", "/home/user user"]
    assert run(sb, "id -u; id -G", user="4321:77")[1] == "4321\n77\n"  # numeric: no passwd entry needed
    assert run(sb, "id -u", user=None)[1] == "0\n"  # default: the sandbox's root
    with pytest.raises(InvalidArgument):
        run(sb, "true", user="nosuchuser")
    with pytest.raises((InvalidArgument, ValueError)):
        run(sb, "true", user="../x")


@pytest.mark.backends("container", "http", "gvisor")
def test_user_cannot_get_root_back(make_sandbox, users_layer, backend_kind):
    sb = make_sandbox(layers=[users_layer], memory_mb=128, disk_mb=16)
    code, out = run(sb, "regain")
    assert "euid=1000 setuid0=-1 nnp=1 wrote=0" in out, out  # the setuid-root binary gave nothing
    assert run(sb, "regain", user=None)[1].startswith("euid=0")  # (as root, it runs as root: the probe works)
    code, out = run(sb, "grep -E '^Cap(Inh|Prm|Eff|Amb)' /proc/self/status")
    caps = {line.split(":")[0]: line.split()[1] for line in out.splitlines()}
    assert {"CapInh", "CapPrm", "CapEff"} <= set(caps) and set(caps.values()) == {"0" * 16}, out  # gVisor: no CapAmb
    for attempt in ("echo x >> /etc/passwd", "kill -9 1", "touch /root-owned", "chown user /etc/group",
                    "cat /proc/1/environ", "ls /proc/1/root/"):
        code, out = run(sb, attempt)
        if backend_kind == "gvisor" and "environ" in attempt:
            # gVisor's procfs (this runsc) lets any uid read another's /proc/PID/environ (docs/e2b.md)
            assert code == 0, out
            continue
        assert code != 0, f"{attempt!r} succeeded as user: {out}"
    assert "user::0:0" not in sb.backend.read_file(sb.id, "/etc/passwd").decode()


@pytest.mark.backends("container", "http")
def test_pty_size_input_resize(make_sandbox, users_layer):
    sb = make_sandbox(layers=[users_layer], memory_mb=128, disk_mb=16)
    h = sb.backend.start(sb.id, StartRequest(argv=["/bin/sh", "-c", "stty size; tty; id -u; read x; stty size"],
                                             pty=PtySize(rows=10, cols=20), user="user"))
    try:
        cursor, seen = (0, 0), ""
        deadline = time.monotonic() + 20
        while "1000" not in seen and time.monotonic() < deadline:
            out = h.wait_output(cursor, 1)
            cursor, seen = out.cursor, seen + out.stdout
        assert "10 20" in seen and "/dev/pts/" in seen, seen
        h.resize(40, 50)
        h.write_stdin(b"go\n")
        r = h.wait(20)
        assert r.exit_code == 0
        assert "40 50" in r.stdout, r.stdout
        with pytest.raises(InvalidArgument):
            h.resize(0, 10)
    finally:
        h.close()


@pytest.mark.backends("gvisor")
def test_gvisor_says_not_supported(make_sandbox):
    sb = make_sandbox(memory_mb=128, disk_mb=16)
    with pytest.raises(NotSupported):  # a PTY: docs/e2b.md says why not
        sb.backend.start(sb.id, StartRequest(argv=["sh"], pty=PtySize()))


@pytest.mark.backends("container", "http")
def _kernel() -> tuple[int, int]:
    major, minor = os.uname().release.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def test_xattrs_only_in_the_user_namespace(make_sandbox):
    """set_xattrs (E2B's upload metadata) writes user.* only: trusted.overlay.* would steer overlayfs,
    security.* the kernel's checks."""
    sb = make_sandbox(memory_mb=64, disk_mb=16)
    sb.backend.write_file(sb.id, "/tmp/f", b"x")
    if _kernel() >= (6, 6):
        sb.backend.set_xattrs(sb.id, "/tmp/f", {"user.e2b.team": "rl"})
        assert sb.backend.stat_file(sb.id, "/tmp/f").xattrs == {"user.e2b.team": "rl"}
    else:  # tmpfs (the default upper) stores user.* xattrs from 6.6 on: a typed error naming why
        with pytest.raises(FileOpError, match="does not store user"):
            sb.backend.set_xattrs(sb.id, "/tmp/f", {"user.e2b.team": "rl"})
    for bad in ({"trusted.overlay.opaque": "y"}, {"security.capability": "x"}, {"user.": "x"},
                {"user.big": "v" * 5000}, {f"user.k{i}": "v" for i in range(65)}):
        with pytest.raises(InvalidArgument):
            sb.backend.set_xattrs(sb.id, "/tmp/f", bad)
    sb.backend.mkdir(sb.id, "/tmp/d")
    assert sb.backend.stat_file(sb.id, "/tmp/d").xattrs is None
