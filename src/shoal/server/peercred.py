"""Who is on the other end of a Unix-socket connection: SO_PEERCRED, read once per connection.

uvicorn does not expose the peer's credentials, so shoald's Unix-socket server uses a protocol
subclass that reads them when the connection is made and hands them to every request of that
connection through the ASGI lifespan state, which uvicorn copies into each request's scope
(`scope["state"]`, Starlette's `request.state`). A TCP connection carries none: it needs a key,
unless the listener verified a client certificate (mTLS, a fleet's gateways): then `CertPeer`.
"""
from __future__ import annotations

import asyncio
import socket
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

STATE_KEY = "shoal_peer"  # key in scope["state"]
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass(frozen=True)
class PeerCred:
    pid: int
    uid: int
    gid: int


@dataclass(frozen=True)
class CertPeer:
    """A TLS peer whose client certificate the listener verified (mTLS: shoald serving a fleet
    accepts only certificates of the fleet's CA). `gateway`: the certificate names the role
    `gateway` (OU), the only one a host serves."""

    subject: str
    gateway: bool


def cert_peer_of(transport: asyncio.BaseTransport) -> CertPeer | None:
    """The verified client certificate of a TLS connection, else None (no TLS, or no certificate)."""
    ssl_object = transport.get_extra_info("ssl_object")
    if ssl_object is None:
        return None
    cert = ssl_object.getpeercert()
    if not cert:  # no certificate asked for, or none given (CERT_OPTIONAL)
        return None
    fields = {k: v for rdn in cert.get("subject", ()) for k, v in rdn}
    return CertPeer(subject=str(fields.get("commonName", "")),
                    gateway=fields.get("organizationalUnitName") == "gateway")


def peer_of(sock: socket.socket | None) -> PeerCred | None:
    """The credentials of a connected AF_UNIX socket's peer (as of its connect()), else None."""
    if sock is None or sock.family != socket.AF_UNIX:
        return None
    try:
        pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    except OSError:
        return None
    return PeerCred(pid, uid, gid)


def _base_protocol() -> type:
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        return HttpToolsProtocol
    except ImportError:  # httptools is optional in uvicorn: the pure-Python parser
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol


if TYPE_CHECKING:  # both parsers' protocols have the same interface; the checker sees one of them
    from uvicorn.protocols.http.h11_impl import H11Protocol as _Base
else:
    _Base = _base_protocol()


class PeerCredProtocol(_Base):
    """uvicorn's HTTP protocol, plus the peer's credentials (Unix) or verified certificate (TLS) in
    each request's scope["state"]."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # uvicorn's stub types it as BaseTransport
        super().connection_made(transport)
        # a per-connection copy: the shared lifespan state must never carry one peer's identity
        state = dict(self.app_state)
        state[STATE_KEY] = peer_of(transport.get_extra_info("socket")) or cert_peer_of(transport)
        self.app_state = state
