"""The http backend's client side alone: shared clients, URLs, and what it says when it cannot connect."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from shoal.backends import open_backend
from shoal.backends.http import HttpBackend, client_for, close_clients, default_url
from shoal.config import DEFAULT_SOCKET
from shoal.core.contract import SandboxBackend
from shoal.core.errors import BackendUnavailable, InvalidArgument


def test_clients_are_shared_per_url_key_and_root(daemon):
    url = daemon["url"]
    try:
        a = client_for(url, "k1")
        assert isinstance(a, HttpBackend) and isinstance(a, SandboxBackend) and a.name == "http"
        assert client_for(url, "k1") is a and open_backend(url, "k1") is a
        assert client_for(url, "k2") is not a and client_for(url, "k1", root="/r") is not a
        close_clients()
        assert client_for(url, "k1") is not a
    finally:
        close_clients()


def test_default_url_is_the_host_daemon_unless_shoal_url_says_otherwise(monkeypatch):
    monkeypatch.delenv("SHOAL_URL", raising=False)
    assert default_url() == f"unix://{DEFAULT_SOCKET}" == "unix:///run/shoal/shoald.sock"
    monkeypatch.setenv("SHOAL_URL", "https://h:8443")
    assert default_url() == "https://h:8443"


def test_unreachable_or_unknown_urls_say_what_to_do(tmp_path):
    with pytest.raises(BackendUnavailable, match="shoal serve"):
        HttpBackend(f"unix://{tmp_path}/none.sock")
    with pytest.raises(InvalidArgument, match="unix:///path or http"):
        HttpBackend("ftp://x")
    outer = Path(tempfile.mkdtemp(prefix="shoal-locked-", dir="/tmp"))
    os.chmod(outer, 0o755)
    locked = outer / "run"
    locked.mkdir(mode=0o700)
    pid = os.fork()
    if pid == 0:  # as nobody, the directory (like /run/shoal to a non-member) cannot be entered
        code = 1
        try:
            os.setgid(65534)
            os.setuid(65534)
            HttpBackend(f"unix://{locked}/shoald.sock")
        except BackendUnavailable as e:
            code = 0 if "`shoal` group" in str(e) else 2
        finally:
            os._exit(code)
    status = os.waitpid(pid, 0)[1]
    shutil.rmtree(outer)
    assert os.waitstatus_to_exitcode(status) == 0
