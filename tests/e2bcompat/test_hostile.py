"""The E2B front faces the network: what a hostile client (or a leaked URL) tries, and must not get."""
from __future__ import annotations

import gzip
import stat
import struct
import zlib
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import httpx
import pytest

from shoal.e2b import wire


def _bomb(inflated: int) -> bytes:
    """A gzip stream of `inflated` zero bytes (about 1,000:1), made without holding them."""
    c = zlib.compressobj(9, zlib.DEFLATED, 31)
    chunk = bytes(1 << 20)
    out = [c.compress(chunk) for _ in range(inflated >> 20)]
    return b"".join([*out, c.flush()])


def test_gunzip_stops_at_its_cap():
    assert wire.gunzip(gzip.compress(b"a" * 1000), 1000) == b"a" * 1000
    with pytest.raises(wire.TooLarge):
        wire.gunzip(_bomb(4 << 20), 1 << 20)
    with pytest.raises(wire.RpcError, match="not valid gzip"):
        wire.gunzip(b"not gzip at all", 100)
    with pytest.raises(wire.RpcError, match="truncated"):
        wire.gunzip(gzip.compress(b"b" * 5000)[:-12], 10000)


def test_a_gzip_bomb_in_a_connect_envelope_is_refused(sbx, e2b_server):
    bomb = _bomb(wire.MAX_MESSAGE + (1 << 20))  # ~65 KiB on the wire, past the message cap inflated
    assert len(bomb) < 1 << 20
    r = httpx.post(e2b_server["url"] + "/process.Process/Start", content=struct.pack(">BI", 1, len(bomb)) + bomb,
                   headers={"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": sbx._envd_access_token,
                            "Content-Type": "application/connect+json"}, timeout=60)
    assert b"resource_exhausted" in r.content, r.content[:300]
    assert sbx.commands.run("echo alive").stdout == "alive\n"  # the front (and the sandbox) still serve


def test_a_signed_upload_url_writes_only_its_own_path(sbx):
    up = sbx.upload_url("/tmp/granted.txt")
    r = httpx.post(up, files={"file": ("/etc/profile.d/evil.sh", b"echo owned")})
    assert r.status_code == 200, r.text
    assert sbx.files.read("/tmp/granted.txt") == "echo owned"
    assert not sbx.files.exists("/etc/profile.d/evil.sh")
    two = httpx.post(up, files=[("file", ("a", b"1")), ("file", ("b", b"2"))])
    assert two.status_code == 400


def test_a_colon_in_the_username_cannot_turn_a_read_signature_into_a_write(sbx):
    # signed fields are joined with ':': path "x:write:y" read by user "z" signs the same string as
    # path "x" written by user "y:read:z"
    read = sbx.download_url("/tmp/x:write:y", user="z")
    parts = urlsplit(read)
    q = dict(parse_qsl(parts.query))
    q.update(path="/tmp/x", username="y:read:z")
    forged = urlunsplit(parts._replace(query=urlencode(q)))
    r = httpx.post(forged, files={"file": ("/tmp/x", b"forged")})
    assert r.status_code in (400, 401), r.text
    assert not sbx.files.exists("/tmp/x")


def test_the_state_index_and_its_wal_are_private(sbx, e2b_server, root):
    sbx.set_timeout(60)  # a write: the WAL exists now
    files = list(root.glob(f"{e2b_server['name']}-state.db*"))
    assert any(f.name.endswith("-wal") for f in files), files
    for f in files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f  # every sandbox's access token is in there


def test_serve_refuses_a_network_address_without_tls(root):
    import os
    import subprocess
    import sys

    from shoal.e2b.cli import is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("127.8.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.1") and not is_loopback("example.org")
    r = subprocess.run([sys.executable, "-m", "shoal.cli", "e2b", "serve", "--listen", "0.0.0.0:3999"],
                       env={**os.environ, "SHOAL_URL": "local", "SHOAL_ROOT": str(root)},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "loopback" in r.stdout + r.stderr
