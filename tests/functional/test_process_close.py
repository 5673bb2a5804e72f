"""Closing a background command while its pump thread still reads its pipes (shoald does it when a
sandbox goes away): the pipes must not be closed under the pump, which would then read closed or
reused descriptors (seen in CI as EBADF in a `shoal-bg-*` thread)."""
from __future__ import annotations

import threading
import time

from shoal import Sandbox
from shoal.core.contract import StartRequest


def test_close_of_a_running_command_ends_its_pump_first(host, base_image):
    errors: list[BaseException] = []
    before = threading.excepthook
    threading.excepthook = lambda a: errors.append(a.exc_value)  # type: ignore[assignment,return-value]
    try:
        with Sandbox.create(base_image, memory_mb=64, disk_mb=8, root=host.settings.root) as sb:
            handles = [host.start(sb.id, StartRequest(argv=["sh", "-c", "echo up; sleep 30"])) for _ in range(4)]
            for h in handles:
                deadline = time.monotonic() + 5
                while "up" not in h.output().stdout and time.monotonic() < deadline:
                    time.sleep(0.02)
            t0 = time.monotonic()
            for h in handles:
                h.close()
                assert not h._pump.is_alive()  # the pump ended before anything was closed
            assert time.monotonic() - t0 < 8
            # the commands were killed (kill-on-close): nothing sleeps in the sandbox any more
            ps = sb.commands.run("ps -o comm= 2>/dev/null || ps").stdout
            assert "sleep" not in ps, ps
            time.sleep(0.5)  # a pump that outlived close() would trip over its closed pipes about now
    finally:
        threading.excepthook = before
    assert not errors, errors
