"""shoal-init, the container backend's helper written in C: built at install time, only located at run time.

The binary is named after the hash of its source (`shoal-init-<12 hex>`), so a binary is current
exactly when its name matches the source installed next to it. It is built by:

- the wheel build (setup.py's build_py step puts it in the package's `native/build/`);
- `make setup`, for the editable dev install: `python -m shoal.backends.container.native build`.

A running program never compiles it: `helper_path()` finds it or says which command builds it.
This module imports only the standard library at the top, so setup.py can load it by file path
before the package's dependencies are installed.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

SOURCE = Path(__file__).parent / "native" / "shoal_init.c"
PACKAGE_BUILD_DIR = SOURCE.parent / "build"
BUILD_COMMAND = f"{sys.executable or 'python3'} -m shoal.backends.container.native build"
CFLAGS = ("-O2", "-Wall")
# Linked statically where the libc allows it (Debian's libc6-dev ships libc.a). Every sandbox keeps two
# processes of this binary alive (supervisor and init): dynamically linked, each maps libc and ld.so
# too, so at 10,000 sandboxes the host's libc has some 100,000 mappings in one reverse-map tree, and
# every exec on the host waits on that tree's lock while reclaim walks it (docs/density.md). Static
# also saves ~55 KiB of anonymous memory and ~13 VMAs per process. static-pie keeps ASLR for the code of
# a privileged process; the later entries are fallbacks for toolchains without it, or without libc.a.
LINK_MODES: tuple[tuple[str, ...], ...] = (("-static-pie",), ("-static",), ())


def binary_name(source: Path = SOURCE) -> str:
    """`shoal-init-<first 12 hex of sha256(source, build flags)>`: the name of a binary built from this
    source with these flags (a change of flags renames it, so an old build is never taken as current)."""
    flags = " ".join(CFLAGS + tuple(f for mode in LINK_MODES for f in mode)).encode()
    return "shoal-init-" + hashlib.sha256(source.read_bytes() + b"\0" + flags).hexdigest()[:12]


def build(dest_dir: Path = PACKAGE_BUILD_DIR, source: Path = SOURCE, *, force: bool = False) -> Path:
    """Compile `source` into dest_dir/<binary_name>; a current binary there is kept unless `force`.
    Raises RuntimeError (with the compiler's message) when there is no C compiler or it fails."""
    dest_dir = Path(dest_dir)
    exe = dest_dir / binary_name(source)
    if exe.is_file() and os.access(exe, os.X_OK) and not force:
        return exe
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("building shoal-init needs a C compiler and libc headers "
                           "(Debian: apt-get install gcc libc6-dev)")
    dest_dir.mkdir(parents=True, exist_ok=True)
    tmp = dest_dir / f".{exe.name}.{os.getpid()}"
    for mode in LINK_MODES:  # the first that links; the dynamic last one reports a real compile error
        proc = subprocess.run([cc, *CFLAGS, *mode, "-o", str(tmp), str(source)], capture_output=True, text=True)
        if proc.returncode == 0:
            break
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"compiling {source} failed ({cc} exited with {proc.returncode}):\n"
                           f"{proc.stderr.strip()[-4000:]}")
    if mode != LINK_MODES[0]:
        print(f"note: {exe.name} linked {' '.join(mode) or 'dynamically'}: {cc} could not link "
              f"{' '.join(LINK_MODES[0])} (no static libc?); sandboxes work, but each maps the host's libc",
              file=sys.stderr)
    os.replace(tmp, exe)  # atomic: a concurrent reader sees the old state or the whole binary
    return exe


def helper_path(build_dir: Path | None = None) -> Path:
    """The shoal-init binary built from the installed source: in the package's native/build/, or in
    `build_dir` (the Shoal root's bin/). BackendUnavailable, naming the build command, if absent."""
    from ...core.errors import BackendUnavailable

    name = binary_name()
    dirs = [PACKAGE_BUILD_DIR] + ([Path(build_dir)] if build_dir else [])
    for d in dirs:
        exe = d / name
        if exe.is_file() and os.access(exe, os.X_OK):
            return exe
    stale = sorted(p.name for d in dirs if d.is_dir() for p in d.glob("shoal-init-*"))
    why = (f"only binaries of other source versions were found ({', '.join(stale)})" if stale
           else "it has not been built")
    raise BackendUnavailable(f"the container backend's helper {name} is missing from {' and '.join(map(str, dirs))}: "
                             f"{why}. Build it with `{BUILD_COMMAND}` (`make setup` does).")


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m shoal.backends.container.native",
                                 description="Build shoal-init from its C source (install-time step).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="compile it (kept if already current)")
    b.add_argument("--out", type=Path, default=PACKAGE_BUILD_DIR, help=f"directory (default {PACKAGE_BUILD_DIR})")
    b.add_argument("--force", action="store_true", help="compile even if a current binary exists")
    sub.add_parser("path", help="print the current binary's path, or fail if it is not built")
    a = ap.parse_args(argv)
    if a.cmd == "build":
        try:
            print(build(a.out, force=a.force))
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
    try:
        print(helper_path())
    except Exception as e:  # BackendUnavailable: say it, exit non-zero
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
