"""Real workspaces: pure-Python projects from PyPI sdists that ship their own test suites.

Each becomes a **workspace** image (`ws/<name>:<version>`): the unpacked sdist at /work/repo,
installed editable (so patches to the source take effect), on top of `python:3.11`. Sdists are
fetched on the host with `pip download --no-binary :all: --no-deps` and cached under the root.
"""
from __future__ import annotations

import subprocess
import sys
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..core.contract import ExecResult
from ..core.errors import BuildError
from ..host import Host
from ..layers.store import ImageInfo
from .builder import Builder
from .debian import PYTHON_IMAGE
from .recipe import parse_recipe


@dataclass(frozen=True)
class WorkspaceSpec:
    name: str  # PyPI project name
    version: str
    tests: str  # pytest arguments for the suite shipped in the sdist
    quick: str  # a fast, deterministic subset (used by the burst benchmark and SWE tasks)
    test_deps: tuple[str, ...] = ()  # installed into the workspace layer besides pytest
    module: str = ""  # import name, when it differs from the project name

    @property
    def import_name(self) -> str:
        return self.module or self.name.replace("-", "_").lower()

    @property
    def image(self) -> str:
        return f"ws/{self.name.lower()}:{self.version}"


CATALOG: tuple[WorkspaceSpec, ...] = (
    WorkspaceSpec("six", "1.16.0", "test_six.py", "test_six.py -k 'test_lazy or test_move_items'"),
    WorkspaceSpec("idna", "3.20", "tests", "tests/test_idna.py", ("hypothesis==6.170.17",)),
    WorkspaceSpec("inflection", "0.5.1", "test_inflection.py", "test_inflection.py -k 'camelize or pluralize'"),
    WorkspaceSpec("more-itertools", "11.2.1", "tests", "tests/test_more.py -k 'chunked or windowed'"),
    WorkspaceSpec("cachetools", "8.0.2", "tests", "tests/test_keys.py tests/test_cached.py"),
    WorkspaceSpec("toolz", "1.2.0", "toolz/tests", "toolz/tests/test_itertoolz.py"),
    WorkspaceSpec("click", "8.5.1", "tests/test_basic.py tests/test_options.py tests/test_arguments.py "
                  "tests/test_commands.py", "tests/test_basic.py"),
    WorkspaceSpec("xmltodict", "1.0.4", "tests", "tests/test_xmltodict.py"),
    WorkspaceSpec("parse", "1.22.4", "tests", "tests/test_parse.py"),
    WorkspaceSpec("iniconfig", "2.3.1", "testing", "testing/test_iniconfig.py"),
)


def fetch_sdist(spec: WorkspaceSpec, cache: Path) -> Path:
    cache.mkdir(parents=True, exist_ok=True)
    norm = spec.name.replace("-", "_").lower()
    for p in cache.glob("*.tar.gz"):
        if p.name.lower().replace("-", "_").startswith(f"{norm}_{spec.version}".replace("-", "_")) or \
                p.name.lower().startswith(f"{spec.name.lower()}-{spec.version}"):
            return p
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:", "--no-deps",
                           "-d", str(cache), f"{spec.name}=={spec.version}"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"pip download {spec.name}=={spec.version} failed: {proc.stderr.strip()[-800:]}")
    return fetch_sdist(spec, cache)


def _top_dir(sdist: Path) -> str:
    with tarfile.open(sdist) as tf:
        first = tf.next()
        if first is None:
            raise BuildError(f"{sdist} is empty")
        return first.name.split("/")[0]


def workspace_recipe(spec: WorkspaceSpec, sdist: Path) -> str:
    deps = f"&& pip install --break-system-packages {' '.join(spec.test_deps)}" if spec.test_deps else ""
    return f"""
FROM {PYTHON_IMAGE}
LABEL shoal.role=workspace
COPY {sdist.name} /work/
RUN cd /work && tar xzf {sdist.name} && rm {sdist.name} && mv {_top_dir(sdist)} repo
WORKDIR /work/repo
RUN pip install --break-system-packages --no-deps -e . {deps} && \\
    git init -q && git add -A && git -c user.email=shoal@localhost -c user.name=shoal commit -qm base
"""


def build_workspace(host: Host, spec: WorkspaceSpec, log: Callable[[str], None] | None = None) -> ImageInfo:
    sdist = fetch_sdist(spec, host.settings.root / "cache" / "sdists")
    recipe = parse_recipe(workspace_recipe(spec, sdist), sdist.parent, name=f"workspace {spec.name}")
    return Builder(host, on_output=log).build(recipe, spec.image).image


def verify_workspace(host: Host, spec: WorkspaceSpec, quick: bool = False, timeout: float = 600) -> ExecResult:
    """Run the project's own tests inside a fresh sandbox of python:3.11 + the workspace."""
    from .sandboxes import open_sandbox

    with open_sandbox(host, PYTHON_IMAGE, [spec.image], memory_mb=1024, disk_mb=512) as sb:
        return sb.commands.run(test_command(spec, quick), timeout=timeout)


def test_command(spec: WorkspaceSpec, quick: bool = False) -> str:
    # -o addopts= : projects' own pytest options may need plugins (coverage...) that tests do not
    return f"python3 -m pytest -q -p no:cacheprovider -o addopts= {spec.quick if quick else spec.tests}"


def agent_sequence(spec: WorkspaceSpec) -> str:
    """A deterministic, agent-like tool-call sequence (DSec replays recorded tool calls): read the
    task, look around the repo, search the code, check git, import the package."""
    return ("cat /work/task/task.json && ls /work/repo > /dev/null && "
            "grep -rn --include=*.py 'def ' /work/repo | head -50 > /dev/null && "
            "git -C /work/repo status --short | head -5 && "
            f"python3 -c 'import {spec.import_name} as m; print(m.__name__)'")
