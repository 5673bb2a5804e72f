"""What agent code inside a desktop sandbox can do to a grade and to the VNC forward without touching the
page file, the browser's binary, flags, libraries or policy (what test_browser_checker.py and
test_vnc.py already try). First written by the red-team review (F3-F5 of issue 18); each attack test
failed before its fix (docs/desktop.md, "Grader hardening").

- DevTools is Chromium's remote debugging port on the sandbox's loopback: the checker's way in, and
  was the agent's too (`Runtime.evaluate` in the page's main world rewrote the graded DOM). The port
  is now guarded: only the host's (marked) connections reach it (the attack on a real Chromium is
  test_browser_checker.py's test_agent_code_cannot_write_the_graded_dom_through_devtools).
- The VNC forward pinned whatever process listened after it ran `x11vnc` from the sandbox's PATH: an
  agent that replaced /usr/bin/x11vnc was the pinned server.
- window / a11y / spreadsheet_cell / command checks run programs inside the sandbox (the desktop
  helper, ssconvert, a shell): an agent that replaced them answered what the check wants.

The first two tests run on busybox: the backend's parts of the fixes (guard_port, written_under)."""
from __future__ import annotations

import socket
import time

import pytest

from shoal.core.errors import ShoalError
from shoal.envs.desktop import DESKTOP_IMAGE, desktop_layers, ensure_desktop
from shoal.envs.sandboxes import open_sandbox


def test_a_guarded_port_refuses_the_sandbox_and_lets_the_host_in(sandbox):
    """guard_port: a process in the sandbox is reset on the guarded port (it cannot lift the rule: no
    CAP_NET_ADMIN there, nor set the host's mark); the host's connect_port still gets through."""
    sb = sandbox
    sb.commands.run("(while :; do echo hi | nc -l -p 9222; done) </dev/null >/dev/null 2>&1 &", check=True)
    deadline = time.monotonic() + 10
    while not any(s.state == "listen" for s in sb.port_sockets(9222)):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    probe = "echo x | nc 127.0.0.1 9222; echo rc=$?"
    assert "hi" in sb.commands.run(probe, timeout=10).stdout  # unguarded: the sandbox reaches it
    assert not sb.port_guarded(9222)
    sb.guard_port(9222)
    sb.guard_port(9222)  # idempotent
    assert sb.port_guarded(9222) and not sb.port_guarded(9223)
    out = sb.commands.run(probe, timeout=10).stdout
    assert "hi" not in out and "rc=0" not in out, out
    with sb.connect_port(9222, timeout=5) as c:
        assert c.recv(16).startswith(b"hi")


def test_written_under_names_what_the_sandbox_wrote(sandbox):
    sb = sandbox
    trusted = ["/bin", "/usr", "/etc/ld.so.preload", "/etc/python3*"]
    assert sb.written_under(trusted) == []
    sb.commands.run("mkdir -p /etc/python3.11 /root/x && echo x > /etc/python3.11/sitecustomize.py && "
                    "touch /etc/ld.so.preload /root/x/y && rm /bin/true", check=True)
    got = sb.written_under(trusted)
    assert sorted(got) == ["/bin/true", "/etc/ld.so.preload", "/etc/python3.11/sitecustomize.py"], got
    assert sb.written_under(["/root"]) == ["/root/x/y"]


@pytest.mark.slow
def test_the_vnc_forward_does_not_pin_a_replaced_x11vnc(host, desktop_images):
    from shoal.desktop.vnc import VncForward

    ensure_desktop(host, apps=("editor",), vnc=True)
    sb = open_sandbox(host, DESKTOP_IMAGE, desktop_layers(["editor"], vnc=True), memory_mb=1024, disk_mb=256)
    try:
        sb.desktop.start()
        # the agent, long before anyone watches: its own "x11vnc" (no authentication) at the real one's path
        fake = ("#!/usr/bin/python3\nimport socket, sys\nport = int(sys.argv[sys.argv.index('-rfbport') + 1])\n"
                "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
                "s.bind(('127.0.0.1', port)); s.listen()\n"
                "while True:\n c, _ = s.accept(); c.sendall(b'RFB 003.008\\n\\x01\\x01')\n")
        sb.files.write("/usr/bin/x11vnc", fake, mode=0o755)
        try:
            fwd = VncForward(sb)
        except ShoalError as e:
            assert "not the desktop-vnc layer's x11vnc" in str(e)
            return  # refused to start
        with fwd:
            with socket.create_connection(("127.0.0.1", fwd.port), timeout=20) as c:
                got = c.recv(64)
            assert got == b"", f"the forward carried a viewer to the agent's server: {got!r}"
    finally:
        sb.kill()


FORGED_HELPER = """#!/bin/sh
# the agent's stand-in for /usr/local/bin/shoal-desktop: a forged window list, the real one otherwise
if [ "$1" = windows ]; then
  echo '[{"id": 1, "title": "Signed up", "app": "chromium", "wm_class": "chromium.Chromium", "pid": 1,'\\
       ' "x": 0, "y": 0, "width": 10, "height": 10, "focused": true}]'
  exit 0
fi
exec /usr/local/bin/.shoal-desktop.real "$@"
"""

FORGED_SSCONVERT = """#!/bin/sh
# the agent's stand-in for ssconvert: whatever CSV the check wants, at the path it asked for
for last; do :; done
printf 'a,b\\n1,42\\n' > "$last"
"""


@pytest.mark.slow
def test_checks_do_not_run_programs_the_agent_replaced(desk):
    """window and spreadsheet_cell checks run programs inside the sandbox (the desktop helper, ssconvert):
    agent code that is root there replaces them and answers what the check wants. Last in the module:
    the sandbox's /usr stays written."""
    from shoal.tasks.desktop.task import SpreadsheetCell, WindowCheck, check, check_result

    sb = desk
    assert not check(sb, WindowCheck(type="window", title="Signed up"))
    sb.commands.run(["cp", "-p", "/usr/local/bin/shoal-desktop", "/usr/local/bin/.shoal-desktop.real"], check=True)
    sb.files.write("/usr/local/bin/shoal-desktop", FORGED_HELPER, mode=0o755)
    sb.files.write("/usr/bin/ssconvert", FORGED_SSCONVERT, mode=0o755)
    sb.files.write("/root/budget.gnumeric", "not a workbook")
    try:
        forged = {"window": check(sb, WindowCheck(type="window", title="Signed up")),
                  "spreadsheet_cell": check(sb, SpreadsheetCell(type="spreadsheet_cell", path="/root/budget.gnumeric",
                                                                cell="B2", value="42"))}
        why = check_result(sb, WindowCheck(type="window", title="Signed up"))
    finally:
        sb.commands.run(["mv", "/usr/local/bin/.shoal-desktop.real", "/usr/local/bin/shoal-desktop"])
        sb.commands.run(["rm", "-f", "/usr/bin/ssconvert"])
    assert not any(forged.values()), f"checks passed on the agent's stand-in programs: {forged}"
    assert why[1] is not None and why[1].startswith("tamper:") and "/usr/local/bin" in why[1], why
    # put back, the files are still the sandbox's own (a copy, a removal): still not trusted
    assert check_result(sb, WindowCheck(type="window", title="Signed up"))[1] is not None
