"""A sandboxed process that never reads its stdin must not hold the writer's thread, nor close and kill.

Servers feed stdin from a small pool of worker threads (shoald's routes, the E2B front's SendInput):
a write that blocked on a full pipe for as long as the process lives would let one tenant stall every
other tenant's calls, and would hold the lock that close() and kill need."""
from __future__ import annotations

import threading
import time

import pytest

from shoal.backends.container.processes import STDIN_WRITE_TIMEOUT_S
from shoal.core.contract import CreateRequest, ExecRequest, StartRequest
from shoal.core.errors import CommandTimeout, InvalidArgument


def test_a_full_stdin_pipe_times_out_and_close_is_not_held(host, base_image):
    sb = host.create(CreateRequest(image=base_image))
    try:
        h = host.start(sb.id, StartRequest(argv=["sleep", "600"], stdin=True))
        t0 = time.monotonic()
        with pytest.raises(CommandTimeout, match="did not read its stdin"):
            h.write_stdin(b"x" * (4 << 20))  # far past a pipe's 64 KiB: only a reader could take it
        assert time.monotonic() - t0 < STDIN_WRITE_TIMEOUT_S + 3
        # a second writer waits its own bounded turn, and close() is not held for ever behind it
        errors: list[BaseException] = []

        def write() -> None:
            try:
                h.write_stdin(b"y" * (1 << 20))
            except BaseException as e:  # noqa: BLE001 - collected for the assertion below
                errors.append(e)

        w = threading.Thread(target=write)
        w.start()
        time.sleep(0.2)
        t1 = time.monotonic()
        h.kill()
        h.close()
        w.join(STDIN_WRITE_TIMEOUT_S + 3)
        assert not w.is_alive() and time.monotonic() - t1 < STDIN_WRITE_TIMEOUT_S + 3
        # it ends either way: timed out, or refused once the kill broke the pipe
        assert len(errors) == 1 and isinstance(errors[0], (CommandTimeout, InvalidArgument)), errors
        # the sandbox still answers
        assert host.exec(sb.id, ExecRequest(argv=["echo", "ok"])).stdout == "ok\n"
    finally:
        host.kill(sb.id)


def test_stdin_that_is_read_is_written_whole(host, base_image):
    sb = host.create(CreateRequest(image=base_image))
    try:
        h = host.start(sb.id, StartRequest(argv=["wc", "-c"], stdin=True))
        h.write_stdin(b"z" * (1 << 20))  # 16 pipe-fulls: the reader drains as the writer waits
        h.close_stdin()
        assert h.wait(30).stdout.strip() == str(1 << 20)
    finally:
        host.kill(sb.id)
