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


def _native():
    spec = importlib.util.spec_from_file_location("_shoal_native_build", NATIVE)
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


class BinaryDistribution(Distribution):
    """The wheel holds a compiled program: tag it for the platform, not py3-none-any."""

    def has_ext_modules(self) -> bool:
        return True


setup(cmdclass={"build_py": BuildPyWithHelper}, distclass=BinaryDistribution)
