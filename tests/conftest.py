"""Shared fixtures: a private Shoal root per test session, a busybox base image, layer helpers.

These tests use the real thing: root, mounts, namespaces, cgroups and EROFS images."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from daemonctl import start_daemon
from roots import teardown_root, wipe_root

from shoal import Host, Sandbox
from shoal.layers.busybox import make_busybox_tree

if os.geteuid() != 0:
    pytest.exit("Shoal's tests need root (mounts, namespaces, cgroups)", returncode=3)

# The SDK talks to shoald unless asked otherwise; these tests run sandboxes in-process on private
# roots by default (the daemon suites pass url= explicitly).
os.environ["SHOAL_URL"] = "local"


@pytest.fixture(scope="session", autouse=True)
def shoal_init_built():
    """shoal-init current for the C source, as `make setup` leaves it (kept if current: no compile)."""
    from shoal.backends.container.native import build

    return build()


@pytest.fixture(scope="session")
def root():
    # short path: sandbox control sockets live under it (sun_path is 108 bytes)
    d = Path(tempfile.mkdtemp(prefix="shoal-t-", dir="/tmp"))
    yield d
    wipe_root(d)


@pytest.fixture
def make_root():
    """make_root() -> a Host on a new, empty Shoal root: a host that has never seen an image (all torn
    down after the test, lazy daemon included)."""
    made: list[Path] = []

    def _make() -> Host:
        made.append(Path(tempfile.mkdtemp(prefix="shoal-lz-", dir="/tmp")))
        return Host.get(made[-1])

    yield _make
    for d in made:
        teardown_root(d)


@pytest.fixture(scope="session")
def postgres():
    """A real PostgreSQL server (Debian's package) for the session: see tests/pgctl.py."""
    from pgctl import PgServer

    server = PgServer()
    yield server
    server.close()


@pytest.fixture
def pg_dsn(postgres) -> str:
    """A fresh database on the session's PostgreSQL server."""
    return postgres.new_database()


@pytest.fixture(scope="session")
def host(root) -> Host:
    return Host.get(root)


@pytest.fixture(scope="session")
def base_image(host, tmp_path_factory) -> str:
    tree = make_busybox_tree(tmp_path_factory.mktemp("busybox"))
    host.store.build_from_dir(tree, source="busybox", name="busybox")
    host.store.create_image("busybox:test", ["busybox"])
    return "busybox:test"


@pytest.fixture
def make_layer(host, tmp_path):
    """make_layer({"path": "content" | None (whiteout) | b"bytes"}, opaque=["dir"]) -> digest"""
    counter = [0]

    def _make(files: dict, opaque: list[str] = (), name: str | None = None) -> str:
        counter[0] += 1
        d = tmp_path / f"layer{counter[0]}"
        d.mkdir()
        for rel, content in files.items():
            p = d / rel.lstrip("/")
            p.parent.mkdir(parents=True, exist_ok=True)
            if content is None:
                os.mknod(p, 0o20000, os.makedev(0, 0))  # overlayfs whiteout
            else:
                p.write_bytes(content if isinstance(content, bytes) else content.encode())
        for o in opaque:
            p = d / o.lstrip("/")
            p.mkdir(parents=True, exist_ok=True)
            os.setxattr(p, "trusted.overlay.opaque", b"y")
        return host.store.build_from_dir(d, name=name).digest

    return _make


@pytest.fixture
def sandbox(make_sandbox):
    return make_sandbox(memory_mb=256, disk_mb=64)


# ------------------------------------------------------------------ shoald (daemon, security suites)
@pytest.fixture(scope="module")
def daemon(root, base_image):
    """A real shoald (uvicorn on a private Unix socket) per test module, on the session's Shoal root.
    Tests that restart it put the new process in d["proc"]: that one is stopped at the end."""
    sock = root / "shoald.sock"
    d = {"proc": start_daemon(root, "--max-starting", "8"), "sock": sock, "url": f"unix://{sock}", "root": root,
         "admin_key": (root / "admin.key").read_text().strip()}
    yield d
    d["proc"].terminate()
    d["proc"].wait(20)


@pytest.fixture(scope="module")
def tenants(daemon):
    """Two tenants, a and b, with their keys (tenant-a, tenant-b: names live as long as the session's
    root, so one module uses this; others make tenants of their own names)."""
    from daemonctl import make_tenants

    return make_tenants(daemon["url"])


@pytest.fixture(scope="session")
def swe_tasks(host):
    """The bundled SWE suite, with the environments it needs built in this root (cached builds: free
    when test_real_envs ran first). Needs the package registries on first build."""
    from shoal.envs.debian import ensure_python_base
    from shoal.envs.workspaces import CATALOG, build_workspace
    from shoal.tasks.swe import load_suite

    if not shutil.which("debootstrap"):
        pytest.fail("debootstrap is missing: `make test` installs it")
    ensure_python_base(host)
    tasks = load_suite()
    for spec in CATALOG:
        if any(t.repo == spec.name for t in tasks):
            build_workspace(host, spec)
    return tasks


@pytest.fixture(scope="session")
def few_tasks(swe_tasks):
    """One task from each of three fast repos, for episode-level tests."""
    out = []
    for repo in ("iniconfig", "parse", "six"):
        out.append(next(t for t in swe_tasks if t.repo == repo))
    return out


# ------------------------------------------------------------------ the backend matrix
# Modules marked `pytestmark = pytest.mark.all_backends` run each test that uses `make_sandbox` /
# `sandbox` on every backend: in-process containers, in-process gVisor, and containers through a
# real shoald (the http backend). `@pytest.mark.backends("container", ...)` narrows one test, for
# what only some backends have (each difference is listed, with its reason, in docs/backends.md).
# `pytest.mark.all_backends(fleet=True)` adds the "fleet" kind: containers on the hosts of a 3-host
# fleet, created and driven through its gateways (tests/fleet/fleetctl.py). The fleet is started
# once per session, and only when a test of the fleet kind runs (`-k "not fleet"` starts none).
ALL_BACKENDS = ("container", "gvisor", "http")
FLEET = "fleet"


def pytest_configure(config):
    config.addinivalue_line("markers", "all_backends(fleet=False): run the module's sandbox tests on every backend "
                                       "(fleet=True: through a fleet's gateways too)")
    config.addinivalue_line("markers", "backends(*names): run this test on these backends only")


def pytest_generate_tests(metafunc):
    marker = metafunc.definition.get_closest_marker("all_backends")
    if "backend_kind" not in metafunc.fixturenames or not marker:
        return
    only = metafunc.definition.get_closest_marker("backends")
    kinds = list(only.args if only else ALL_BACKENDS + (FLEET,))
    if not marker.kwargs.get("fleet"):
        kinds = [k for k in kinds if k != FLEET]
    metafunc.parametrize("backend_kind", kinds)


@pytest.fixture
def backend_kind() -> str:
    """The backend a test's sandboxes run on (parametrised in all_backends modules)."""
    return "container"


@pytest.fixture(scope="session")
def matrix_daemon(root, base_image):
    """One shoald for the whole session, on its own socket, serving the session's root."""
    sock = root / "matrix.sock"
    proc = start_daemon(root, "--socket", str(sock), "--max-starting", "8")
    yield f"unix://{sock}"
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="session")
def fleet(postgres, shoal_init_built):
    """A fleet for the session (tests/fleet/fleetctl.py): 3 hosts in network namespaces, 2 gateways,
    a database on the session's PostgreSQL. Started by the first test that asks for it; torn down at
    the end of the session even when tests failed."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "fleet"))
    from fleetctl import build_fleet

    f = build_fleet(postgres)
    old = os.environ.get("SHOAL_CA_CERT")
    os.environ["SHOAL_CA_CERT"] = str(f.fleet_dir / "ca.pem")  # the SDK trusts the gateways' certificate
    try:
        yield f
    finally:
        if old is None:
            os.environ.pop("SHOAL_CA_CERT", None)
        else:
            os.environ["SHOAL_CA_CERT"] = old
        f.close()


@pytest.fixture(scope="session")
def fleet_tenant(fleet) -> str:
    """The key of the tenant that the matrix's fleet-kind sandboxes belong to."""
    return fleet.tenant("matrix", sandboxes=64, cpu=64, memory_mb=65536, disk_mb=65536)


