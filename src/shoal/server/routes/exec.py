"""Commands: exec to completion (JSON, or Server-Sent Events with `?stream=true`) and background
commands, whose `ProcessHandle`s the daemon keeps under ids it issues (capped per sandbox)."""
from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterator

from fastapi import APIRouter, Body, Depends, Query, Response
from fastapi.responses import StreamingResponse

from ...core.contract import (
    API_PREFIX,
    MAX_SECONDS,
    ExecRequest,
    ExecResult,
    ProcessInfo,
    ProcessOutput,
    StartRequest,
)
from ..auth import Caller, caller
from ..errors import sse_error

router = APIRouter(prefix=API_PREFIX + "/sandboxes/{sandbox_id}", tags=["commands"])

STREAM_QUEUE = 256  # output pieces buffered per streamed exec; beyond it the command waits for the client
_END = object()


@router.post("/exec", responses={200: {"model": ExecResult, "content": {"text/event-stream": {}}}})
def exec_(sandbox_id: str, body: ExecRequest, stream: bool = Query(False), c: Caller = Depends(caller)):
    sid = c.sandbox(sandbox_id)
    c.d.counters["execs"] += 1
    if not stream:
        return c.d.backend.exec(sid, body)
    return StreamingResponse(_events(c, sid, body), media_type="text/event-stream")


def _events(c: Caller, sid: str, body: ExecRequest) -> Iterator[str]:
    """The exec runs in its own thread; its output reaches the client through a bounded queue, so a
    slow reader slows the command instead of growing the daemon, and a reader that left drops it."""
    q: queue.Queue = queue.Queue(STREAM_QUEUE)
    gone = threading.Event()

    def put(item) -> None:
        while not gone.is_set():
            try:
                q.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def run() -> None:
        try:
            result = c.d.backend.exec(sid, body, on_stdout=lambda s: put(("stdout", s)),
                                      on_stderr=lambda s: put(("stderr", s)))
            put(("result", result))
        except BaseException as e:  # reported as the stream's error event
            put(("error", e))
        finally:
            put(_END)

    threading.Thread(target=run, name=f"exec-stream-{sid}", daemon=True).start()
    try:
        while (item := q.get()) is not _END:
            kind, value = item
            if kind == "result":
                yield f"event: result\ndata: {value.model_dump_json()}\n\n"
            elif kind == "error":
                yield sse_error(value)
            else:
                yield f"event: {kind}\ndata: {json.dumps(value)}\n\n"
    finally:
        gone.set()  # the client left (or the stream ended): the runner stops queueing output


@router.post("/commands", status_code=201)
def start(sandbox_id: str, body: StartRequest, c: Caller = Depends(caller)) -> ProcessInfo:
    sid = c.sandbox(sandbox_id)
    h = c.d.backend.start(sid, body)
    return ProcessInfo(id=c.d.keep(c.d.commands, sid, h), pid=h.pid)


@router.get("/commands/{command_id}")
def output(sandbox_id: str, command_id: str, since_out: int = Query(0, ge=0), since_err: int = Query(0, ge=0),
           wait: float = Query(0, ge=0, le=60), c: Caller = Depends(caller)) -> ProcessOutput:
    """Output since the cursor (since_out, since_err) and the exit code (null while running); with
    wait > 0, waits up to that many seconds for some output (or the exit) when there is none yet."""
    h = c.d.lookup(c.d.commands, c.t, sandbox_id, command_id)
    return h.wait_output((since_out, since_err), wait) if wait else h.output((since_out, since_err))


@router.post("/commands/{command_id}/stdin", status_code=204)
def write_stdin(sandbox_id: str, command_id: str,
                request_body: bytes = Body(b"", media_type="application/octet-stream"),
                c: Caller = Depends(caller)) -> Response:
    """Feed the command's stdin (started with stdin=true)."""
    c.d.lookup(c.d.commands, c.t, sandbox_id, command_id).write_stdin(request_body)
    return Response(status_code=204)


@router.post("/commands/{command_id}/stdin/close", status_code=204)
def close_stdin(sandbox_id: str, command_id: str, c: Caller = Depends(caller)) -> Response:
    c.d.lookup(c.d.commands, c.t, sandbox_id, command_id).close_stdin()
    return Response(status_code=204)


@router.post("/commands/{command_id}/resize", status_code=204)
def resize(sandbox_id: str, command_id: str, rows: int = Query(ge=1, le=1000), cols: int = Query(ge=1, le=1000),
           c: Caller = Depends(caller)) -> Response:
    """Set the size of the command's PTY (started with pty); 501 NotSupported where the backend has none."""
    c.d.lookup(c.d.commands, c.t, sandbox_id, command_id).resize(rows, cols)
    return Response(status_code=204)


@router.post("/commands/{command_id}/wait")
def wait(sandbox_id: str, command_id: str, timeout: float | None = Query(None, gt=0, le=MAX_SECONDS),
         c: Caller = Depends(caller)) -> ExecResult:
    """Block until it exits (408 CommandTimeout if still running after `timeout` seconds)."""
    return c.d.lookup(c.d.commands, c.t, sandbox_id, command_id).wait(timeout)


@router.post("/commands/{command_id}/kill", status_code=204)
def kill(sandbox_id: str, command_id: str, signal: int = Query(9, ge=1, le=64),
         c: Caller = Depends(caller)) -> Response:
    c.d.lookup(c.d.commands, c.t, sandbox_id, command_id).kill(signal)
    return Response(status_code=204)


@router.delete("/commands/{command_id}", status_code=204)
def close(sandbox_id: str, command_id: str, c: Caller = Depends(caller)) -> Response:
    """Stop tracking a background command and free what it holds (kills it if still running)."""
    c.d.lookup(c.d.commands, c.t, sandbox_id, command_id)  # 404 unless visible
    c.d.commands.pop(sandbox_id, command_id)
    return Response(status_code=204)


