"""Connect-RPC with the JSON codec, as E2B's envd speaks it over HTTP/1.1 (server side, written here).

Unary calls: the request body is one JSON message; the answer is 200 + one JSON message, or an
error status + `{"code", "message"}`. Server streams: the request and every answer message are
enveloped (1 flag byte, 4-byte big-endian length, payload); the last envelope carries flag 0x02 and
`{}` or `{"error": {...}}`, and the HTTP status stays 200 even when the stream ends in an error.
Client streams: several request envelopes, one answer message and the end envelope.
"""
from __future__ import annotations

import base64
import json
import struct
import zlib
from typing import Any

FLAG_COMPRESSED = 0x01
FLAG_END = 0x02
_HEADER = struct.Struct(">BI")
MAX_MESSAGE = 64 << 20  # one request message at most (a SendInput chunk, a ListDir request)

UNARY_CONTENT_TYPE = "application/json"
STREAM_CONTENT_TYPE = "application/connect+json"

# Connect code -> HTTP status of a unary error (the Connect protocol's table)
HTTP_STATUS = {
    "canceled": 499, "unknown": 500, "invalid_argument": 400, "deadline_exceeded": 504, "not_found": 404,
    "already_exists": 409, "permission_denied": 403, "resource_exhausted": 429, "failed_precondition": 400,
    "aborted": 409, "out_of_range": 400, "unimplemented": 501, "internal": 500, "unavailable": 503,
    "data_loss": 500, "unauthenticated": 401,
}


class RpcError(Exception):
    """An error answered to the client with a Connect code (`not_found`, `already_exists`, ...)."""

    def __init__(self, code: str, message: str):
        if code not in HTTP_STATUS:
            raise ValueError(f"unknown Connect code {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message

    def to_json(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


def envelope(payload: bytes, flags: int = 0) -> bytes:
    return _HEADER.pack(flags, len(payload)) + payload


def message(obj: dict[str, Any]) -> bytes:
    """One stream message, enveloped."""
    return envelope(json.dumps(obj, separators=(",", ":")).encode())


def end_of_stream(error: RpcError | None = None) -> bytes:
    body: dict[str, Any] = {} if error is None else {"error": error.to_json()}
    return envelope(json.dumps(body).encode(), FLAG_END)


def split_envelopes(body: bytes) -> list[dict[str, Any]]:
    """The request messages of a streaming call (the end envelope, if a client sends one, is dropped)."""
    out: list[dict[str, Any]] = []
    i = 0
    while i < len(body):
        if len(body) - i < _HEADER.size:
            raise RpcError("invalid_argument", "truncated envelope header")
        flags, n = _HEADER.unpack_from(body, i)
        i += _HEADER.size
        if n > MAX_MESSAGE or len(body) - i < n:
            raise RpcError("invalid_argument", "envelope length past the end of the body or the size cap")
        payload = body[i:i + n]
        i += n
        if flags & FLAG_END:
            continue
        if flags & FLAG_COMPRESSED:
            payload = gunzip(payload, MAX_MESSAGE)
        out.append(decode(payload))
    return out


class TooLarge(RpcError):
    """A gzip body that inflates past its cap (a gzip bomb: about 1,000:1 for zeros)."""

    def __init__(self, cap: int):
        super().__init__("resource_exhausted", f"the gzip body inflates past {cap} bytes")


def gunzip(data: bytes, cap: int) -> bytes:
    """Inflate one gzip stream, never holding more than `cap` bytes of its output."""
    d = zlib.decompressobj(wbits=31)
    try:
        out = d.decompress(data, cap + 1)
    except zlib.error as e:
        raise RpcError("invalid_argument", f"body is not valid gzip: {e}") from None
    if len(out) > cap or d.unconsumed_tail:
        raise TooLarge(cap)
    if not d.eof:
        raise RpcError("invalid_argument", "body is not valid gzip: truncated stream")
    return out


def decode(payload: bytes) -> dict[str, Any]:
    """One JSON message; anything but an object is invalid_argument."""
    if not payload:
        return {}
    try:
        obj = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RpcError("invalid_argument", f"request is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise RpcError("invalid_argument", "request must be a JSON object")
    return obj


def b64(data: bytes) -> str:
    """bytes fields travel as base64 in the protobuf JSON mapping."""
    return base64.b64encode(data).decode()


def unb64(text: Any, field: str) -> bytes:
    if not isinstance(text, str):
        raise RpcError("invalid_argument", f"{field} must be base64 text")
    try:
        return base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_" if ("-" in text or "_" in text)
                                else None)
    except ValueError:
        raise RpcError("invalid_argument", f"{field} is not base64") from None


def as_int(v: Any, field: str, default: int = 0) -> int:
    """int64 fields arrive as JSON strings, int32 as numbers: both accepted."""
    if v is None:
        return default
    if isinstance(v, bool):
        raise RpcError("invalid_argument", f"{field} must be an integer")
    try:
        return int(v)
    except (TypeError, ValueError):
        raise RpcError("invalid_argument", f"{field} must be an integer, got {v!r}") from None
