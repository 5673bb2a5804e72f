"""The environment builder: recipes -> layers, with a build cache, and role-aware images.

Each RUN runs in a build sandbox on top of the layers so far; the sandbox's writable upper (with
overlayfs whiteouts and opaque directories as they are) becomes the next EROFS layer. COPY and
WORKDIR produce layers directly. ENV and WORKDIR also become the image's config.

Cache: a step's key is sha256(parent layer digests, the step, env, workdir, excluded paths); a hit
reuses the layer without running anything, so an unchanged recipe rebuilds nothing and a changed
step rebuilds only itself and what follows.

Roles: a **base** image holds its whole stack. A **workspace** or **toolkit** image holds only the
layers its recipe added on top of the base it was built on; sandboxes compose any base with any
compatible workspace and toolkit at creation (`Sandbox.create(base, layers=[ws, tk])`), so
upgrading a base or a toolkit rebuilds nothing else.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..backends.container.backend import BUILD_CA_PATH, HOST_CA_BUNDLE
from ..core.contract import ExecRequest, Limits
from ..core.errors import BuildError, InvalidArgument
from ..host import Host
from ..layers.store import ImageInfo
from .recipe import Recipe, Step, load_recipe
from .sandboxes import create_request

# build residue left out of RUN layers: scratch space and package-manager caches
DEFAULT_EXCLUDE = ("tmp", "var/tmp", "root/.cache", "var/cache/apt/archives", "var/lib/apt/lists",
                   "run/shoal-build")
# build steps with network trust the host's CA bundle (TLS-intercepting proxies), via env only
_CA_ENV = ("SSL_CERT_FILE", "PIP_CERT", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")
BUILD_LIMITS = Limits(cpu=2.0, memory_mb=4096, disk_mb=4096, pids=4096)


@dataclass
class StepResult:
    step: Step
    digest: str | None
    cached: bool
    seconds: float


@dataclass
class BuildResult:
    image: ImageInfo
    steps: list[StepResult] = field(default_factory=list)

    @property
    def built(self) -> int:
        """Steps that did work (not served by the cache)."""
        return sum(1 for s in self.steps if s.digest and not s.cached)


class Builder:
    def __init__(self, host: Host, limits: Limits = BUILD_LIMITS, exclude: tuple[str, ...] = DEFAULT_EXCLUDE,
                 on_output: Callable[[str], None] | None = None,
                 on_step: Callable[[int, int, Step, bool], None] | None = None, step_timeout: float = 3600):
        self.host = host
        self.limits = limits
        self.exclude = tuple(p.strip("/") for p in exclude)
        self.on_output = on_output
        self.on_step = on_step
        self.step_timeout = step_timeout

    def build_file(self, path: str | Path, tag: str, context: str | Path | None = None) -> BuildResult:
        return self.build(load_recipe(path, context), tag)

    def build(self, recipe: Recipe, tag: str) -> BuildResult:
        store = self.host.store
        base_layers: list[str] = []
        env: dict[str, str] = {}
        workdir = "/"
        if recipe.base:
            base = store.get_image(recipe.base)
            base_layers = list(base.layers)
            env = dict(base.config.get("env", {}))
            workdir = base.config.get("workdir", "/")
        layers = list(base_layers)
        result_steps: list[StepResult] = []
        for i, step in enumerate(recipe.steps):
            t0 = time.monotonic()
            if step.kind == "ENV":
                env.update(dict(step.args))
                result_steps.append(StepResult(step, None, True, 0.0))
                continue
            if step.kind == "WORKDIR":
                workdir = step.args[0]
            key = self._key(layers, step, env, workdir, recipe)
            digest = store.cache_get(key)
            cached = digest is not None
            if self.on_step:
                self.on_step(i, len(recipe.steps), step, cached)
            if digest is None:
                digest = self._run_step(step, layers, env, workdir, recipe)
                store.cache_put(key, digest, step.text)
            layers.append(digest)
            result_steps.append(StepResult(step, digest, cached, time.monotonic() - t0))
        own = layers[len(base_layers):] if recipe.role != "base" else layers
        if not own:
            raise BuildError(f"recipe for {tag} adds no layer; a {recipe.role} image needs at least one step")
        config = {"env": env, "workdir": workdir, "role": recipe.role}
        if recipe.role != "base" and recipe.base:
            config["built_on"] = recipe.base
        image = store.create_image(tag, own, config=config)
        return BuildResult(image, result_steps)

    # ------------------------------------------------------------------ steps
    def _key(self, parents: list[str], step: Step, env: dict, workdir: str, recipe: Recipe) -> str:
        material = {"parents": parents, "step": step.text, "network": step.network, "env": sorted(env.items()),
                    "workdir": workdir, "exclude": self.exclude}
        if step.kind == "COPY":
            material["sources"] = [self._source_digest(recipe.context / s) for s in step.args[:-1]]
        return "sha256:" + hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()

    def _source_digest(self, path: Path) -> str:
        from ..layers.digest import file_sha256, tree_digest

        if path.is_dir():
            return tree_digest(path)[0]
        if path.is_file():
            return file_sha256(str(path))
        raise InvalidArgument(f"COPY source {path} does not exist in the build context")

    def _run_step(self, step: Step, layers: list[str], env: dict, workdir: str, recipe: Recipe) -> str:
        store = self.host.store
        if step.kind in ("COPY", "WORKDIR"):
            with store._scratch() as d:
                root = d / "root"
                root.mkdir()
                if step.kind == "WORKDIR":
                    (root / workdir.lstrip("/")).mkdir(parents=True, exist_ok=True)
                else:
                    self._stage_copy(step, recipe.context, root, workdir)
                return store.build_from_dir(root, source=f"recipe:{step.text}").digest
        if not layers:
            raise BuildError(f"line {step.line}: RUN needs a base with a shell (FROM scratch has none)")
        host = self.host
        step_env = dict(env)
        if step.network == "host" and os.path.isfile(HOST_CA_BUNDLE):
            step_env.update({k: BUILD_CA_PATH for k in _CA_ENV if k not in env})
        lim = self.limits
        info = host.create(create_request(None, layers, cpu=lim.cpu, memory_mb=lim.memory_mb, disk_mb=lim.disk_mb,
                                          pids=lim.pids, upper=lim.upper, env=step_env, network=step.network,
                                          hostname="shoal-build"))
        try:
            script = f"mkdir -p {_q(workdir)} && cd {_q(workdir)} && {step.args[0]}"
            res = host.exec(info.id, ExecRequest(argv=["/bin/sh", "-c", script], cwd="/", timeout=self.step_timeout,
                                                 output_cap=1 << 20),
                            on_stdout=self.on_output, on_stderr=self.on_output)
            if res.timed_out or res.exit_code != 0:
                tail = (res.stdout + res.stderr)[-2000:]
                why = "timed out" if res.timed_out else f"exited with {res.exit_code}"
                raise BuildError(f"line {step.line}: `{step.text}` {why}:\n{tail}")
            return host.capture_layer(info.id, source=f"recipe:{step.text}", exclude=list(self.exclude)).digest
        finally:
            host.kill(info.id)

    def _stage_copy(self, step: Step, context: Path, root: Path, workdir: str) -> None:
        *sources, dest = step.args
        dest_path = dest if dest.startswith("/") else os.path.join(workdir, dest)
        target = root / dest_path.lstrip("/")
        many = len(sources) > 1 or dest.endswith("/")
        for src in sources:
            sp = (context / src).resolve()
            if not str(sp).startswith(str(context.resolve())):
                raise InvalidArgument(f"COPY source {src} leaves the build context")
            if not sp.exists():
                raise InvalidArgument(f"COPY source {src} does not exist in {context}")
            if sp.is_dir():
                # like Docker: the directory's contents go into dest
                shutil.copytree(sp, target, symlinks=True, dirs_exist_ok=True)
            else:
                out = target / sp.name if many else target
                out.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(sp, out)


def _q(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"
