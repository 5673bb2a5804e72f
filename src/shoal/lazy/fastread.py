"""The lazy daemon's C fast path for warm reads (native/fastread.c), loaded with ctypes.

A FUSE READ whose chunks the daemon has already verified is answered in C by the worker thread that
read it (pread from the chunk files, one write to /dev/fuse), without the GIL and without Python per
request; everything else goes to the Python server as before. Like shoal-init, the library is built
at install time (`make setup`: `python -m shoal.lazy.fastread build`) and named after the hash of
its source; a daemon that finds none current serves every read in Python (`SHOAL_LAZY_FAST=0` forces
that). This module imports only the standard library at the top, so setup.py can load it by path.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

SOURCE = Path(__file__).parent / "native" / "fastread.c"
BUILD_DIR = SOURCE.parent / "build"
CFLAGS = ("-O2", "-Wall", "-shared", "-fPIC")


def library_name(source: Path = SOURCE) -> str:
    return "libshoal-fastread-" + hashlib.sha256(source.read_bytes()).hexdigest()[:12] + ".so"


def build(dest_dir: Path = BUILD_DIR, source: Path = SOURCE, *, force: bool = False) -> Path:
    """Compile the library into dest_dir (kept when current unless `force`); RuntimeError on failure."""
    lib = Path(dest_dir) / library_name(source)
    if lib.is_file() and not force:
        return lib
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("building the lazy fast path needs a C compiler (Debian: apt-get install gcc libc6-dev)")
    lib.parent.mkdir(parents=True, exist_ok=True)
    tmp = lib.with_name(f".{lib.name}.{os.getpid()}")
    proc = subprocess.run([cc, *CFLAGS, "-o", str(tmp), str(source)], capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"compiling {source} failed:\n{proc.stderr.strip()[-4000:]}")
    os.replace(tmp, lib)
    return lib


class FastPath:
    """The loaded library: nodes (files) and their registered chunk descriptors, and the serve loop."""

    def __init__(self, lib: ctypes.CDLL, max_read: int):
        self.lib = lib
        p = ctypes.c_void_p
        lib.lazy_fast_new.argtypes = [ctypes.c_size_t]
        lib.lazy_fast_new.restype = p
        lib.lazy_fast_node.argtypes = [p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64]
        lib.lazy_fast_chunk.argtypes = [p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_int]
        lib.lazy_fast_serve.argtypes = [p, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
        lib.lazy_fast_serve.restype = ctypes.c_ssize_t
        lib.lazy_fast_reads.argtypes = [p]
        lib.lazy_fast_reads.restype = ctypes.c_uint64
        lib.lazy_fast_hints.argtypes = [p, ctypes.c_int]
        self.table = lib.lazy_fast_new(max_read)  # per server; never freed (see fastread.c)
        if not self.table:
            raise MemoryError("lazy fast path table")
        # read-ahead hints on the chunk files (on by default; SHOAL_LAZY_FAST_HINTS=0: off, for A/B)
        lib.lazy_fast_hints(self.table, 0 if os.environ.get("SHOAL_LAZY_FAST_HINTS") == "0" else 1)

    def node(self, ino: int, size: int, chunk_size: int) -> None:
        self.lib.lazy_fast_node(self.table, ino, size, chunk_size)

    def chunk(self, ino: int, idx: int, fd: int) -> bool:
        """Register chunk `idx` of `ino` as readable through `fd` (kept open by the caller for the
        daemon's life). False when it was registered already."""
        return int(self.lib.lazy_fast_chunk(self.table, ino, idx, fd)) == 1

    def serve(self, dev: int, buf: ctypes.Array) -> int:
        """Answer cached READs in C until a request needs Python: its length (in `buf`), or -errno."""
        return int(self.lib.lazy_fast_serve(self.table, dev, ctypes.addressof(buf), len(buf)))

    def reads(self) -> int:
        return int(self.lib.lazy_fast_reads(self.table))


def load(max_read: int, build_dir: Path = BUILD_DIR) -> FastPath | None:
    """A fast path (one per FUSE server), or None (not built for this source, or SHOAL_LAZY_FAST=0)."""
    if os.environ.get("SHOAL_LAZY_FAST", "1") == "0":
        return None
    lib = Path(build_dir) / library_name()
    if not lib.is_file():
        return None
    return FastPath(ctypes.CDLL(str(lib)), max_read)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] != ["build"]:
        print("usage: python -m shoal.lazy.fastread build", file=sys.stderr)
        return 2
    print(build(force="--force" in args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
