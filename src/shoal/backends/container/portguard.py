"""A port inside a sandbox that only the host reaches (`SandboxBackend.guard_port` / `port_guarded`).

Chromium's DevTools port (127.0.0.1:9222 of a desktop sandbox's netns) is the grader's way into the
browser, and without this it is the agent's too: any process in the sandbox could speak DevTools and
write the graded DOM. The host's connections into a sandbox (ports.connect_in_netns) carry a socket
mark, SO_MARK, which only CAP_NET_ADMIN (or CAP_NET_RAW) may set; the sandbox has neither. A guarded
port gets an nftables rule in the sandbox's own netns that resets every connection to it without that
mark: the sandbox's processes are refused, the host still gets through. Only CAP_NET_ADMIN in the
sandbox's network namespace could remove the rule, so a grader that finds it in place (`guarded`)
knows nothing in the sandbox spoke to the port since it was installed.
"""
from __future__ import annotations

import re
import subprocess

from ...core.contract import check_port
from ...core.errors import SandboxError, SandboxNotFound
from ..pids import starttime

MARK = 0x5EA1  # set on the host's connections into a sandbox (ports.py)
TABLE = "shoal_portguard"
_RULE = re.compile(r"tcp dport (\d+) meta mark != (0x[0-9a-f]+) reject with tcp reset")


def _netns(sandbox_id: str, pid: int, start: int | None) -> list[str]:
    if start is None or starttime(pid) != start:
        raise SandboxNotFound(f"sandbox {sandbox_id} has ended")
    return ["nsenter", f"--net=/proc/{pid}/ns/net"]


def guarded(sandbox_id: str, pid: int, start: int | None, port: int) -> bool:
    """Whether the sandbox's netns resets unmarked connections to `port` (an output-hook rule of ours)."""
    check_port(port)
    r = subprocess.run(_netns(sandbox_id, pid, start) + ["nft", "list", "table", "inet", TABLE],
                       capture_output=True, text=True, timeout=20)
    if r.returncode != 0:
        return False  # no table: never guarded
    hooked = "hook output" in r.stdout
    return hooked and any(int(m.group(1)) == port and int(m.group(2), 16) == MARK
                          for m in _RULE.finditer(r.stdout))


def guard(sandbox_id: str, pid: int, start: int | None, port: int) -> None:
    """Install the rule for `port` in the sandbox's netns (idempotent); SandboxError if it did not take."""
    if guarded(sandbox_id, pid, start, port):
        return
    script = (f"table inet {TABLE} {{\n  chain out {{ type filter hook output priority -10; policy accept; }}\n}}\n"
              f"add rule inet {TABLE} out tcp dport {port} meta mark != {MARK:#x} reject with tcp reset\n")
    r = subprocess.run(_netns(sandbox_id, pid, start) + ["nft", "-f", "-"], input=script,
                       capture_output=True, text=True, timeout=20)
    if r.returncode != 0 or not guarded(sandbox_id, pid, start, port):
        raise SandboxError(f"could not guard port {port} in sandbox {sandbox_id}: {r.stderr.strip()[-300:]}")
