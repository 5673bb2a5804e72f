"""Process identity that survives pid reuse: a pid plus its start time (clock ticks since boot).

Backends keep the (pid, start) of the processes a sandbox lives on (init, supervisor, runsc's
sandbox) in their state files; a later process with the same pid has another start time.
"""
from __future__ import annotations


def starttime(pid: int) -> int | None:
    """The process's start time, or None if it is gone (a zombie is gone for our purposes)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2:].split()  # after the command name, which may hold spaces
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def alive(pid: int | None, start: int | None) -> bool:
    """Whether the process recorded as (pid, start) still runs."""
    return pid is not None and pid > 0 and start is not None and starttime(pid) == start
