"""Who is asking: the tenant of a request.

  * `Authorization: Bearer <key>`: the admin key is the admin; a tenant's key is that tenant; any
    other key is refused (401). Over TCP a key is always required.
  * Over TCP with a verified client certificate of the fleet's gateways (mTLS, see
    shoal.fleet.pki): the admin; the gateway authenticated the tenant and checks visibility itself.
  * Over the Unix socket without a key, the peer's uid (SO_PEERCRED, see peercred.py) decides:
    uid 0 is the admin; any other uid is the tenant `uid-<uid>`, created with default quotas on its
    first request (an admin may create `uid-<uid>` beforehand to give it other quotas). Who may
    connect at all is the socket's business: mode 0660, group `shoal`.
"""
from __future__ import annotations

import secrets

from fastapi import Depends, Request
from starlette.concurrency import run_in_threadpool

from ..core import errors as E
from .peercred import STATE_KEY, CertPeer, PeerCred
from .served import Served
from .state import ADMIN, Tenant

UID_TENANT_PREFIX = "uid-"


def daemon_of(request: Request) -> Served:
    d = request.app.state.daemon
    if d is None:  # an app built only for its OpenAPI spec
        raise E.BackendUnavailable("this shoald app serves no backend")
    return d


def peer_of(request: Request) -> PeerCred | CertPeer | None:
    state = request.scope.get("state") or {}
    peer = state.get(STATE_KEY)
    return peer if isinstance(peer, (PeerCred, CertPeer)) else None


def uid_tenant_name(uid: int) -> str:
    return f"{UID_TENANT_PREFIX}{uid}"


async def tenant(request: Request) -> Tenant:
    """Who is calling. Async, so the request does not hop to a worker thread for it: the cases
    decided from the request alone (admin key, gateway certificate, root on the socket) and keys a
    fleet gateway has cached answer on the event loop; a lookup in SQLite or PostgreSQL runs in
    the thread pool (FastAPI would run a sync dependency there anyway)."""
    d = daemon_of(request)
    d.counters["requests"] += 1
    auth = request.headers.get("authorization", "")
    key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
    if key:
        if d.admin_key and secrets.compare_digest(key, d.admin_key):
            return ADMIN
        t = d.state.cached_tenant(key)
        if t is None:
            t = await run_in_threadpool(d.state.tenant_for_key, key)
        if t is None:
            raise E.Unauthorized("invalid API key")
        return t
    peer = peer_of(request)
    if isinstance(peer, CertPeer) and peer.gateway:  # a fleet gateway (mTLS): it did the tenant's auth
        return ADMIN
    if not isinstance(peer, PeerCred):
        raise E.Unauthorized("missing API key (Authorization: Bearer <key>)")
    if peer.uid == 0:
        return ADMIN
    return await run_in_threadpool(d.state.tenant_for_uid, uid_tenant_name(peer.uid))


async def admin(t: Tenant = Depends(tenant)) -> Tenant:
    if not t.admin:
        raise E.Unauthorized("this endpoint needs the admin (the admin key, or root on the daemon's socket)")
    return t


class Caller:
    """A request's daemon and tenant, as route handlers need them."""

    __slots__ = ("d", "t")

    def __init__(self, d: Served, t: Tenant):
        self.d, self.t = d, t

    def sandbox(self, sandbox_id: str) -> str:
        """The sandbox id, if this tenant may see it (else 404)."""
        return self.d.visible(self.t, sandbox_id)


async def caller(request: Request, t: Tenant = Depends(tenant)) -> Caller:
    return Caller(daemon_of(request), t)


async def admin_caller(request: Request, t: Tenant = Depends(admin)) -> Caller:
    return Caller(daemon_of(request), t)
