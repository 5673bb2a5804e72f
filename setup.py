"""Install-time build of the container backend's C helper (shoal-init); everything else is in pyproject.toml.

`build_py` compiles native/shoal_init.c into the package (native/build/shoal-init-<source hash>), so
a wheel carries a ready binary and no running program ever needs a compiler. The compile itself is
`shoal.backends.container.native.build`, loaded here by file path (the package's dependencies may
not be installed yet), the same function `make setup` runs for the editable dev install.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
NATIVE = HERE / "src" / "shoal" / "backends" / "container" / "native.py"
FASTREAD = HERE / "src" / "shoal" / "lazy" / "fastread.py"


def _native(path: Path = NATIVE):
    spec = importlib.util.spec_from_file_location(f"_shoal_build_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class BuildPyWithHelper(build_py):
    def run(self) -> None:
        super().run()
        native = _native()
        if getattr(self, "editable_mode", False):
            dest = native.PACKAGE_BUILD_DIR  # editable: the package is the source tree
        else:
            dest = Path(self.build_lib) / "shoal" / "backends" / "container" / "native" / "build"
        try:
            exe = native.build(dest)
        except RuntimeError as e:
            if not getattr(self, "editable_mode", False):
                raise
            # `make setup` installs the compiler after the venv and builds it then
            self.warn(f"shoal-init not built: {e}")
            return
        self.announce(f"built {exe}", level=2)
        # the lazy daemon's C fast path (optional: without it warm reads are served in Python)
        fast = _native(FASTREAD)
        fdest = fast.BUILD_DIR if getattr(self, "editable_mode", False) else \
            Path(self.build_lib) / "shoal" / "lazy" / "native" / "build"
        try:
            self.announce(f"built {fast.build(fdest)}", level=2)
        except RuntimeError as e:
            self.warn(f"lazy fast path not built: {e}")


class BinaryDistribution(Distribution):
    """The wheel holds a compiled program: tag it for the platform, not py3-none-any."""

    def has_ext_modules(self) -> bool:
        return True


setup(cmdclass={"build_py": BuildPyWithHelper}, distclass=BinaryDistribution)
