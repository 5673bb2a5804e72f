"""`shoal e2b serve` on loopback over the container backend (SHOAL_URL=local, the session's root), and
the unmodified `e2b` SDK pointed at it.

The template is `base` mapped to a busybox image with the host's own bash (binary and libraries
copied in: the SDK runs `/bin/bash -l -c CMD`, and its PTYs an interactive login bash), E2B's user
`user` (uid 1000) in /etc/passwd and /home/user owned by it: the full Debian `base` (templates.py's
recipe) needs debootstrap and apt, minutes, which this suite does not spend."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

PASSWD = (b"root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000:user:/home/user:/bin/bash\n"
          b"nobody:x:65534:65534:nobody:/:/bin/false\n")
GROUP = b"root:x:0:\nuser:x:1000:\nnogroup:x:65534:\n"


def host_bash() -> dict[str, bytes]:
    """The host's /bin/bash and the shared libraries it loads, at the same paths (a real bash in a
    busybox image, without debootstrap)."""
    out = subprocess.run(["ldd", "/bin/bash"], check=True, capture_output=True, text=True).stdout
    files = {"bin/bash": open("/bin/bash", "rb").read()}
    for line in out.splitlines():
        path = line.split("=>")[-1].split("(")[0].strip()
        if path.startswith("/"):
            files[path.lstrip("/")] = open(os.path.realpath(path), "rb").read()
    return files


@pytest.fixture(scope="session")
def e2b_image(host, base_image, make_layer_session) -> str:
    layer = make_layer_session({**host_bash(), "etc/passwd": PASSWD, "etc/group": GROUP, "root/.keep": b"",
                                "home/user/.keep": b""}, owned={"home/user": (1000, 1000)})
    busybox = host.store.get_image(base_image).layers
    host.store.create_image("e2b-test:latest", [*busybox, layer])
    return "e2b-test:latest"


@pytest.fixture(scope="session")
def code_interpreter_image(host) -> str:
    """`e2b-code-interpreter:latest` from its recipe, in the session's root: on python:3.11 (built once
    per session and shared with the other suites that need it), plus one pip layer (build cache)."""
    from shoal.e2b.templates import CODE_INTERPRETER_IMAGE, build_code_interpreter

    build_code_interpreter(host)
    return CODE_INTERPRETER_IMAGE


@pytest.fixture(scope="session")
def make_layer_session(host, tmp_path_factory):
    def _make(files: dict[str, bytes], owned: dict[str, tuple[int, int]] | None = None) -> str:
        d = tmp_path_factory.mktemp("e2blayer")
        for rel, content in files.items():
            p = d / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(content)
            if rel.startswith(("bin/", "lib")):
                p.chmod(0o755)
        for rel, (uid, gid) in (owned or {}).items():
            for dirpath, _, names in os.walk(d / rel):
                os.chown(dirpath, uid, gid)
                for n in names:
                    os.chown(os.path.join(dirpath, n), uid, gid)
        return host.store.build_from_dir(d, name="e2b-test").digest

    return _make


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_front(root, env: dict, *args: str, name: str | None = None, keys: tuple[str, str] | None = None) -> dict:
    """`shoal e2b serve` with two tenants' keys (made, or given) and its own index file under `name`;
    returns url, keys, the process and the arguments that restart it."""
    name = name or f"front-{_free_port()}"
    keys_file = root / f"{name}-keys.json"
    cli = [sys.executable, "-m", "shoal.cli", "e2b"]
    if keys is None:
        keys = tuple(subprocess.run([*cli, "key", "create", who, "--keys", str(keys_file)], env=env, check=True,
                                    capture_output=True, text=True).stdout.strip() for who in ("alice", "bob"))
    key_a, key_b = keys
    port = _free_port()
    proc = subprocess.Popen([*cli, "serve", "--listen", f"127.0.0.1:{port}", "--keys", str(keys_file),
                             "--state", str(root / f"{name}-state.db"), *args], env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(url + "/v2/sandboxes", timeout=1)
            break
        except httpx.TransportError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("shoal e2b serve did not come up") from None
            time.sleep(0.1)
    return {"url": url, "key": key_a, "other_key": key_b, "proc": proc, "name": name, "args": args}


@pytest.fixture(scope="session")
def e2b_server(root, e2b_image, base_image):
    """The front as the CLI runs it, over the container backend in its own process (SHOAL_URL=local)."""
    env = {**os.environ, "SHOAL_URL": "local", "SHOAL_ROOT": str(root)}
    d = start_front(root, env, "--template", f"base={e2b_image}", "--template", f"bare={base_image}")
    yield d
    d["proc"].terminate()
    d["proc"].wait(20)


@pytest.fixture
def opts(e2b_server) -> dict:
    """Connection options for the SDK: what E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY would set."""
    return {"api_url": e2b_server["url"], "sandbox_url": e2b_server["url"], "api_key": e2b_server["key"]}


@pytest.fixture
def sbx(opts):
    from e2b import Sandbox

    s = Sandbox.create("base", timeout=120, **opts)
    yield s
    try:
        s.kill()
    except Exception:
        pass
