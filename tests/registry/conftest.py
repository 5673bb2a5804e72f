"""A real registry for the registry tests: Debian's `docker-registry` (the CNCF distribution
registry) on loopback, TLS from a private CA made here with openssl, htpasswd (bcrypt) basic auth,
storage in a tmp dir; its access log tells the tests which requests reached it."""
from __future__ import annotations

import os
import re
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import bcrypt
import httpx
import pytest
from roots import wipe_root

from shoal import Host
from shoal.registry import RegistryClient

BINARY = "/usr/bin/docker-registry"
USER, PASSWORD = "shoal-test", "s3cret-Pa55word-xyz"
_ACCESS = re.compile(r'"(?P<method>[A-Z]+) (?P<path>\S+) HTTP/[0-9.]+" (?P<status>\d{3}) ')


@dataclass
class Registry:
    addr: str  # 127.0.0.1:PORT
    ca: Path
    storage: Path
    log: Path
    proc: subprocess.Popen

    def client(self, **kw) -> RegistryClient:
        kw.setdefault("username", USER)
        kw.setdefault("password", PASSWORD)
        return RegistryClient(self.addr, ca=self.ca, **kw)

    def mark(self) -> int:
        """A position in the access log: `requests(since=mark)` sees only what came after."""
        return self.log.stat().st_size

    def requests(self, since: int = 0) -> list[tuple[str, str, int]]:
        """(method, path, status) of each request the registry served, from its access log."""
        with open(self.log, "rb") as f:
            f.seek(since)
            text = f.read().decode(errors="replace")
        return [(m["method"], m["path"].split("?")[0], int(m["status"])) for m in _ACCESS.finditer(text)]

    def blob_path(self, digest: str) -> Path:
        hexd = digest.split(":", 1)[1]
        return self.storage / "docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"


def _free_port() -> int:
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


@pytest.fixture(scope="session")
def registry():
    if not os.path.exists(BINARY):
        pytest.fail(f"{BINARY} is missing: `make test` installs Debian's docker-registry")
    d = Path(tempfile.mkdtemp(prefix="shoal-reg-"))
    ca, cert, key = make_ca_and_cert(d)
    (d / "htpasswd").write_bytes(USER.encode() + b":" + bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(5)) + b"\n")
    port = _free_port()
    storage = d / "storage"
    (d / "config.yml").write_text(f"""version: 0.1
log:
  level: warn
  accesslog:
    disabled: false
storage:
  filesystem:
    rootdirectory: {storage}
  delete:
    enabled: true
  maintenance:
    uploadpurging:
      enabled: false
http:
  addr: 127.0.0.1:{port}
  secret: shoal-test-upload-state-secret
  tls:
    certificate: {cert}
    key: {key}
auth:
  htpasswd:
    realm: shoal-test
    path: {d / 'htpasswd'}
""")
    log = d / "registry.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([BINARY, "serve", str(d / "config.yml")], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    reg = Registry(f"127.0.0.1:{port}", ca, storage, log, proc)
    deadline = time.monotonic() + 20
    trust = ssl.create_default_context(cafile=ca)
    while True:
        try:
            if httpx.get(f"https://{reg.addr}/v2/", verify=trust, timeout=1).status_code == 401:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"docker-registry did not start: {log.read_text()[-2000:]}")
        time.sleep(0.1)
    yield reg
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def ctr_image(registry, tmp_path_factory) -> dict:
    """An ordinary multi-arch OCI image in the registry, at shoal/ctr:multi (and :docker-v2)."""
    from .oci_build import push_container_image

    return push_container_image(registry, tmp_path_factory.mktemp("ctr-bb"))


@pytest.fixture(scope="session")
def other_root():
    """A second, fresh Shoal root: the host that pulls."""
    d = Path(tempfile.mkdtemp(prefix="shoal-p-", dir="/tmp"))
    yield d
    wipe_root(d)


@pytest.fixture(scope="session")
def other_host(other_root) -> Host:
    return Host.get(other_root)


@pytest.fixture
def fresh_host():
    """A root of its own, for a test that must start from nothing."""
    d = Path(tempfile.mkdtemp(prefix="shoal-f-", dir="/tmp"))
    yield Host.get(d)
    wipe_root(d)
