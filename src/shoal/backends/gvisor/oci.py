"""The OCI runtime bundle (config.json) of one gVisor sandbox, and the runsc command line.

The root file system is not gVisor's business: the backend mounts the same overlay as the container
backend (EROFS layers + a writable upper on a size-capped tmpfs) on the host and hands runsc the
mounted directory as `root.path`, so snapshots capture the upper exactly as for containers.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from ...core.contract import Limits
from ...core.errors import BackendUnavailable

CFS_PERIOD_US = 100_000
# runsc's own threads (the Sentry and the gofer are Go programs) live in the sandbox's host pids
# cgroup too; the sandbox's processes are limited inside gVisor (RLIMIT_NPROC), this is headroom.
HOST_PIDS_HEADROOM = 1024
# Docker's default capability set: root in the sandbox can chown, setuid... but not raise limits
# (no CAP_SYS_RESOURCE: RLIMIT_NPROC holds) nor administer (no CAP_SYS_ADMIN).
CAPS = ["CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL", "CAP_SETGID", "CAP_SETUID",
        "CAP_SETPCAP", "CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT", "CAP_MKNOD", "CAP_AUDIT_WRITE", "CAP_SETFCAP"]
# The container's pid 1: reaps orphans (a shell's `wait` calls waitpid(-1), which reaps any child)
# and ignores every signal it can (not KILL and STOP; not CHLD, which the reaping needs), with
# nothing but the image's /bin/sh. gVisor does not shield pid 1 from signals sent inside as Linux
# does, so without the traps `kill -ALRM 1` would end the sandbox.
_IGNORED = " ".join(str(n) for n in [*range(1, 9), *range(10, 17), 18, *range(20, 32), *range(34, 65)])
INIT_ARGV = ["/bin/sh", "-c", f"trap '' {_IGNORED}; while :; do sleep 2147483647 & wait $!; done"]
PLATFORMS = ("ptrace", "kvm")
# No OCI seccomp list: runsc (this build) applies `linux.seccomp` to the container's pid 1 only,
# never to `runsc exec` processes, i.e. to none of the commands. Calls such as unshare(CLONE_NEWUSER)
# therefore succeed inside, acting on the Sentry's namespaces only (docs/backends.md).


def find_runsc() -> str:
    path = os.environ.get("SHOAL_RUNSC") or shutil.which("runsc")
    if not path:
        raise BackendUnavailable("the gvisor backend needs runsc (Debian package runsc: `apt-get install -y runsc`)")
    return path


def platform() -> str:
    """gVisor's platform: $SHOAL_GVISOR_PLATFORM, else ptrace. This runsc build (Debian's 2022) knows
    ptrace and kvm only (systrap came later); kvm is faster but needs a working /dev/kvm (nested
    virtualisation often lacks it), so it is opt-in; ptrace works everywhere."""
    name = os.environ.get("SHOAL_GVISOR_PLATFORM", "ptrace")
    if name not in PLATFORMS:
        raise BackendUnavailable(f"SHOAL_GVISOR_PLATFORM={name!r}: this runsc supports {', '.join(PLATFORMS)}")
    if name == "kvm" and not os.access("/dev/kvm", os.R_OK | os.W_OK):
        raise BackendUnavailable("SHOAL_GVISOR_PLATFORM=kvm but /dev/kvm is not usable on this host")
    return name


def runsc_argv(runsc: str, state_root: Path, network: str) -> list[str]:
    """Global flags, identical for every runsc call on one sandbox (runsc re-reads them per command).
    --file-access=shared: the gofer revalidates its caches, so files written on the host (the files
    API, uploads) are seen inside at once; --overlay2=none: writes go to our upper on the host, not
    to a gVisor-internal memory overlay that snapshots could not see."""
    argv = [runsc, "--root", str(state_root), f"--platform={platform()}",
            f"--network={'host' if network == 'host' else 'none'}", "--overlay2=none", "--file-access=shared"]
    debug_dir = os.environ.get("SHOAL_GVISOR_DEBUG_LOG")  # runsc's own logs, one file per command
    if debug_dir:
        argv += ["--debug", f"--debug-log={debug_dir.rstrip('/')}/"]
    return argv

SANDBOX_OOM_SCORE_ADJ = 500


def process_spec(argv: list[str], env: dict[str, str], cwd: str, nproc: int,
                 ids: tuple[int, int, list[int]] | None = None) -> dict:
    """ids: (uid, gid, supplementary gids) to run as; None is root. A non-root process gets no
    effective or permitted capabilities (and noNewPrivileges keeps setuid binaries from giving them
    back), as the container backend's init does when it drops to a user."""
    uid, gid, groups = ids or (0, 0, [])
    user: dict = {"uid": uid, "gid": gid, **({"additionalGids": groups} if groups else {})}
    held = CAPS if uid == 0 else []
    return {"user": user, "args": argv, "env": [f"{k}={v}" for k, v in env.items()], "cwd": cwd,
            "capabilities": {"bounding": CAPS, "effective": held, "permitted": held},
            "noNewPrivileges": True,
            # as the container backend's init: a host-wide OOM takes sandboxes before shoald (-900)
            "oomScoreAdj": SANDBOX_OOM_SCORE_ADJ,
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1 << 20, "soft": 1 << 20},
                        {"type": "RLIMIT_NPROC", "hard": nproc, "soft": nproc}]}


def bundle_config(rootfs: Path, hostname: str, limits: Limits, cgroup_path: str, network: str,
                  extra_mounts: list[dict] | None = None) -> dict:
    namespaces = [{"type": t} for t in ("pid", "ipc", "uts", "mount")]
    if network != "host":
        namespaces.append({"type": "network"})
    return {
        "ociVersion": "1.0.0",
        # no environment for pid 1: nothing may show in /proc/1/environ (commands get their own);
        # shells fall back to a built-in PATH to find `sleep`
        "process": process_spec(INIT_ARGV, {}, "/", limits.pids),
        "root": {"path": str(rootfs), "readonly": False},
        "hostname": hostname,
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs"},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
            # runsc puts its own tmpfs over an empty /tmp, which the host (files API, snapshots)
            # could not see: keep /tmp on the overlay like every other path
            {"destination": "/tmp", "type": "bind", "source": str(rootfs / "tmp"), "options": ["rbind", "rw"]},
            *(extra_mounts or []),  # the port relay's tool (relay.py)
        ],
        "linux": {
            "namespaces": namespaces,
            "cgroupsPath": cgroup_path,
            "resources": {
                "memory": {"limit": limits.memory_mb << 20},
                "cpu": {"quota": max(1000, int(limits.cpu * CFS_PERIOD_US)), "period": CFS_PERIOD_US},
                "pids": {"limit": limits.pids + HOST_PIDS_HEADROOM},
            },
        },
    }
