"""`shoal push` / `shoal pull` as a user types them, then `shoal run` on the pulled image."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from .conftest import PASSWORD, USER
from .oci_build import REPO

CLI = [sys.executable, "-m", "shoal.cli"]


def _shoal(*args: str, root) -> subprocess.CompletedProcess:
    env = dict(os.environ, SHOAL_REGISTRY_USER=USER, SHOAL_REGISTRY_PASSWORD=PASSWORD,
               SHOAL_REGISTRY_HOST="127.0.0.1", SHOAL_URL="local")
    cmd, *rest = args  # --root before any `--`
    return subprocess.run([*CLI, cmd, "--root", str(root), *rest], env=env, capture_output=True, text=True,
                          timeout=120)


def test_cli_pull_then_run(registry, ctr_image, fresh_host):
    root = fresh_host.settings.root
    r = _shoal("pull", f"{registry.addr}/{REPO}:multi", "--as", "ctr:cli", "--ca", str(registry.ca), "--json",
               root=root)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["image"] == "ctr:cli" and out["kind"] == "container" and len(out["fetched"]) == 2
    r = _shoal("run", "--in-process", "ctr:cli", "--", "sh", "-c", "cat /arch; ls /keep", root=root)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["amd64", "b"]


def test_cli_push_prints_no_credentials(registry, host, base_image):
    r = _shoal("push", base_image, f"{registry.addr}/shoal/cli:1", "--ca", str(registry.ca), "--json",
               root=host.settings.root)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["target"] == f"{registry.addr}/shoal/cli:1"
    assert PASSWORD not in r.stdout + r.stderr
    # no --ca: TLS refused, one red line, no traceback
    bad = _shoal("push", base_image, f"{registry.addr}/shoal/cli:1", root=host.settings.root)
    assert bad.returncode == 2 and "not trusted" in bad.stderr and "Traceback" not in bad.stderr


def test_cli_lazy_pull_then_run(registry, lazy_pushed, fresh_host):
    root = fresh_host.settings.root
    r = _shoal("pull", "--lazy", f"{registry.addr}/shoal/lazy:1", "--ca", str(registry.ca), "--json", root=root)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["kind"] == "shoal" and out["lazy"] == [lazy_pushed["busybox"], lazy_pushed["layer"]]
    assert fresh_host.store.location(lazy_pushed["layer"]) == "remote"
    r = _shoal("run", "--in-process", "shoal/lazy:1", "--", "cat", "/data/hello.txt", root=root)
    assert r.returncode == 0 and r.stdout == "hello, lazily\n", r.stderr[-2000:]
