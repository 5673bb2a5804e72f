"""Recipes: a Dockerfile subset that builds Shoal layers.

    # shoal recipe for a workspace
    FROM debian-python:bookworm
    LABEL shoal.role=workspace
    ENV PIP_NO_CACHE_DIR=1
    COPY requests-2.32.3/ /work/requests
    WORKDIR /work/requests
    RUN --network=host pip install --break-system-packages -e . pytest
    RUN rm -rf /work/requests/.git

Instructions:
  FROM ref        an image (name[:tag]) or `scratch` (then the first step must be COPY)
  RUN [--network=host|none] cmd   runs `/bin/sh -c cmd` in a build sandbox on top of the layers so
                  far; its writable upper becomes the next layer. Builds get the host network by
                  default (to reach package registries); task sandboxes never do.
  COPY src... dest   files from the build context (directory of the recipe unless given)
  ENV K=V ... | ENV K V      environment for later steps and for sandboxes of the image
  WORKDIR /path   working directory for later steps and the image's default cwd (created if missing)
  LABEL shoal.role=base|workspace|toolkit   the layer's role (see builder.py)
Lines ending in a backslash continue; `#` starts a comment line.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

from ..core.errors import InvalidArgument

ROLES = ("base", "workspace", "toolkit")


@dataclass(frozen=True)
class Step:
    kind: str  # RUN | COPY | ENV | WORKDIR
    text: str  # the normalised instruction, part of the cache key
    args: tuple = ()
    network: str = "host"
    line: int = 0


@dataclass
class Recipe:
    base: str | None  # None = scratch
    steps: list[Step] = field(default_factory=list)
    role: str = "base"
    context: Path = Path(".")


def _logical_lines(text: str) -> list[tuple[int, str]]:
    out, buf, start = [], "", 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip()
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if not buf:
            start = n
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        out.append((start, (buf + line).strip()))
        buf = ""
    if buf:
        out.append((start, buf.strip()))
    return out


def parse_recipe(text: str, context: str | Path = ".", name: str = "recipe") -> Recipe:
    """Parse recipe text; errors name the line and what is wrong."""
    base: str | None = None
    seen_from = False
    steps: list[Step] = []
    role = "base"
    for n, line in _logical_lines(text):
        word, _, rest = line.partition(" ")
        op = word.upper()
        rest = rest.strip()

        def bad(msg: str, n: int = n, line: str = line) -> InvalidArgument:
            return InvalidArgument(f"{name}:{n}: {msg}: {line!r}")

        if op == "FROM":
            if seen_from:
                raise bad("only one FROM is supported")
            if not rest or " " in rest:
                raise bad("FROM takes one image reference or `scratch`")
            base = None if rest == "scratch" else rest
            seen_from = True
            continue
        if not seen_from:
            raise bad("the recipe must start with FROM")
        if op == "RUN":
            network = "host"
            while rest.startswith("--"):
                flag, _, rest = rest.partition(" ")
                rest = rest.strip()
                if flag in ("--network=host", "--network=default"):
                    network = "host"
                elif flag == "--network=none":
                    network = "none"
                else:
                    raise bad(f"unknown RUN flag {flag}")
            if not rest:
                raise bad("RUN needs a command")
            steps.append(Step("RUN", f"RUN {rest}", (rest,), network, n))
        elif op == "COPY":
            try:
                parts = shlex.split(rest)
            except ValueError as e:
                raise bad(str(e)) from None
            if len(parts) < 2:
                raise bad("COPY needs at least one source and a destination")
            for src in parts[:-1]:
                if Path(src).is_absolute() or ".." in Path(src).parts:
                    raise bad(f"COPY source {src!r} must be inside the build context")
            steps.append(Step("COPY", "COPY " + " ".join(parts), tuple(parts), line=n))
        elif op == "ENV":
            if not rest:
                raise bad("ENV needs KEY=VALUE")
            try:
                parts = shlex.split(rest)
            except ValueError as e:
                raise bad(str(e)) from None
            if "=" in parts[0]:
                pairs = []
                for p in parts:
                    k, eq, v = p.partition("=")
                    if not eq or not k:
                        raise bad(f"expected KEY=VALUE, got {p!r}")
                    pairs.append((k, v))
            else:
                pairs = [(parts[0], " ".join(parts[1:]))]
            steps.append(Step("ENV", "ENV " + " ".join(f"{k}={v}" for k, v in pairs), tuple(pairs), line=n))
        elif op == "WORKDIR":
            if not rest.startswith("/"):
                raise bad("WORKDIR must be an absolute path")
            steps.append(Step("WORKDIR", f"WORKDIR {rest}", (rest,), line=n))
        elif op == "LABEL":
            for p in shlex.split(rest):
                k, _, v = p.partition("=")
                if k == "shoal.role":
                    if v not in ROLES:
                        raise bad(f"shoal.role must be one of {', '.join(ROLES)}")
                    role = v
        else:
            raise bad(f"unsupported instruction {word} (FROM, RUN, COPY, ENV, WORKDIR, LABEL)")
    if not seen_from:
        raise InvalidArgument(f"{name}: empty recipe (no FROM)")
    if base is None and steps and steps[0].kind == "RUN":
        raise InvalidArgument(f"{name}:{steps[0].line}: FROM scratch has no shell; start with COPY")
    return Recipe(base=base, steps=steps, role=role, context=Path(context))


def load_recipe(path: str | Path, context: str | Path | None = None) -> Recipe:
    p = Path(path)
    if not p.is_file():
        raise InvalidArgument(f"recipe {p} does not exist")
    return parse_recipe(p.read_text(), context if context is not None else p.parent, name=str(p))
