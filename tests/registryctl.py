"""A real registry for tests and benchmarks: Debian's `docker-registry` (the CNCF distribution
registry, 2.8) on loopback. By default TLS from a private CA made here with openssl and htpasswd
(bcrypt) basic auth; plain HTTP and no auth for a benchmark. Its access log tells which requests
reached it. `stop()` ends the process and `start()` brings it back on the same port (the fault
tests stop the registry itself); a second `RegistryServer` on the same storage serves the same
blobs (the filesystem driver keeps no state in the process)."""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

BINARY = "/usr/bin/docker-registry"
USER, PASSWORD = "shoal-test", "s3cret-Pa55word-xyz"
_ACCESS = re.compile(r'"(?P<method>[A-Z]+) (?P<path>\S+) HTTP/[0-9.]+" (?P<status>\d{3}) (?P<size>\d+|-)')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca_and_cert(d: Path) -> tuple[Path, Path, Path]:
    """A private CA and a server certificate for 127.0.0.1 / localhost signed by it."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
             "-subj", "/CN=shoal test CA", cwd=d)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
             "-subj", "/CN=127.0.0.1", cwd=d)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "server.crt", "-days", "2", "-extfile", "san.ext", cwd=d)
    return d / "ca.crt", d / "server.crt", d / "server.key"


def trust(*addrs: str) -> None:
    """Mark test/bench registries (host[:port]) trusted for lazy Shoal layers (shoal.lazy.trust: by
    default none is, and a lazy pull from an untrusted registry downloads its layers instead). It sets
    $SHOAL_TRUSTED_REGISTRIES for this process and the Shoal processes it starts from now on."""
    have = os.environ.get("SHOAL_TRUSTED_REGISTRIES", "").replace(",", " ").split()
    os.environ["SHOAL_TRUSTED_REGISTRIES"] = " ".join(dict.fromkeys([*have, *addrs]))


class RegistryServer:
    """One docker-registry process. `tls`/`auth` off: plain HTTP, anonymous (a benchmark registry that
    Docker reaches without configuration: 127.0.0.0/8 is an insecure registry by default).
    `share`: another RegistryServer whose storage, CA and htpasswd this one uses."""

    def __init__(self, tls: bool = True, auth: bool = True, share: RegistryServer | None = None,
                 workdir: Path | None = None, redirect_to: str | None = None):
        if not os.path.exists(BINARY):
            raise RuntimeError(f"{BINARY} is missing: `make test` installs Debian's docker-registry")
        self.tls, self.auth = (share.tls, share.auth) if share else (tls, auth)
        # blob GETs answered by a redirect to `redirect_to` + the blob's storage path (distribution's
        # `redirect` storage middleware, as a registry on S3 or behind a CDN redirects)
        self.redirect_to = redirect_to
        self.dir = Path(tempfile.mkdtemp(prefix="shoal-reg-", dir=workdir))
        if share is not None:
            self.ca, self.cert, self.key = share.ca, share.cert, share.key
            self.storage, self.htpasswd = share.storage, share.htpasswd
        else:
            if self.tls:
                self.ca, self.cert, self.key = make_ca_and_cert(self.dir)
            else:
                self.ca = self.cert = self.key = None  # type: ignore[assignment]
            self.storage = self.dir / "storage"
            self.htpasswd = self.dir / "htpasswd"
            if self.auth:
                import bcrypt

                self.htpasswd.write_bytes(USER.encode() + b":" + bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(5))
                                          + b"\n")
        self.port = free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self.scheme = "https" if self.tls else "http"
        self.log = self.dir / "registry.log"
        self.log.touch()
        self._write_config()
        self.proc: subprocess.Popen | None = None
        self.start()

    def _write_config(self) -> None:
        tls = (f"  tls:\n    certificate: {self.cert}\n    key: {self.key}\n") if self.tls else ""
        auth = (f"auth:\n  htpasswd:\n    realm: shoal-test\n    path: {self.htpasswd}\n") if self.auth else ""
        redirect = ("middleware:\n  storage:\n    - name: redirect\n      options:\n"
                    f"        baseurl: {self.redirect_to}\n") if self.redirect_to else ""
        (self.dir / "config.yml").write_text(f"""version: 0.1
log:
  level: warn
  accesslog:
    disabled: false
storage:
  cache:
    blobdescriptor: inmemory
  filesystem:
    rootdirectory: {self.storage}
  delete:
    enabled: true
  maintenance:
    uploadpurging:
      enabled: false
http:
  addr: {self.addr}
  secret: shoal-test-upload-state-secret
{tls}{auth}{redirect}""")

    def start(self, timeout: float = 20.0) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([BINARY, "serve", str(self.dir / "config.yml")], stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=self.ca) if self.tls else False
        while True:
            try:
                if httpx.get(f"{self.scheme}://{self.addr}/v2/", verify=verify, timeout=1).status_code in (200, 401):
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"docker-registry did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.05)

    def stop(self) -> None:
        """End the registry process (SIGKILL: a crash; the port closes at once)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def close(self, remove: bool = True) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None
        if remove:
            shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------------ for the tests
    def client(self, **kw):
        from shoal.registry import RegistryClient

        if self.auth:
            kw.setdefault("username", USER)
            kw.setdefault("password", PASSWORD)
        if self.tls:
            kw.setdefault("ca", self.ca)
        else:
            kw.setdefault("plain_http", True)
        return RegistryClient(self.addr, **kw)

    def mark(self) -> int:
        """A position in the access log: `requests(since=mark)` sees only what came after."""
        return self.log.stat().st_size

    def entries(self, since: int = 0) -> list[tuple[str, str, int, int]]:
        """(method, path, status, body bytes) of each request the registry served, from its access log."""
        with open(self.log, "rb") as f:
            f.seek(since)
            text = f.read().decode(errors="replace")
        return [(m["method"], m["path"].split("?")[0], int(m["status"]), int(m["size"]) if m["size"] != "-" else 0)
                for m in _ACCESS.finditer(text)]

    def requests(self, since: int = 0) -> list[tuple[str, str, int]]:
        return [e[:3] for e in self.entries(since)]

    def blob_bytes(self, since: int = 0) -> int:
        """Body bytes of the blob GETs served since `since` (what lazy reads cost the registry)."""
        return sum(e[3] for e in self.entries(since) if e[0] == "GET" and "/blobs/" in e[1])

    def blob_path(self, digest: str) -> Path:
        hexd = digest.split(":", 1)[1]
        return self.storage / "docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"


# the name the registry tests have always used for the fixture's object
Registry = RegistryServer
