"""Locating (and if needed compiling) the shoal-init helper written in C."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from ...core.errors import BackendUnavailable

SOURCE = Path(__file__).parent / "native" / "shoal_init.c"


def helper_path(build_dir: Path | None = None) -> Path:
    """Path of a shoal-init binary built from the current source (compiled on first use)."""
    src = SOURCE.read_bytes()
    tag = hashlib.sha256(src).hexdigest()[:12]
    candidates = [Path(__file__).parent / "native" / "build"]
    if build_dir:
        candidates.append(build_dir)
    for d in candidates:
        exe = d / f"shoal-init-{tag}"
        if exe.exists():
            return exe
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise BackendUnavailable("the container backend needs a C compiler (gcc) to build shoal-init")
    last_err = ""
    for d in candidates:
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        exe = d / f"shoal-init-{tag}"
        tmp = d / f".shoal-init-{tag}.{os.getpid()}"
        proc = subprocess.run([cc, "-O2", "-Wall", "-o", str(tmp), str(SOURCE)], capture_output=True, text=True)
        if proc.returncode == 0:
            os.replace(tmp, exe)
            return exe
        last_err = proc.stderr
    raise BackendUnavailable(f"could not compile shoal-init: {last_err.strip()[:2000]}")
