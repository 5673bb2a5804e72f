"""shoald's idle policy: a sandbox nobody has sent a request for `idle_pause_s` is paused, and once
idle for `reclaim_after_s` its cold memory goes to swap (`reclaim_target` of its anonymous memory).

Activity is every request on a sandbox's routes (exec, sessions, files, ...) by a caller allowed to
see that sandbox, counted from when its auth passed until its response body has been sent, so a long
exec or a streamed one is never paused under itself; reading its info and asking to pause or
reclaim it are not activity. A request that fails auth, or names another tenant's sandbox, is not
activity either: anyone who can reach the socket could otherwise keep any sandbox awake. Background
commands do not count (as for the idle TTL): an agent's sandbox with a server running in it still
sleeps. Any later request resumes a paused sandbox transparently, and its memory pages back in on
demand. Thresholds come from the config's [density] table (docs/density.md).
"""
from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from ..core import errors as E
from ..core.contract import API_PREFIX, ReclaimRequest, SandboxState

log = logging.getLogger("shoald")
_SANDBOXES = API_PREFIX + "/sandboxes/"
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]


class IdlePolicy:
    def __init__(self, backend: Any, idle_pause_s: float, reclaim_after_s: float, target: float,
                 counters: dict[str, int]):
        self.backend = backend
        self.idle_pause_s, self.reclaim_after_s, self.target = idle_pause_s, reclaim_after_s, target
        self.counters = counters
        self.last: dict[str, float] = {}  # sandbox id -> monotonic time of its last request
        self.busy: dict[str, int] = {}  # sandbox id -> requests in flight
        self.paused: set[str] = set()  # paused by this policy in the current idle period
        self.reclaimed: set[str] = set()  # reclaimed in the current idle period
        self._stop = threading.Event()
        for name in ("idle_pauses", "idle_reclaims", "reclaimed_bytes"):
            counters.setdefault(name, 0)

    @property
    def every_s(self) -> float:
        """How often to look: a quarter of the shortest threshold, between 0.2 and 5 s."""
        shortest = min(x for x in (self.idle_pause_s, self.reclaim_after_s) if x > 0)
        return min(5.0, max(0.2, shortest / 4))

    # ------------------------------------------------------------------ activity (from requests)
    def begin(self, sandbox_id: str) -> None:
        self.busy[sandbox_id] = self.busy.get(sandbox_id, 0) + 1
        self._touch(sandbox_id)

    def end(self, sandbox_id: str) -> None:
        n = self.busy.get(sandbox_id, 0) - 1
        if n > 0:
            self.busy[sandbox_id] = n
        else:
            self.busy.pop(sandbox_id, None)
        self._touch(sandbox_id)

    def _touch(self, sandbox_id: str) -> None:
        self.last[sandbox_id] = time.monotonic()
        self.paused.discard(sandbox_id)
        self.reclaimed.discard(sandbox_id)

    # ------------------------------------------------------------------ the policy
    def start(self) -> None:
        threading.Thread(target=self._run, name="shoald-idle", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.tick()
            except Exception as e:  # keep going: a failed round is retried on the next
                log.warning("idle policy: %s", e)

    def tick(self) -> None:
        now = time.monotonic()
        live = self.backend.live_ids()
        for gone in set(self.last) - live:
            self.last.pop(gone, None)
            self.paused.discard(gone)
            self.reclaimed.discard(gone)
        for sid in live:
            idle = now - self.last.setdefault(sid, now)  # first seen now: idle from here
            if self.busy.get(sid):
                continue
            try:
                if self.idle_pause_s and idle >= self.idle_pause_s and sid not in self.paused:
                    self._pause(sid)
                if self.reclaim_after_s and idle >= self.reclaim_after_s and sid not in self.reclaimed:
                    self._reclaim(sid)
            except E.SandboxNotFound:
                continue  # ended meanwhile
            except E.ShoalError as e:
                log.warning("idle policy on %s: %s", sid, e)
                self.paused.add(sid)  # not retried every round; a request starts a new idle period
                self.reclaimed.add(sid)

    def _pause(self, sid: str) -> None:
        if self.backend.info(sid).state == SandboxState.PAUSED:
            self.paused.add(sid)
            return
        self.backend.pause(sid)
        if self.busy.get(sid):  # a request arrived while pausing: it may have resumed before we froze
            self.backend.resume(sid)
            return
        self.paused.add(sid)
        self.counters["idle_pauses"] += 1

    def _reclaim(self, sid: str) -> None:
        r = self.backend.reclaim(sid, ReclaimRequest(target=self.target))
        self.reclaimed.add(sid)
        self.counters["idle_reclaims"] += 1
        self.counters["reclaimed_bytes"] += r.reclaimed


def sandbox_of(scope: Scope) -> str | None:
    """The sandbox a request works on, if it is activity (see the module's docstring)."""
    if scope.get("type") != "http":
        return None
    path: str = scope.get("path", "")
    if not path.startswith(_SANDBOXES):
        return None
    sid, _, rest = path[len(_SANDBOXES):].partition("/")
    if not sid:
        return None
    if (scope.get("method"), rest) in (("GET", ""), ("POST", "pause"), ("POST", "reclaim"), ("DELETE", "")):
        return None
    return sid


class _Pending:
    """A request's claim to be activity on `sid`, made good once auth lets it see the sandbox."""

    __slots__ = ("policy", "sid", "begun")

    def __init__(self, policy: IdlePolicy, sid: str):
        self.policy, self.sid, self.begun = policy, sid, False


_pending: contextvars.ContextVar[_Pending | None] = contextvars.ContextVar("shoal_idle_pending", default=None)


def authorized(sandbox_id: str) -> None:
    """Called where a request's caller has been allowed to see `sandbox_id` (Served.visible): from now
    until its response is sent, the request is activity on it. A no-op outside such a request (the
    context is copied into the worker thread a sync route runs in, so this works from there too)."""
    p = _pending.get()
    if p is not None and not p.begun and p.sid == sandbox_id:
        p.begun = True
        p.policy.begin(sandbox_id)


class ActivityMiddleware:
    """Marks a sandbox busy from the moment a request on it passed auth (`authorized`) until its last
    body chunk went out."""

    def __init__(self, app: ASGIApp, policy: IdlePolicy):
        self.app, self.policy = app, policy

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        sid = sandbox_of(scope)
        if sid is None:
            await self.app(scope, receive, send)
            return
        pending = _Pending(self.policy, sid)
        token = _pending.set(pending)
        try:
            await self.app(scope, receive, send)
        finally:
            _pending.reset(token)
            if pending.begun:
                self.policy.end(sid)
