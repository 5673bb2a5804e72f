"""A pre-imported parent for lazy daemons: one per host (and per version of the code), forking a
root's daemon on request instead of starting a new Python process for it.

Why: a lazy daemon started as `python -m shoal.lazy.daemon` spends ~0.2 s (more under load) on
interpreter start and imports (httpx, the layer store, the registry client) before it serves, and
that start sits on the cold path of the first lazy sandbox of every root, on the same CPUs as the
pull. The zygote imports all of that once; a fork of it serves a new root within milliseconds. The
forked child is an ordinary per-root daemon (own pid, own log, exits when its mount goes away), so
nothing about a daemon's life, faults or `shoal gc` changes.

- Listens on `<SHOAL_LAZY_ZYGOTE_DIR or /run/shoal/lazy>/zygote-<version>.sock` (directory 0700,
  peers must be root). `<version>` hashes the interpreter, the source directory, the mtimes of
  shoal's modules and the caller's mount and network namespaces: a changed checkout or another
  worktree gets its own zygote, never stale code, and a daemon always mounts and fetches where its
  requester would have.
- A request is one JSON line `{"root": ..., "env": {...}}`: the child takes the requester's
  environment (daemon settings, registry credentials named by origin specs) before it runs.
- Single-threaded (forking a threaded process is unsafe); exits after `IDLE_S` without a request.
- `SHOAL_LAZY_ZYGOTE=0` turns it off (every daemon is then its own process, as before).
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
from pathlib import Path

IDLE_S = 900.0
_PKG = Path(__file__).resolve().parents[1]  # src/shoal
_version_cache: str | None = None


def enabled() -> bool:
    return os.environ.get("SHOAL_LAZY_ZYGOTE", "1") != "0" and os.geteuid() == 0


def _namespaces() -> str:
    """The mount and network namespaces of this process: a daemon must mount where its requester
    looks and reach the origin the requester reaches (a fleet host in its own namespaces gets its
    own zygote, started from inside them)."""
    out = []
    for ns in ("mnt", "net"):
        try:
            out.append(os.readlink(f"/proc/self/ns/{ns}"))
        except OSError:
            out.append(f"{ns}:?")
    return ",".join(out)


def _version() -> str:
    global _version_cache
    if _version_cache is None:
        h = hashlib.sha256(f"{sys.executable}\0{_PKG}\0{_namespaces()}\0".encode())
        for p in sorted(_PKG.rglob("*.py")):
            try:
                h.update(f"{p}\0{p.stat().st_mtime_ns}\0".encode())
            except OSError:
                pass
        _version_cache = h.hexdigest()[:16]
    return _version_cache


def socket_path() -> Path:
    d = Path(os.environ.get("SHOAL_LAZY_ZYGOTE_DIR", "/run/shoal/lazy"))
    return d / f"zygote-{_version()}.sock"


def request(root: Path, timeout_s: float = 5.0) -> int | None:
    """Ask the host's zygote to fork a daemon for `root`: its pid; 0 when the request went out but
    no answer came (the fork may still happen: the caller waits for the daemon, it must not start a
    second one); None when no zygote took the request (the caller starts the daemon itself)."""
    if not enabled():
        return None
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    s.settimeout(timeout_s)
    try:
        try:
            s.connect(str(socket_path()))
            s.sendall(json.dumps({"root": str(Path(root).absolute()), "env": dict(os.environ)}).encode() + b"\n")
        except OSError:
            return None
        try:
            return max(0, int(json.loads(s.makefile("rb").readline())["pid"]))
        except (OSError, ValueError, KeyError, TypeError):
            return 0
    finally:
        s.close()


def spawn() -> None:
    """Start the host's zygote in the background (detached; it exits when idle). A second one started
    at the same time loses the bind and exits."""
    if not enabled():
        return
    src = str(_PKG.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)}
    subprocess.Popen([sys.executable, "-m", "shoal.lazy.zygote"], stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True,
                     close_fds=True, cwd="/")


def _serve_child(conn: socket.socket, listener: socket.socket, req: dict) -> None:
    """In the forked child: become the root's daemon (never returns)."""
    code = 1
    try:
        listener.close()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # until the daemon sets its own
        root = Path(req["root"])
        os.environ.clear()
        os.environ.update({str(k): str(v) for k, v in dict(req.get("env") or {}).items()})
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()
        from .mount import state_dir

        log = os.open(state_dir(root) / "daemon.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(null)
        os.close(log)
        conn.sendall(json.dumps({"pid": os.getpid()}).encode() + b"\n")
        conn.close()
        from . import daemon

        code = daemon.main(["--root", str(root), "--foreground"])
    except BaseException as e:  # noqa: BLE001  the child must never return into the zygote's loop
        try:
            sys.stderr.write(f"lazy daemon (zygote child): {e!r}\n")
        except Exception:  # noqa: BLE001
            pass
    finally:
        os._exit(code)


def main() -> int:
    # everything a daemon needs, imported once here (the point of the zygote)
    from .. import registry  # noqa: F401  registers the "registry" origin kind
    from ..registry import origin  # noqa: F401
    from . import daemon  # noqa: F401

    path = socket_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    lst.bind(str(tmp))
    try:  # the first zygote of a version wins; a racing second one exits
        os.link(tmp, path)
    except FileExistsError:
        try:  # a dead zygote's socket: take it over
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            probe.connect(str(path))
            probe.close()
            tmp.unlink(missing_ok=True)
            return 0
        except OSError:
            os.replace(tmp, path)
    tmp.unlink(missing_ok=True)
    ino = os.stat(path).st_ino
    lst.listen(64)
    lst.settimeout(IDLE_S)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # through `finally`: the socket goes too
    try:
        while True:
            try:
                conn, _ = lst.accept()
            except TimeoutError:
                return 0
            except InterruptedError:
                continue
            try:
                conn.settimeout(5.0)
                pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
                if uid != os.geteuid():
                    conn.close()
                    continue
                req = json.loads(conn.makefile("rb").readline())
                if not isinstance(req, dict) or not isinstance(req.get("root"), str):
                    conn.close()
                    continue
            except (OSError, ValueError):
                conn.close()
                continue
            if os.fork() == 0:
                _serve_child(conn, lst, req)
            conn.close()
    finally:
        try:  # only our own socket (a successor may have replaced it)
            if os.stat(path).st_ino == ino:
                path.unlink()
        except OSError:
            pass
        lst.close()


if __name__ == "__main__":
    sys.exit(main())
