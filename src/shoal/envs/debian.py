"""A real Debian base (debootstrap, cached on the host as a layer) and a Python toolchain on top."""
from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from ..core.errors import BuildError
from ..host import Host
from ..layers.store import ImageInfo
from .builder import Builder
from .recipe import parse_recipe

SUITE = "bookworm"
BASE_IMAGE = f"debian:{SUITE}"
PYTHON_IMAGE = "python:3.11"
PYTEST_VERSION = "8.3.4"

PYTHON_RECIPE = f"""
FROM {BASE_IMAGE}
LABEL shoal.role=base
ENV LANG=C.UTF-8 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PYTHONDONTWRITEBYTECODE=1
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \\
    python3 python3-pip python3-venv python3-setuptools python3-wheel ca-certificates git patch && \\
    apt-get clean
RUN pip install --break-system-packages pytest=={PYTEST_VERSION} && python3 -m pytest --version
"""


def host_debian_mirror() -> str:
    """The Debian mirror this host's apt uses (deb822 .sources or one-line sources.list)."""
    candidates = sorted(Path("/etc/apt/sources.list.d").glob("*.sources")) + [Path("/etc/apt/sources.list")]
    for path in candidates:
        try:
            text = path.read_text()
        except OSError:
            continue
        for m in re.finditer(r"^URIs:\s*(\S+)", text, re.M):
            if "security" not in m.group(1):
                return m.group(1)
        for m in re.finditer(r"^deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+\S+", text, re.M):
            if "security" not in m.group(1):
                return m.group(1)
    raise BuildError("no Debian mirror found in /etc/apt/sources.list(.d); pass mirror= explicitly")


def ensure_debian_base(host: Host, mirror: str | None = None, log: Callable[[str], None] | None = None) -> ImageInfo:
    """`debian:bookworm`, a minbase debootstrap; built once per host, then served from the layer store."""
    try:
        return host.store.get_image(BASE_IMAGE)
    except Exception:
        pass
    if not shutil.which("debootstrap"):
        raise BuildError("debootstrap not found: apt-get install debootstrap (make demo does it)")
    mirror = mirror or host_debian_mirror()
    with host.store._scratch() as d:
        target = d / "rootfs"
        proc = subprocess.Popen(["debootstrap", "--variant=minbase", SUITE, str(target), mirror],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        tail: list[str] = []
        assert proc.stdout is not None  # stdout=PIPE
        for line in proc.stdout:
            tail = (tail + [line])[-20:]
            if log:
                log(line)
        if proc.wait() != 0:
            raise BuildError(f"debootstrap {SUITE} failed:\n{''.join(tail)}")
        # debootstrap leaves its apt lists and .deb cache behind: not part of the base
        for residue in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for p in (target / residue).glob("*"):
                if p.is_file():
                    p.unlink()
        layer = host.store.build_from_dir(target, source=f"debootstrap --variant=minbase {SUITE}",
                                          name=f"debian-{SUITE}")
    return host.store.create_image(BASE_IMAGE, [layer.digest], config={"env": {"LANG": "C.UTF-8"}, "role": "base"})


def ensure_python_base(host: Host, log: Callable[[str], None] | None = None,
                       on_step=None) -> ImageInfo:
    """`python:3.11`: Python, pip, pytest on the Debian base, built by a recipe (cached)."""
    ensure_debian_base(host, log=log)
    return Builder(host, on_output=log, on_step=on_step).build(parse_recipe(PYTHON_RECIPE), PYTHON_IMAGE).image