def _onto_fleet(fleet, host: Host, layers) -> None:
    """Layers of the session's root that a fleet-kind sandbox uses, copied into every fleet host's
    store (as a registry would bring them: the fleet's hosts share no files)."""
    for digest in layers or ():
        for h in fleet.hosts:
            store = Host.get(h.root).store
            if not store.has_layer(digest):
                store.add_erofs(host.store.image_path(digest), digest, source="test")


@pytest.fixture
def host_for(request, backend_kind, host):
    """host_for(sandbox): the Shoal `Host` whose root holds it (a fleet host's own root for the fleet
    kind), for tests that look at the host side of a sandbox (cgroups, upper dirs, sockets)."""
    def of(sb: Sandbox) -> Host:
        if backend_kind == FLEET:
            return Host.get(request.getfixturevalue("fleet").host_of(sb.id).root)
        return host

    return of


@pytest.fixture
def make_sandbox(request, backend_kind, root, host, base_image):
    """make_sandbox(image=base_image, **Sandbox.create keywords) on this test's backend; killed after."""
    made: list[Sandbox] = []
    if backend_kind == "gvisor" and not shutil.which("runsc"):
        pytest.skip("runsc (gVisor) is not installed: `make setup` installs it")

    def make(image: str | None = None, **kw) -> Sandbox:
        if backend_kind == "http":
            kw.setdefault("url", request.getfixturevalue("matrix_daemon"))
            kw.setdefault("backend", "container")
        elif backend_kind == FLEET:
            fleet = request.getfixturevalue("fleet")
            fleet.ensure_hosts()
            fleet.ensure_gateways()
            _onto_fleet(fleet, host, kw.get("layers"))
            kw.setdefault("url", fleet.url)
            kw.setdefault("api_key", request.getfixturevalue("fleet_tenant"))
        else:
            kw.setdefault("url", "local")
            kw.setdefault("root", root)
            kw.setdefault("backend", backend_kind)
        sb = Sandbox.create(image or base_image, **kw)
        made.append(sb)
        return sb

    yield make
    for sb in made:
        try:
            sb.kill()
        except Exception:
            pass
