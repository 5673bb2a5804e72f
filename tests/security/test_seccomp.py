"""The seccomp allowlist, tried call by call from a C probe inside a sandbox.

Every syscall number the filter does not allow is made, and must answer EPERM (denied on purpose)
or ENOSYS (not on the list); ptrace and its relatives are tried against a process of the
sandbox's own, a host process and a process of another sandbox."""
from __future__ import annotations

import os
import re
import subprocess
import time

import pytest

from shoal import Sandbox
from shoal.backends.container.native import helper_path

from .conftest import probe_results


def _dump() -> str:
    return subprocess.run([str(helper_path()), "seccomp-table"], capture_output=True, text=True, check=True).stdout


def _table() -> tuple[set[int], set[int], set[int]]:
    """(allowed, denied, special) syscall numbers, from the shoal-init this test session runs."""
    allowed, denied, special = set(), set(), set()
    for line in _dump().splitlines():
        nr, what = line.split()[:2]
        if nr in ("insns", "arch", "bpf"):
            continue
        {"allow": allowed, "deny": denied, "special": special}[what].add(int(nr))
    return allowed, denied, special


# classic BPF, the subset a seccomp filter of shoal-init uses
LD_W_ABS, JA, JEQ_K, JGE_K, JSET_K, AND_K, RET_K = 0x20, 0x05, 0x15, 0x35, 0x45, 0x54, 0x06
RET_ALLOW, RET_KILL_PROCESS, RET_ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
EPERM, ENOSYS = 1, 38


def _run_bpf(prog: list[tuple[int, int, int, int]], nr: int, arch: int, args: tuple[int, ...] = ()) -> int:
    """The filter's verdict for one call, as the kernel computes it (struct seccomp_data: nr at 0,
    arch at 4, instruction pointer at 8, args at 16 + 8 i, little endian)."""
    words = {0: nr, 4: arch}
    for i, a in enumerate((*args, 0, 0, 0, 0, 0, 0)[:6]):
        words[16 + 8 * i], words[20 + 8 * i] = a & 0xFFFFFFFF, a >> 32
    acc, pc, steps = 0, 0, 0
    while True:
        steps += 1
        assert steps <= len(prog), "the program loops"  # forward jumps only: it cannot
        code, jt, jf, k = prog[pc]
        pc += 1
        if code == LD_W_ABS:
            acc = words[k]
        elif code == AND_K:
            acc &= k
        elif code == JA:
            pc += k
        elif code in (JEQ_K, JGE_K, JSET_K):
            hit = acc == k if code == JEQ_K else acc >= k if code == JGE_K else bool(acc & k)
            pc += jt if hit else jf
        elif code == RET_K:
            return k
        else:
            raise AssertionError(f"instruction {code:#x} not expected in the filter")


def test_the_bpf_program_gives_every_number_the_table_s_verdict():
    """The sweep below proves refused calls are refused; this proves the binary search also lets
    every allowed call through (a wrong jump would turn an allowed call into ENOSYS, which only
    the workload that needs it would notice), for every number, on this build's program."""
    allowed, denied, special = _table()
    lines = _dump().splitlines()
    arch = int(next(l for l in lines if l.startswith("arch ")).split()[1])
    prog = [tuple(int(x) for x in l.split()[1:]) for l in lines if l.startswith("bpf ")]
    assert len(prog) <= 4096 and int(next(l for l in lines if l.startswith("insns ")).split()[1]) == len(prog)
    assert all(0 <= jt <= 255 and 0 <= jf <= 255 for _, jt, jf, _ in prog)
    for nr in range(1024):
        verdict = _run_bpf(prog, nr, arch)
        if nr in special:
            continue
        want = RET_ALLOW if nr in allowed else RET_ERRNO | (EPERM if nr in denied else ENOSYS)
        assert verdict == want, (nr, hex(verdict), hex(want))
    assert _run_bpf(prog, 39, arch ^ 0x80000000) == RET_KILL_PROCESS  # a foreign ABI (AUDIT_ARCH_I386 etc.)
    if os.uname().machine == "x86_64":
        assert _run_bpf(prog, 0x40000000 | 39, arch) == RET_ERRNO | EPERM  # x32
        clone, unshare, ioctl, personality, clone3 = 56, 272, 16, 135, 435
        assert _run_bpf(prog, clone3, arch) == RET_ERRNO | ENOSYS
        assert _run_bpf(prog, clone, arch, (0x10000000 | 17,)) == RET_ERRNO | EPERM  # CLONE_NEWUSER
        assert _run_bpf(prog, clone, arch, (0x3D0F00,)) == RET_ALLOW  # a pthread_create's flags
        assert _run_bpf(prog, unshare, arch, (0x10000000,)) == RET_ERRNO | EPERM
        assert _run_bpf(prog, unshare, arch, (0x20000,)) == RET_ALLOW  # CLONE_NEWNS: left to capabilities
        assert _run_bpf(prog, ioctl, arch, (0, 0x5412)) == RET_ERRNO | EPERM  # TIOCSTI
        assert _run_bpf(prog, ioctl, arch, (0, 0x40049409)) == RET_ERRNO | EPERM  # FICLONE
        assert _run_bpf(prog, ioctl, arch, (0, 0x5401)) == RET_ALLOW  # TCGETS
        assert _run_bpf(prog, personality, arch, (0xFFFFFFFF,)) == RET_ALLOW
        assert _run_bpf(prog, personality, arch, (0x0040000,)) == RET_ERRNO | EPERM
        prctl, madvise = 157, 28
        assert _run_bpf(prog, prctl, arch, (67, 1)) == RET_ERRNO | EPERM  # PR_SET_MEMORY_MERGE
        assert _run_bpf(prog, prctl, arch, (15, 0)) == RET_ALLOW  # PR_SET_NAME
        assert _run_bpf(prog, madvise, arch, (0, 4096, 12)) == RET_ERRNO | EPERM  # MADV_MERGEABLE
        assert _run_bpf(prog, madvise, arch, (0, 4096, 4)) == RET_ALLOW  # MADV_DONTNEED


