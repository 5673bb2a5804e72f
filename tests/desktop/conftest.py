"""Desktop sandboxes: the desktop base + the editor's toolkit layer, built once per test session
(the Builder's cache: a second ensure_desktop builds nothing), and one running desktop per module."""
from __future__ import annotations

import shutil

import pytest

from shoal.envs.desktop import DESKTOP_IMAGE, desktop_layers, ensure_desktop


@pytest.fixture(scope="session")
def desktop_images(host):
    if not shutil.which("debootstrap"):
        pytest.fail("debootstrap is missing: `make test` installs it")
    ensure_desktop(host, apps=("editor",))
    return DESKTOP_IMAGE, desktop_layers(["editor"])


@pytest.fixture(scope="module")
def desk(host, desktop_images):
    """A running desktop sandbox (X, openbox, session bus) with the editor composed in."""
    from shoal.envs.sandboxes import open_sandbox

    image, layers = desktop_images
    sb = open_sandbox(host, image, layers, memory_mb=1024, disk_mb=256)
    sb.desktop.start()
    yield sb
    sb.kill()
