"""The client of shoald's watch stream (server/routes/watch.py): `HttpBackend.watch_dir`.

A reader thread parses the NDJSON stream into a bounded queue, so a caller that reads slowly never
grows it: past WATCH_QUEUE events the newest are dropped and the next read reports an `overflow`.
"""
from __future__ import annotations

import collections
import socket
import threading
from typing import TYPE_CHECKING

import httpx

from ...core.contract import API_PREFIX, WATCH_QUEUE, WatchEvent, WatchHandle
from ...core.errors import InvalidArgument

if TYPE_CHECKING:
    from .backend import HttpBackend

IDLE_S = 30.0  # no byte (not even the daemon's keepalive line, every 2 s) for this long: the stream is dead


class HttpWatch(WatchHandle):
    def __init__(self, be: HttpBackend, sandbox_id: str, path: str, recursive: bool):
        self.path, self.recursive, self.sandbox_id = path, bool(recursive), sandbox_id
        self._q: collections.deque[WatchEvent] = collections.deque()
        self._lost = 0
        self._cv = threading.Condition()
        self._done = self._closed = False
        client = be.http
        url = API_PREFIX + be._sb(sandbox_id) + "/watch"
        req = client.build_request("GET", url, params={"path": path, "recursive": str(bool(recursive)).lower()},
                                   timeout=httpx.Timeout(IDLE_S, connect=client.timeout.connect))
        try:
            self._resp = client.send(req, stream=True)
        except httpx.TransportError as e:
            raise be._unreachable(e) from e
        if self._resp.status_code >= 400:
            self._resp.read()
            self._resp.close()
            be.raise_for(self._resp)
        self._t = threading.Thread(target=self._pump, name=f"watch-{sandbox_id}", daemon=True)
        self._t.start()

    def _pump(self) -> None:
        detail = "the daemon ended the stream"
        got_end = False  # the daemon's own end event was queued (the reader may already have taken it)
        try:
            for line in self._resp.iter_lines():
                if self._closed:
                    return
                if not line:
                    continue  # keepalive
                ev = WatchEvent.model_validate_json(line)
                with self._cv:
                    if len(self._q) >= WATCH_QUEUE and ev.type != "end":
                        self._lost += 1
                    else:
                        self._q.append(ev)
                    self._cv.notify_all()
                if ev.type == "end":
                    got_end = True
                    return
        except Exception as e:  # a cut connection, or close() from another thread
            detail = f"the stream from the daemon broke: {e}"
        finally:
            self._resp.close()
            with self._cv:
                if not self._closed and not got_end:
                    self._q.append(WatchEvent(type="end", detail=detail))
                self._done = True
                self._cv.notify_all()

    def read(self, timeout: float = 1.0, max_events: int = 1024) -> list[WatchEvent]:
        if not isinstance(max_events, int) or max_events < 1:
            raise InvalidArgument(f"max_events must be a positive integer, not {max_events!r}")
        with self._cv:
            if not self._q and not self._done and not self._closed:
                self._cv.wait(max(0.0, timeout))
            out: list[WatchEvent] = []
            if self._lost:
                out.append(WatchEvent(type="overflow", detail=f"{self._lost} events dropped (the reader was slow)"))
                self._lost = 0
            while self._q and len(out) < max_events:
                out.append(self._q.popleft())
            return out

    @property
    def ended(self) -> bool:
        with self._cv:
            return self._closed or (self._done and not self._q)

    def close(self) -> None:
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._q.clear()
            self._cv.notify_all()
        # shut the connection down under the reader thread (closing the response here would race that
        # thread inside httpx): its read returns at once and the daemon sees the client leave
        try:
            self._resp.extensions["network_stream"].get_extra_info("socket").shutdown(socket.SHUT_RDWR)
        except (KeyError, AttributeError, OSError):
            pass  # then the reader stops at the next keepalive line


def open_watch(be: HttpBackend, sandbox_id: str, path: str, recursive: bool) -> HttpWatch:
    if not isinstance(path, str) or not path:
        raise InvalidArgument(f"invalid sandbox path {path!r}")
    return HttpWatch(be, sandbox_id, path, recursive)
