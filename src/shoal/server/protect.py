"""shoald must not be the OOM killer's victim on a full host (issue 16, Safety; docs/density-safety.md).

Three things, each done where the host allows it and reported where it does not:

1. `oom_score_adj` -900 for the daemon (its supervisors set their own, in shoal_init.c): a host-wide
   OOM takes sandbox processes (+500 and up) long before it.
2. Its own memory cgroup, `[density] system_cgroup` (default `shoal-system`), apart from the sandboxes'
   (which are bounded together by `sandboxes_memory_mb`): on cgroup v2 it gets `memory.min` (and
   `memory.low`) = `system_memory_min_mb`, so reclaim driven by the sandboxes does not take the
   daemon's pages either. v1 has no such protection; there the daemon is only moved, so the sandboxes'
   aggregate limit never counts it.
3. The daemon moves itself only when nobody placed it: under systemd (`INVOCATION_ID` set) or in any
   cgroup other than the hierarchy's root (a container, a test harness, a slice), it stays where it is
   and the operator's unit protects it (deploy/systemd: `OOMScoreAdjust=`, `MemoryMin=`, shoal.slice).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..backends.container.cgroups import CGROUP_ROOT

log = logging.getLogger("shoald")
DAEMON_OOM_SCORE_ADJ = -900


@dataclass
class Protection:
    """What protect_daemon did, and what the host refused (each with why)."""

    oom_score_adj: int | None = None
    cgroup: str | None = None  # the memory cgroup the daemon is in afterwards (relative to its hierarchy)
    memory_min_mb: int | None = None
    refused: list[str] = field(default_factory=list)


def _memory_hierarchy() -> tuple[int, Path] | None:
    """(cgroup version, mount point of the memory hierarchy), or None without a memory controller."""
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        return 2, CGROUP_ROOT
    v1 = CGROUP_ROOT / "memory"
    return (1, v1) if (v1 / "memory.limit_in_bytes").exists() else None


def current_memory_cgroup(pid: int | str = "self") -> str | None:
    """The process's memory cgroup path ("/..."), from /proc/<pid>/cgroup (v2: the unified line)."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    unified = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return path
        if controllers == "":
            unified = path
    return unified if (CGROUP_ROOT / "cgroup.controllers").exists() else None


def protect_daemon(system_cgroup: str = "shoal-system", memory_min_mb: int = 256, *,
                   move: bool | None = None, pid: int | None = None) -> Protection:
    """Protect the daemon (this process, or `pid`) from the OOM killer and from the sandboxes' reclaim.
    `move`: None = only when nobody placed it (see the module doc), True = always (tests)."""
    p = Protection()
    target = str(pid or os.getpid())
    try:
        with open(f"/proc/{target}/oom_score_adj", "w") as f:
            f.write(str(DAEMON_OOM_SCORE_ADJ))
        p.oom_score_adj = DAEMON_OOM_SCORE_ADJ
    except OSError as e:
        # EACCES: root here lacks an effective CAP_SYS_RESOURCE (a restricted user namespace, an LSM)
        p.refused.append(f"oom_score_adj {DAEMON_OOM_SCORE_ADJ}: {e.strerror}")
    hier = _memory_hierarchy()
    where = current_memory_cgroup(target)
    p.cgroup = where
    if not system_cgroup or hier is None:
        if hier is None:
            p.refused.append("no memory cgroup controller")
        return p
    if move is None:
        move = not os.environ.get("INVOCATION_ID") and where == "/"
    if not move:
        return p
    version, mount = hier
    d = mount / system_cgroup
    try:
        d.mkdir(exist_ok=True)
        if version == 2 and memory_min_mb:
            mb = str(memory_min_mb << 20)
            try:
                (d / "memory.min").write_text(mb)
                (d / "memory.low").write_text(mb)
                p.memory_min_mb = memory_min_mb
            except OSError as e:  # memory not enabled in the root's subtree_control
                p.refused.append(f"memory.min on {d}: {e.strerror}")
        (d / "cgroup.procs").write_text(target)
        p.cgroup = "/" + system_cgroup
    except OSError as e:
        p.refused.append(f"moving into {d}: {e.strerror}")
    return p


def protect_from_settings(settings) -> Protection:
    """protect_daemon with the host's [density] settings, logged once."""
    p = protect_daemon(settings.system_cgroup, settings.system_memory_min_mb)
    log.warning("shoald OOM protection: oom_score_adj=%s, memory cgroup %s%s%s", p.oom_score_adj, p.cgroup,
                f", memory.min {p.memory_min_mb} MiB" if p.memory_min_mb else "",
                f"; refused: {'; '.join(p.refused)}" if p.refused else "")
    return p
