"""Who holds a TCP port inside a sandbox, read from the host (`SandboxBackend.port_sockets`).

A grader that talks to a server in the sandbox (Chromium's DevTools on 9222) must know the server is
the one it expects, not one the agent started after killing it. The host answers without asking
anything inside the sandbox: the sandbox's TCP tables (/proc/<init>/net/tcp, tcp6: its own network
namespace), the socket inodes its processes hold (/proc/<pid>/fd of the pids in its cgroup), and
each holder's program (/proc/<pid>/exe). A program counts as the image's own when nothing on its
path was written in the sandbox: no entry in the writable upper at the file itself, and no
replaced or opaque directory above it (a file copied up, replaced or renamed there is the agent's).
"""
from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from ...core.contract import PortSocket, check_port

_STATES = {"0A": "listen", "01": "established"}
_DELETED = " (deleted)"
# the sandbox's mounts beside its overlay root (shoal-init's setup_rootfs): /dev (its tmpfs, /dev/shm
# on it, exec allowed), /proc, /sys; a file there is none of the image layers'
_OWN_MOUNTS = frozenset({"dev", "proc", "sys"})


def _sockets_on(init_pid: int, port: int) -> dict[int, str]:
    """inode -> state of the sockets in init_pid's network namespace with local port `port`."""
    out: dict[int, str] = {}
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{init_pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) < 10 or ":" not in f[1]:
                continue
            try:
                local_port, inode = int(f[1].rsplit(":", 1)[1], 16), int(f[9])
            except ValueError:
                continue
            if local_port == port and inode:  # inode 0: not yet accepted or already closed: nobody holds it
                out[inode] = _STATES.get(f[3], "other")
    return out


def image_file(upper: Path, path: str) -> bool:
    """Whether the sandbox's `path` is its image layers' file: nothing at it or above it in the upper."""
    if not path.startswith("/") or path.endswith(_DELETED):
        return False
    parts = [p for p in path.split("/") if p]
    if not parts or ".." in parts or "." in parts:
        return False
    if parts[0] in _OWN_MOUNTS:
        return False  # not on the overlay at all: /dev/shm takes files and runs them, the upper never sees them
    cur = upper
    for i, part in enumerate(parts):
        cur = cur / part
        try:
            st = os.lstat(cur)
        except FileNotFoundError:
            return True  # the rest of the path is the layers' (the upper holds nothing from here down)
        if i == len(parts) - 1 or not stat.S_ISDIR(st.st_mode):
            return False  # the file itself was written (or whited out), or a directory above it replaced
        with contextlib.suppress(OSError):
            if os.getxattr(cur, "trusted.overlay.opaque") == b"y":
                return False  # a directory made anew: its lower contents are hidden
    return True


def port_sockets(init_pid: int, pids: list[int], upper: Path, port: int) -> list[PortSocket]:
    """PortSocket per socket on local `port` in init_pid's netns, with its holders among `pids`."""
    check_port(port)
    wanted = _sockets_on(init_pid, port)
    holders: dict[int, list[int]] = {inode: [] for inode in wanted}
    names = {f"socket:[{inode}]": inode for inode in wanted}
    for pid in pids if wanted else []:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue  # it exited meanwhile
        for fd in fds:
            try:
                inode = names.get(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                continue
            if inode is not None and pid not in holders[inode]:
                holders[inode].append(pid)
    # a socket nobody held in the scan may have been closed meanwhile (a connection just ended): one
    # no longer in the table is gone, not unheld; one still there is reported with no holders
    still = _sockets_on(init_pid, port) if any(not h for h in holders.values()) else wanted
    out = []
    for inode, state in wanted.items():
        if not holders[inode] and inode not in still:
            continue
        exes: list[str] = []
        for pid in holders[inode]:
            try:
                exes.append(os.readlink(f"/proc/{pid}/exe"))
            except OSError:
                exes.append("")
        procs = [_proc_facts(pid, upper) for pid in holders[inode]]
        out.append(PortSocket(state=state, pids=holders[inode], exes=exes,
                              exes_from_image=[bool(e) and image_file(upper, e) for e in exes],
                              cmdlines=[p[0] for p in procs], starts=[p[1] for p in procs],
                              code_from_image=[p[2] for p in procs]))
    return out


def _proc_facts(pid: int, upper: Path) -> tuple[list[str], int, bool]:
    """A holder's argv, its start time (clock ticks after boot; 0 if it exited) and whether every file
    it maps executable is the image layers' own. Read from the host: the kernel keeps the start time
    and the mappings, the process cannot change them. (Not its environment: Chromium, for one, writes
    its process title over that memory, so /proc/<pid>/environ no longer says what it started with.)"""
    try:
        argv = [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]]
    except OSError:
        argv = []
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
        start = int(stat_line.rsplit(")", 1)[1].split()[19])  # field 22, counted after the comm field
    except (OSError, IndexError, ValueError):
        start = 0
    code: set[str] = set()
    try:
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            f = line.split(None, 5)
            if len(f) == 6 and "x" in f[1] and not f[5].startswith("["):  # [vdso], [vsyscall]: the kernel's
                code.add(f[5])
        own = all(image_file(upper, c) for c in code)
    except OSError:
        own = False  # unreadable: assume the worst
    return argv, start, own
