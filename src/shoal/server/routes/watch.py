"""File watch route: `SandboxBackend.watch_dir` as a stream.

`GET /v1/sandboxes/{id}/watch?path=P&recursive=false` answers 200 with `application/x-ndjson`: one
`WatchEvent` per line as the changes happen, an empty line every KEEPALIVE_S seconds without any (so a
dead peer or an idle proxy is noticed), and an `end` event last. Errors of opening the watch (no such
directory, the watch caps: 429) are answered before the stream starts. The HTTP backend's `watch_dir`
is its client. A client that reads slowly holds the daemon back, not its memory: the daemon reads the
watch only as fast as the stream drains, and the kernel's bounded queue reports the rest as `overflow`.

A tenant holds at most MAX_TENANT_WATCHES open streams over all its sandboxes (the admin: the
backend's caps only): the backend's own caps are per sandbox and per daemon, so without this one
tenant's few sandboxes could take every watch the daemon allows and leave other tenants none.
"""
from __future__ import annotations

import threading
import weakref
from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter, Depends, Query
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from ...core.contract import API_PREFIX, WatchHandle
from ...core.errors import QuotaExceeded
from ..auth import Caller, caller

router = APIRouter(prefix=API_PREFIX + "/sandboxes/{sandbox_id}", tags=["files"])

KEEPALIVE_S = 2.0
MAX_TENANT_WATCHES = 8  # open watch streams per tenant (the container backend allows 32 per daemon)

_open: dict[str, int] = {}  # by tenant
_lock = threading.Lock()


def _take(tenant: str) -> Callable[[], None]:
    """One of the tenant's watch slots (QuotaExceeded past the cap); returns its release (idempotent)."""
    with _lock:
        if _open.get(tenant, 0) >= MAX_TENANT_WATCHES:
            raise QuotaExceeded(f"tenant {tenant} has {MAX_TENANT_WATCHES} file watches open (the limit); "
                                "close one first")
        _open[tenant] = _open.get(tenant, 0) + 1
    done = [False]

    def release() -> None:
        with _lock:
            if done[0]:
                return
            done[0] = True
            _open[tenant] -= 1
            if not _open[tenant]:
                del _open[tenant]
    return release


async def _lines(h: WatchHandle, release: Callable[[], None] = lambda: None) -> AsyncIterator[bytes]:
    try:
        while True:
            evs = await run_in_threadpool(h.read, KEEPALIVE_S, 512)
            if not evs:
                if h.ended:
                    return
                yield b"\n"
                continue
            yield b"".join(e.model_dump_json(exclude_defaults=True).encode() + b"\n" for e in evs)
            if evs[-1].type == "end":
                return
    finally:
        h.close()  # the client left (or the watch ended): free its inotify instance at once
        release()


@router.get("/watch", response_class=StreamingResponse)
def watch(sandbox_id: str, path: str = Query(..., min_length=1, max_length=4096), recursive: bool = False,
          c: Caller = Depends(caller)) -> StreamingResponse:
    """Stream the changes under a directory (module docstring)."""
    sid = c.sandbox(sandbox_id)
    release = (lambda: None) if c.t.admin else _take(c.t.name)
    try:
        h = c.d.backend.watch_dir(sid, path, recursive)
    except BaseException:
        release()
        raise
    weakref.finalize(h, release)  # a stream never started (its client gone first) frees the slot with the handle
    return StreamingResponse(_lines(h, release), media_type="application/x-ndjson",
                             headers={"cache-control": "no-store"})
