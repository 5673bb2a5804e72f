"""File watch route: `SandboxBackend.watch_dir` as a stream.

`GET /v1/sandboxes/{id}/watch?path=P&recursive=false` answers 200 with `application/x-ndjson`: one
`WatchEvent` per line as the changes happen, an empty line every KEEPALIVE_S seconds without any (so a
dead peer or an idle proxy is noticed), and an `end` event last. Errors of opening the watch (no such
directory, the watch caps: 429) are answered before the stream starts. The HTTP backend's `watch_dir`
is its client. A client that reads slowly holds the daemon back, not its memory: the daemon reads the
watch only as fast as the stream drains, and the kernel's bounded queue reports the rest as `overflow`.
"""
from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Query
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from ...core.contract import API_PREFIX, WatchHandle
from ..auth import Caller, caller

router = APIRouter(prefix=API_PREFIX + "/sandboxes/{sandbox_id}", tags=["files"])

KEEPALIVE_S = 2.0


async def _lines(h: WatchHandle) -> AsyncIterator[bytes]:
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


@router.get("/watch", response_class=StreamingResponse)
def watch(sandbox_id: str, path: str = Query(..., min_length=1, max_length=4096), recursive: bool = False,
          c: Caller = Depends(caller)) -> StreamingResponse:
    """Stream the changes under a directory (module docstring)."""
    sid = c.sandbox(sandbox_id)
    h = c.d.backend.watch_dir(sid, path, recursive)
    return StreamingResponse(_lines(h), media_type="application/x-ndjson", headers={"cache-control": "no-store"})
