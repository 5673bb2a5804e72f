"""`python -m shoal.server.ensure`: make sure this host's shoald answers, starting it if none does.

Used by `make demo` (as root): the daemon is started detached (its own session, output to
<root>/shoald.log) and outlives the command; clients in the `shoal` group then need no root.
Exit status 0 once /v1/health answers on the socket, 1 if it did not within the wait."""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..config import DEFAULT_SOCKET, load_settings
from ..core.contract import API_PREFIX


def answering(sock: Path, timeout: float = 2.0) -> bool:
    """Whether a shoald answers /v1/health on `sock` (a bare HTTP/1.0 request: no client library)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(str(sock))
            s.sendall(f"GET {API_PREFIX}/health HTTP/1.0\r\nHost: shoald\r\n\r\n".encode())
            return s.recv(64).split(b" ", 2)[1:2] == [b"200"]
    except (OSError, IndexError):
        return False


@contextmanager
def serving(root: str | os.PathLike, sock: Path, log: Path, wait: float = 60.0) -> Iterator[str]:
    """A shoald of its own for `root` on `sock` while the block runs (the SWE demo's workers are its
    clients); yields its URL, stops it after."""
    env = dict(os.environ, SHOAL_ROOT=str(root))
    env.pop("SHOAL_URL", None)
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "shoal.cli", "serve", "--socket", str(sock)], env=env,
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + wait
        while not answering(sock):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"shoald did not come up on {sock}; see {log}")
            time.sleep(0.1)
        yield f"unix://{sock}"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--socket", type=Path, default=Path(os.environ.get("SHOAL_SOCKET") or DEFAULT_SOCKET))
    ap.add_argument("--root", default=None)
    ap.add_argument("--wait", type=float, default=60.0, help="seconds to wait for it to answer")
    args = ap.parse_args(argv)
    if answering(args.socket):
        print(f"shoald already answers on {args.socket}")
        return 0
    if os.geteuid() != 0:
        print(f"no shoald answers on {args.socket}; start it as root: sudo shoal serve", file=sys.stderr)
        return 1
    root = load_settings(args.root).root
    root.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, SHOAL_ROOT=str(root))
    env.pop("SHOAL_URL", None)
    with open(root / "shoald.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "shoal.cli", "serve", "--socket", str(args.socket)], env=env,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + args.wait
    while time.monotonic() < deadline:
        if answering(args.socket):
            print(f"shoald started (pid {proc.pid}) on {args.socket}, root {root}; log {root / 'shoald.log'}")
            return 0
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    print(f"shoald did not come up on {args.socket}; see {root / 'shoald.log'}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
