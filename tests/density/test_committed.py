"""committed() (shoald's admission input, read on every create) lists the state dirs at most every
COMMITTED_RESCAN_S: a listdir is O(live sandboxes), 7 ms at 20,000. Its own creates and removals show at
once; another process's by the next rescan."""
from __future__ import annotations

import time

from shoal.backends.container import backend as container_backend
from shoal.backends.container.backend import ContainerBackend
from shoal.core.contract import CreateRequest


def test_own_changes_at_once_foreign_ones_by_the_next_rescan(host, base_image):
    be = host.backend("container")
    other = ContainerBackend(host)  # another process on the same root, as the CLI beside shoald
    be.committed()  # a fresh scan: the next calls within COMMITTED_RESCAN_S answer from the cache
    n0 = len(be.committed())
    own = host.create(CreateRequest(image=base_image, memory_mb=96))
    try:
        assert len(be.committed()) == n0 + 1 and any(x.memory_mb == 96 for x in be.committed())
        t0 = time.monotonic()
        foreign = other.create(CreateRequest(image=base_image, memory_mb=80))
        try:
            if time.monotonic() - t0 < container_backend.COMMITTED_RESCAN_S / 2:
                assert len(be.committed()) == n0 + 1, "rescanned inside COMMITTED_RESCAN_S"
            time.sleep(container_backend.COMMITTED_RESCAN_S)
            assert len(be.committed()) == n0 + 2 and any(x.memory_mb == 80 for x in be.committed())
        finally:
            other.kill(foreign.id)
        be.kill(own.id)
        assert len(be.committed()) == n0 + 1, "its own kill must show at once"
        time.sleep(container_backend.COMMITTED_RESCAN_S)
        assert len(be.committed()) == n0
    finally:
        for sid in (own.id,):
            try:
                be.kill(sid)
            except Exception:
                pass
