"""E2B templates -> Shoal images, and the recipe of the `base` template.

E2B's `base` is a Debian image whose commands run as `user` (home /home/user) under a login bash, with
sudo, python3, git and curl. BASE_RECIPE builds the same on Shoal's debootstrap'd `debian:bookworm`
(`shoal e2b templates build`); any other template is a name mapped to an image the host already has.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

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

DEFAULT_TEMPLATES: dict[str, str] = {BASE_TEMPLATE: BASE_IMAGE}


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
