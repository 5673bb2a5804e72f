"""E2B templates -> Shoal images, and the recipe of the `base` template.

E2B's `base` is a Debian image whose commands run as `user` (home /home/user) under a login bash, with
sudo, python3, git and curl. BASE_RECIPE builds the same on Shoal's debootstrap'd `debian:bookworm`
(`shoal e2b templates build`); any other template is a name mapped to an image the host already has.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from ..core.errors import InvalidArgument

BASE_TEMPLATE = "base"
BASE_IMAGE = "e2b-base:latest"
USER = "user"
HOME = "/home/user"

BASE_RECIPE = f"""
FROM debian:bookworm
LABEL shoal.role=base
ENV LANG=C.UTF-8 HOME={HOME} USER={USER}
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \\
    bash sudo python3 python3-pip git curl ca-certificates procps && apt-get clean
RUN useradd --create-home --shell /bin/bash --uid 1000 {USER} && \\
    echo '{USER} ALL=(ALL:ALL) NOPASSWD: ALL' > /etc/sudoers.d/{USER} && chmod 0440 /etc/sudoers.d/{USER}
WORKDIR {HOME}
"""

# The code interpreter (`e2b-code-interpreter`'s Sandbox; its SDK asks for `code-interpreter-v1`): Python
# 3.11 with an IPython kernel, matplotlib, and Shoal's execute server on port 49999 (interpreter/server.py),
# started by /etc/e2b/start.sh when the sandbox is created (ports.py runs a template's start script).
CODE_INTERPRETER_TEMPLATE = "code-interpreter"
CODE_INTERPRETER_IMAGE = "e2b-code-interpreter:latest"
INTERPRETER_DIR = Path(__file__).with_name("interpreter")
CODE_INTERPRETER_RECIPE = f"""
FROM python:3.11
LABEL shoal.role=base
ENV LANG=C.UTF-8 HOME={HOME} USER={USER} MPLBACKEND=module://matplotlib_inline.backend_inline
RUN pip install --break-system-packages ipykernel==6.29.5 jupyter_client==8.6.3 matplotlib==3.9.4 && \
    useradd --create-home --shell /bin/bash --uid 1000 {USER} && \
    python3 -c 'import matplotlib.pyplot, jupyter_client.kernelspec as k; print(k.find_kernel_specs())'
COPY server.py /opt/shoal/interpreter_server.py
COPY start.sh /etc/e2b/start.sh
WORKDIR {HOME}
"""

DEFAULT_TEMPLATES: dict[str, str] = {BASE_TEMPLATE: BASE_IMAGE, CODE_INTERPRETER_TEMPLATE: CODE_INTERPRETER_IMAGE,
                                     "code-interpreter-v1": CODE_INTERPRETER_IMAGE}


def parse_template_args(items: list[str]) -> dict[str, str]:
    """`NAME=IMAGE` pairs from the command line, over the defaults."""
    out = dict(DEFAULT_TEMPLATES)
    for item in items:
        name, sep, image = item.partition("=")
        if not sep or not name or not image:
            raise InvalidArgument(f"--template wants NAME=IMAGE, got {item!r}")
        out[name] = image
    return out


def resolve(templates: Mapping[str, str], template_id: str) -> str:
    """The image of a template; a template may also be named by its image ref (name:tag)."""
    if template_id in templates:
        return templates[template_id]
    if template_id in templates.values():
        return template_id
    raise LookupError(template_id)


def build_base(host, log: Callable[[str], None] | None = None):
    """Build `e2b-base:latest` from BASE_RECIPE on this host (needs the network for apt)."""
    from ..envs.builder import Builder
    from ..envs.debian import ensure_debian_base
    from ..envs.recipe import parse_recipe

    ensure_debian_base(host, log=log)
    return Builder(host, on_output=log).build(parse_recipe(BASE_RECIPE), BASE_IMAGE).image


def build_code_interpreter(host, log: Callable[[str], None] | None = None):
    """Build `e2b-code-interpreter:latest` from CODE_INTERPRETER_RECIPE (on python:3.11, built first if
    missing; needs the network for apt and PyPI). Cached: a second call rebuilds nothing."""
    from ..envs.builder import Builder
    from ..envs.debian import ensure_python_base
    from ..envs.recipe import parse_recipe

    ensure_python_base(host, log=log)
    recipe = parse_recipe(CODE_INTERPRETER_RECIPE, INTERPRETER_DIR, name="code-interpreter")
    return Builder(host, on_output=log).build(recipe, CODE_INTERPRETER_IMAGE).image