def _lines(out: str, prefix: str = "") -> dict[str, str]:
    return dict(l.split("=", 1) for l in out.splitlines() if "=" in l and l.startswith(prefix))


def test_every_call_off_the_allowlist_is_refused(probed):
    allowed, denied, special = _table()
    assert len(allowed) > 200 and len(denied) > 40
    assert not allowed & denied
    top = max(allowed | denied | special) + 64  # past the table: calls a later kernel adds
    skip = sorted(allowed | special)  # clone, unshare, ioctl, personality, prctl, madvise: by name
    r = probed.commands.run(["probe", "sweep", ",".join(map(str, skip)), str(top)], timeout=120)
    assert r.exit_code == 0, r.stderr
    got = {int(k.split(":")[1]): v for k, v in _lines(r.stdout, "sweep:").items()}
    assert len(got) == top + 1 - len([n for n in skip if n <= top])  # every number was tried
    if os.uname().machine == "x86_64":
        # uretprobe (335) and uprobe (336) pass every seccomp filter by the kernel's design: they only
        # act when called from a uprobe trampoline, anywhere else they kill (SIGILL) or fail (ENXIO).
        for nr, ok in ((335, "SIGILL"), (336, "ENXIO")):
            if got.get(nr) in (ok, "ENOSYS"):
                del got[nr]
    wrong = {nr: v for nr, v in got.items() if v != ("EPERM" if nr in denied else "ENOSYS")}
    assert not wrong, f"calls off the allowlist that did not answer as the filter says: {wrong}"
    if os.uname().machine == "x86_64":
        # the i386 ABI through int 0x80 is a foreign architecture: the process is killed
        assert _lines(r.stdout)["int80_getpid"] == "SIGSYS"


def test_named_dangerous_calls_answer_eperm(probed):
    res = probe_results(probed)
    for name in ("io_uring_setup", "io_uring_enter", "io_uring_register", "ptrace_init", "ptrace_traceme",
                 "ptrace_own_child", "ptrace_seize_own_child", "process_vm_readv_own_child",
                 "process_vm_writev_own_child", "kcmp_own_child", "pidfd_getfd_own_child", "userfaultfd", "bpf",
                 "mount", "umount", "unshare_user", "clone_newuser", "keyctl", "add_key", "perf_event_open",
                 "open_by_handle_at", "setns", "kexec_load", "init_module", "finit_module", "delete_module",
                 "reboot", "swapon", "ioctl_xfs_swapext", "ioctl_ficlone", "ioctl_tiocsti"):
        assert res[name] == "EPERM", f"{name}: {res[name]}"
    assert res["personality_no_aslr"] == "EPERM" and res["personality_linux32"] == "EPERM"
    assert res["personality_query"] == "OK"  # reading the persona stays allowed
    # KSM is the host's choice (create option ksm): a sandbox cannot make its pages mergeable itself
    assert res["prctl_memory_merge"] == "EPERM" and res["madvise_mergeable"] == "EPERM"
    assert res["madvise_dontneed"] == "OK"
    assert res["clone3"] == "ENOSYS"  # libc falls back to clone, whose flags the filter reads
    assert res["unknown_syscall"] == "ENOSYS"
    if os.uname().machine == "x86_64":
        assert res["x32_getpid"] == "EPERM"
    assert res["pthread_ok"] == "OK" and res["socket_inet_ok"] == "OK"  # the controls


