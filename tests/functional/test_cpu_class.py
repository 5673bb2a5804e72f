"""priority="idle": the sandbox's cgroup is in the idle CPU class (cpu.idle), so it gets only CPU time
no normal task wants; pause moves a sandbox there too and resume restores its own class. The class is
the cgroup's, so nothing inside the sandbox can leave it."""
from __future__ import annotations

import os
import time

from shoal import Sandbox

HOG = "while :; do :; done"


def _cpu_ticks(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            fields = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime + stime
    return total


def test_idle_priority_and_pause_set_the_class(root, base_image, host):
    cg = host.backend("container").cgroups
    with Sandbox.create(base_image, root=root, priority="idle") as idle, Sandbox.create(base_image, root=root) as sb:
        assert idle.info().priority == "idle" and sb.info().priority == "normal"
        assert cg.cpu_idle(idle.id) is True and cg.cpu_idle(sb.id) is False
        sb.pause()
        assert cg.cpu_idle(sb.id) is True  # a paused sandbox waits in the idle class
        sb.resume()
        assert cg.cpu_idle(sb.id) is False  # and gets its own class back
        idle.pause()
        assert sb.commands.run("true").exit_code == 0
        idle.commands.run("true")  # a request resumes it transparently: still idle, as created
        assert cg.cpu_idle(idle.id) is True
        sb.pause()
        sb.commands.run("true")
        assert cg.cpu_idle(sb.id) is False


def test_idle_sandbox_yields_the_cpu_and_cannot_escape(root, base_image, host):
    """Hostile: the idle sandbox renices itself and tries to write its cgroup; its hog, pinned to the
    same CPU as a normal sandbox's hog, still gets only a sliver of that CPU."""
    cg = host.backend("container").cgroups
    with Sandbox.create(base_image, root=root, priority="idle") as idle, Sandbox.create(base_image, root=root) as sb:
        tries = idle.commands.run("renice -n -20 -p $$; echo 0 > /sys/fs/cgroup/cpu.idle; "
                                  "echo 0 > /sys/fs/cgroup/cpu/cpu.idle; echo 1024 > /sys/fs/cgroup/cpu/cpu.shares; "
                                  "echo done")
        assert tries.stdout.strip().endswith("done")
        assert cg.cpu_idle(idle.id) is True
        before = set(cg.procs(idle.id)), set(cg.procs(sb.id))
        hogs = [idle.commands.start(["sh", "-c", "renice -n -20 -p $$ 2>/dev/null; " + HOG]),
                sb.commands.start(["sh", "-c", HOG])]
        try:
            time.sleep(0.3)
            idle_pids = sorted(set(cg.procs(idle.id)) - before[0])
            busy_pids = sorted(set(cg.procs(sb.id)) - before[1])
            assert idle_pids and busy_pids
            cpu = min(os.sched_getaffinity(0))
            for pid in idle_pids + busy_pids:
                os.sched_setaffinity(pid, {cpu})
            t0 = (_cpu_ticks(idle_pids), _cpu_ticks(busy_pids))
            time.sleep(2.0)
            used_idle, used_busy = _cpu_ticks(idle_pids) - t0[0], _cpu_ticks(busy_pids) - t0[1]
        finally:
            for h in hogs:
                h.kill()
        assert used_busy > 0
        assert used_idle < 0.2 * used_busy, (used_idle, used_busy)
