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
from shoal.runtime.container.native import helper_path

from .conftest import probe_results


def _table() -> tuple[set[int], set[int], set[int]]:
    """(allowed, denied, special) syscall numbers, from the shoal-init this test session runs."""
    out = subprocess.run([str(helper_path()), "seccomp-table"], capture_output=True, text=True, check=True).stdout
    allowed, denied, special = set(), set(), set()
    for line in out.splitlines():
        nr, what = line.split()
        if nr == "insns":
            assert int(what) <= 4096
            continue
        {"allow": allowed, "deny": denied, "special": special}[what].add(int(nr))
    return allowed, denied, special


def _lines(out: str, prefix: str = "") -> dict[str, str]:
    return dict(l.split("=", 1) for l in out.splitlines() if "=" in l and l.startswith(prefix))


def test_every_call_off_the_allowlist_is_refused(probed):
    allowed, denied, special = _table()
    assert len(allowed) > 200 and len(denied) > 40
    assert not allowed & denied
    top = max(allowed | denied | special) + 64  # past the table: calls a later kernel adds
    skip = sorted(allowed | special)  # clone, unshare, ioctl: argument checks, tried in test_isolation
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
                    assert re.search(r"^TracerPid:\s+0$", f.read(), re.M)
            bg.kill()
    finally:
        host_proc.kill()
        host_proc.wait()
