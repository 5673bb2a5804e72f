"""A Docker user's image, unchanged: a private dockerd (bench/docker_engine.py) builds an image and
`docker push`es it to the test registry; `shoal pull` converts it and a sandbox runs it."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shoal import Sandbox
from shoal.layers.busybox import make_busybox_tree
from shoal.registry import pull

from .conftest import PASSWORD, USER

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from docker_engine import PrivateDockerd  # noqa: E402


@pytest.fixture(scope="module")
def dockerd():
    engine = PrivateDockerd(prefix="shoal-reg-dockerd-")
    if not engine.up():
        engine.down()
        pytest.skip(f"no Docker engine here: {engine.error}")  # optional: Debian's docker.io (make docker-engine)
    yield engine
    engine.down()


def test_docker_pushed_image_pulls_and_runs(dockerd, registry, fresh_host, tmp_path):
    env = dict(dockerd.env(), DOCKER_CONFIG=str(tmp_path / "docker-cfg"))

    def docker(*args: str, stdin: bytes | None = None) -> str:
        r = subprocess.run(["docker", *args], env=env, input=stdin, capture_output=True, timeout=120)
        assert r.returncode == 0, r.stderr.decode()[-2000:]
        return r.stdout.decode()

    tree = make_busybox_tree(tmp_path / "rootfs")
    tar = tmp_path / "rootfs.tar"
    subprocess.run(["tar", "-C", str(tree), "-cf", str(tar), "."], check=True)
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "hello.txt").write_text("from docker\n")
    (ctx / "Dockerfile").write_text("FROM shoal-test/bb:1\nCOPY hello.txt /srv/hello.txt\nENV WHO=docker\n"
                                    "WORKDIR /srv\n")
    target = f"{registry.addr}/docker/hello:1"  # 127.0.0.0/8 registries: Docker skips TLS verification
    docker("import", str(tar), "shoal-test/bb:1")
    build = subprocess.run(["docker", "build", "-q", "-t", target, str(ctx)], env={**env, "DOCKER_BUILDKIT": "0"},
                           capture_output=True, timeout=120)
    assert build.returncode == 0, build.stderr.decode()[-2000:]
    docker("login", "-u", USER, "--password-stdin", registry.addr, stdin=PASSWORD.encode())
    docker("push", target)
    with registry.client() as cl:
        res = pull(fresh_host.store, target, client=cl)
    assert res.kind == "container" and len(res.image.layers) == 2
    with Sandbox.create("docker/hello:1", root=fresh_host.settings.root) as sb:
        r = sb.commands.run("cat hello.txt; echo $WHO; pwd")
    assert r.exit_code == 0, r.stderr
    assert r.stdout == "from docker\ndocker\n/srv\n"
