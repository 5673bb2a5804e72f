"""Packaging: a plain `pip install shoal` pulls no torch, Ray or gymnasium (they are the `rollout` and
`train` extras), everything but those extras' modules imports without them, `shoal.train` imports
nothing else of shoal, and a wheel carries the C helper already compiled."""
from __future__ import annotations

import ast
import os
import shutil
import stat
import subprocess
import sys
import zipfile
from email.parser import Parser
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src"
HEAVY = {"torch", "ray", "gymnasium", "pyarrow", "transformers", "trl", "psycopg", "cryptography"}
# modules that are the extras' and may need them; everything else must import without
EXTRA_MODULES = {"shoal.train": "shoal[train]", "shoal.rollout.adapters": "shoal[rollout]",
                 "shoal.rollout.distributed": "shoal[rollout]", "shoal.core.postgres": "shoal[rollout]",
                 "shoal.rollout.queue_pg": "shoal[rollout]", "shoal.trajlog.store_pg": "shoal[rollout]",
                 "shoal.fleet": "shoal[fleet]"}


def _source_copy(tmp_path: Path) -> Path:
    """The project as an sdist would carry it, so building never writes into the checkout."""
    dst = tmp_path / "proj"
    dst.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(REPO / name, dst / name)
    shutil.copytree(SRC, dst / "src", ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    return dst


def _backend(proj: Path, call: str, out: Path) -> str:
    """Run a PEP 517 hook of the project's real build backend (setuptools) in a subprocess."""
    code = f"import setuptools.build_meta as b; print(b.{call}({str(out)!r}))"
    r = subprocess.run([sys.executable, "-c", code], cwd=proj, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()[-1]


def _requires(meta_text: str) -> list[Requirement]:
    return [Requirement(r) for r in Parser().parsestr(meta_text).get_all("Requires-Dist") or []]


def _in(reqs: list[Requirement], extra: str) -> set[str]:
    return {canonicalize_name(r.name) for r in reqs if r.marker is not None and r.marker.evaluate({"extra": extra})}


def _base(reqs: list[Requirement]) -> list[Requirement]:
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def _closure(reqs: list[Requirement]) -> set[str]:
    """Every distribution that installing `reqs` pulls in, walked through the installed metadata."""
    seen: set[str] = set()
    todo = list(reqs)
    while todo:
        r = todo.pop()
        name = canonicalize_name(r.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            sub = metadata.requires(r.name) or []
        except metadata.PackageNotFoundError:
            pytest.fail(f"{r.name} (needed by a base requirement) is not installed: cannot walk its dependencies")
        extras = set(r.extras) | {""}
        todo += [q for q in map(Requirement, sub)
                 if q.marker is None or any(q.marker.evaluate({"extra": e}) for e in extras)]
    return seen


def test_plain_install_pulls_no_torch_ray_or_gymnasium(tmp_path):
    proj = _source_copy(tmp_path)
    out = tmp_path / "meta"
    out.mkdir()
    dist_info = _backend(proj, "prepare_metadata_for_build_wheel", out)
    reqs = _requires((out / dist_info / "METADATA").read_text())
    base = _base(reqs)
    assert {canonicalize_name(r.name) for r in base} >= {"pydantic", "fastapi", "uvicorn", "httpx", "typer"}
    pulled = _closure(base)
    assert not pulled & HEAVY, f"a plain install pulls {sorted(pulled & HEAVY)}"
    assert {"ray", "gymnasium", "pyarrow", "psycopg"} <= _in(reqs, "rollout")
    assert {"torch", "transformers", "trl"} <= _in(reqs, "train")
    # the test extra is the project with both extras, plus the test tools
    assert {tuple(sorted(r.extras)) for r in reqs if canonicalize_name(r.name) == "shoal"
            and r.marker.evaluate({"extra": "test"})} == {("fleet", "rollout", "train")}
    assert {"psycopg", "cryptography"} <= _in(reqs, "fleet")


_BLOCKER = """
import importlib.abc, sys
HEAVY = {heavy!r}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HEAVY:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked: not installed)", name=name)
sys.meta_path.insert(0, Block())
"""


def _run_blocked(body: str) -> subprocess.CompletedProcess:
    code = _BLOCKER.format(heavy=sorted(HEAVY)) + body
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_sdk_cli_and_daemon_import_without_the_extras():
    r = _run_blocked(f"""
import pkgutil, importlib, shoal
extra = {sorted(EXTRA_MODULES)!r}
heavy = set(HEAVY)

def blocked(e):
    # the import failed because of a blocked (extra) package, not for some other reason
    while e is not None:
        if isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] in heavy:
            return True
        e = e.__cause__ or e.__context__
    return False

failed = []
for m in pkgutil.walk_packages(shoal.__path__, "shoal.", onerror=lambda name: None):
    if any(m.name == e or m.name.startswith(e + ".") for e in extra):
        continue
    try:
        importlib.import_module(m.name)
    except ImportError as e:
        if blocked(e):
            failed.append(f"{{m.name}}: {{e}}")
print("\\n".join(failed) or "ok")
""")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "ok", "modules that need an extra but are not the extras' own:\n" + r.stdout


@pytest.mark.parametrize("module", sorted(EXTRA_MODULES))
def test_an_extra_module_says_which_extra_to_install(module):
    r = _run_blocked(f"""
try:
    import {module}
except ImportError as e:
    print(e)
else:
    print("imported")
""")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"pip install '{EXTRA_MODULES[module]}'" in r.stdout, r.stdout


def test_train_imports_nothing_else_of_shoal():
    offenders = []
    for path in sorted((SRC / "shoal" / "train").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level >= 2:
                offenders.append(f"{path.name}:{node.lineno}: from {'.' * node.level}{node.module or ''}")
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            offenders += [f"{path.name}:{node.lineno}: {n}" for n in names
                          if n.split(".")[0] == "shoal" and not n.startswith("shoal.train")]
    assert not offenders, offenders


@pytest.mark.slow
def test_the_wheel_carries_the_compiled_helper_and_the_task_files(tmp_path):
    from shoal.backends.container.native import binary_name

    proj = _source_copy(tmp_path)
    out = tmp_path / "dist"
    out.mkdir()
    wheel = out / _backend(proj, "build_wheel", out)
    assert not wheel.name.endswith("-none-any.whl"), f"{wheel.name}: a wheel with a compiled program is not pure"
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        helper = f"shoal/backends/container/native/build/{binary_name()}"
        assert helper in names, sorted(n for n in names if "native" in n)
        assert stat.S_IMODE(z.getinfo(helper).external_attr >> 16) & 0o111, "the helper is not executable"
        assert {"shoal/tasks/swe/suite.jsonl", "shoal/tasks/swe/runner/run.py",
                "shoal/backends/container/native/shoal_init.c"} <= names
        assert not any(n.startswith("shoal/envs/swe/") for n in names)
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert not {canonicalize_name(r.name) for r in _base(_requires(meta))} & HEAVY