def _children(ppid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == ppid:
                        out.append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return out


def test_ptrace_and_memory_reads_of_host_and_sibling_processes_fail(root, base_image, probed):
    """Why this can fail: a PID namespace only hides pids, so the test learns a host process's pid
    on the host and hands it to the probe. The probe then tries ptrace, process_vm_readv/writev,
    kcmp, /proc/PID/mem and pidfd_getfd against it. The filter must refuse the calls themselves
    (EPERM, before the kernel looks the pid up); with the filter off they would reach the pid
    lookup and answer ESRCH instead, which this test rejects. kill(pid, 0) and pidfd_open, which
    the filter allows, check the second layer: the pid must not exist in the sandbox (ESRCH).
    The own-child cases in test_named_dangerous_calls_answer_eperm are the ones that would simply
    succeed without the filter."""
    host_proc = subprocess.Popen(["sleep", "60"])
    try:
        with Sandbox.create(base_image, root=root) as sibling:
            bg = sibling.commands.start("sleep 60")
            sib_pid = None
            deadline = time.time() + 5
            while sib_pid is None and time.time() < deadline:
                for p in _children(sibling.info().init_pid):
                    with open(f"/proc/{p}/comm") as f:
                        if f.read().strip() == "sleep":
                            sib_pid = p
                time.sleep(0.05)
            assert sib_pid, "the sibling's sleep was not found on the host"
            for pid in (host_proc.pid, sib_pid):
                assert pid > 1000 or not probed.commands.run(f"test -d /proc/{pid}").ok
                res = probe_results(probed, "target", str(pid))
                assert res["target_kill0"] == "ESRCH", res
                assert res["target_pidfd_open"] == "ESRCH", res
                assert res["target_proc_mem"] == "ENOENT", res
                for call in ("ptrace_attach", "ptrace_seize", "process_vm_readv", "process_vm_writev", "kcmp",
                             "pidfd_getfd"):
                    assert res[f"target_{call}"] == "EPERM", (call, res)
            # both targets are alive and untraced
            for pid in (host_proc.pid, sib_pid):
                with open(f"/proc/{pid}/status") as f:
                    assert re.search(r"^TracerPid:\s+0$", f.read(), re.MULTILINE)
            bg.kill()
    finally:
        host_proc.kill()
        host_proc.wait()


WORKLOAD = r"""
set -e
cat > /tmp/mp.py <<'PY'
import asyncio, multiprocessing as mp, os, socket, sqlite3, subprocess, tempfile, threading

def square(x):
    return x * x

if __name__ == "__main__":
    for method in ("fork", "spawn", "forkserver"):
        with mp.get_context(method).Pool(2) as pool:
            assert pool.map(square, range(5)) == [0, 1, 4, 9, 16], method
    t = threading.Thread(target=lambda: None); t.start(); t.join()
    async def main():
        p = await asyncio.create_subprocess_exec("true"); await p.wait()
        r, w = socket.socketpair(); w.send(b"x"); assert r.recv(1) == b"x"
    asyncio.run(main())
    db = sqlite3.connect(os.path.join(tempfile.mkdtemp(), "x.db")); db.execute("create table t(x)"); db.commit()
    subprocess.run(["true"], check=True)
    print("python ok")
PY
python3 /tmp/mp.py
cd /tmp && rm -rf w && mkdir w && cd w
git init -q repo && cd repo && echo a > a && git add a && git -c user.email=a@b -c user.name=n commit -qm a
git checkout -qb b && echo b >> a && git -c user.email=a@b -c user.name=n commit -qam b && git gc -q && cd ..
git clone -q repo clone && git -C clone log --oneline | wc -l
mkdir -p pkg/demo && printf 'def f():\n    return 1\n' > pkg/demo/__init__.py
printf '[project]\nname = "demo"\nversion = "0.1"\n' > pkg/pyproject.toml
printf '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n' >> pkg/pyproject.toml
python3 -m venv --system-site-packages v && v/bin/pip install -q --no-index --no-build-isolation ./pkg
v/bin/python -c "import demo; assert demo.f() == 1"
printf 'def test_one():\n    assert 1\n' > test_x.py && python3 -m pytest -q -p no:cacheprovider test_x.py | tail -1
dpkg -l | grep -c '^ii' >/dev/null && apt-cache policy bash | head -1
tar czf x.tgz repo && tar xzf x.tgz -C /tmp && sha256sum x.tgz >/dev/null && echo all ok
"""


@pytest.mark.slow
def test_common_runtimes_work_under_the_allowlist(host, root):
    """A too tight allowlist breaks users' workloads: Python (threads, every multiprocessing start
    method, asyncio subprocesses, sqlite), git, venv + pip, pytest and dpkg/apt-cache in the Debian
    Python image. (apt, dpkg and pip installs themselves run in build sandboxes under the same
    filter whenever that image is built.)"""
    from shoal.envs.debian import PYTHON_IMAGE, ensure_python_base

    ensure_python_base(host)
    with Sandbox.create(PYTHON_IMAGE, root=root, memory_mb=1024) as sb:
        r = sb.commands.run(["bash", "-c", WORKLOAD], timeout=300)
        assert r.exit_code == 0 and "python ok" in r.stdout and "1 passed" in r.stdout and "all ok" in r.stdout, \
            (r.stdout[-3000:], r.stderr[-3000:])
