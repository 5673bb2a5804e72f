"""The `shoal` entry point, and the CLI's hot path: `shoal run` / `shoal exec` through a running shoald.

Why a separate, stdlib-only module: a process that starts, runs `true` in a sandbox and exits is
dominated by imports. The full CLI (typer, rich, pydantic, the layer store, the SDK) costs about
200 ms to import; this module imports only `os`, `sys` and the C modules under `socket` and `json`,
and talks to the daemon with a few lines of HTTP/1.1 over its Unix socket (`http.client` alone
costs ~30 ms to import, through the `email` package, so it is not used here; `socket` and `json`
add ~15 ms through `enum` and `re`, and their C parts do the same work).

What runs where (`dispatch`, used by this entry point and by the typer commands alike):
  * `shoal run IMAGE [opts] -- CMD...` and `shoal exec ID [opts] -- CMD...`: if a shoald answers on
    its socket (`$SHOAL_URL` when it is `unix://PATH`, else the host daemon's /run/shoal/shoald.sock),
    the sandbox is created, the command streamed and the sandbox removed through the daemon. The
    daemon serves its own root: `--root` applies to in-process runs only.
  * With `--in-process`, `SHOAL_URL=local`, an http(s) `SHOAL_URL`, or no daemon answering, the
    command goes through the SDK (`run_local`), still without typer and rich: in this process for
    the first two (root only), to the remote daemon for the third, and for the last the SDK says
    clearly that no daemon runs (in-process sandboxes are never a silent fallback).
  * Anything this parser does not take (another command, an unknown option, `--help`, a command
    not after `--`) goes to the full CLI (shoal.cli), whose run/exec call `dispatch` too.

The wire schema has one source of truth, the contract's models (`shoal.core.contract.CreateRequest`,
`ExecRequest`, `ExecResult`): the bodies below are checked against them, and this module's output
against the SDK's, in tests/functional/test_cli.py. Bytes fields (`ExecRequest.stdin`) travel as
pydantic writes them (`ser_json_bytes="base64"`): URL-safe base64 with padding (`-_`, not `+/`);
the daemon accepts either alphabet. The bodies here carry no bytes.
"""
from __future__ import annotations

import os
import sys

from .core.errors import ShoalError  # cheap: the package imports it anyway

TYPE_CHECKING = False  # not typing's: importing typing costs ~5 ms here
if TYPE_CHECKING:
    from typing import Any

try:  # the C halves of `socket` and `json`: the Python wrappers cost ~15 ms of imports (enum, re)
    import _json
    import _socket as socket
except ImportError:  # another Python implementation: the ordinary modules
    import json as _json  # type: ignore[no-redef]  # the same names, the pure-Python modules
    import socket  # type: ignore[no-redef]  # the same names, the pure-Python modules

DEFAULT_SOCKET = "/run/shoal/shoald.sock"  # = shoal.config.DEFAULT_SOCKET (a test keeps them equal)
LOCAL = "local"  # = shoal.backends.LOCAL: SHOAL_URL value for in-process sandboxes
RUN_TIMEOUT_S = 600.0  # `shoal run/exec --timeout` default (same as the typer commands)
HTTP_TIMEOUT_S = 120.0  # create / delete; exec waits for timeout + 30 s


# ------------------------------------------------------------------------------------------ JSON
class _Decoding:
    """What the C scanner reads from json.JSONDecoder (strict, standard hooks)."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = float  # NaN / Infinity, as json.loads


def _no_default(o: object) -> object:
    raise TypeError(f"{type(o).__name__} is not JSON serializable")


if hasattr(_json, "make_scanner") and hasattr(_json, "make_encoder"):
    _scan = _json.make_scanner(_Decoding)  # type: ignore[arg-type]  # duck-typed: reads the attributes
    _encode = _json.make_encoder(None, _no_default, _json.encode_basestring_ascii, None, ": ", ", ",
                                 False, False, True)

    def loads(text: str) -> Any:
        """= json.loads for one JSON value (tests/functional/test_cli.py checks them equal)."""
        text = text.strip()
        try:
            value, end = _scan(text, 0)
        except StopIteration:  # the scanner's way of saying "no JSON value here"
            raise ValueError(f"not JSON: {text[:80]!r}") from None
        if end != len(text):
            raise ValueError(f"extra data after JSON value at {end}")
        return value

    def dumps(obj: object) -> str:
        """= json.dumps(obj) (default separators, ASCII)."""
        return "".join(_encode(obj, 0))
else:  # pragma: no cover - the pure-Python json module was imported instead
    loads, dumps = _json.loads, _json.dumps  # type: ignore[attr-defined]  # the json module, not _json


class Fallback(Exception):
    """This invocation is not for the fast path: hand it to the full CLI."""


class DaemonError(ShoalError):
    """shoald answered with an error (`{"error": {"type", "message"}}`) or went away mid-request;
    `kind` is the daemon's error type (the SDK's exception class name)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


# ------------------------------------------------------------------------------------------ argv
# option name -> (key, kind); kind: "flag", "str", "list", "int", "float"
_RUN_OPTS = {"--layer": ("layers", "list"), "-l": ("layers", "list"), "--memory-mb": ("memory_mb", "int"),
             "--cpu": ("cpu", "float"), "--disk-mb": ("disk_mb", "int"), "--timeout": ("timeout", "float"),
             "--detach": ("detach", "flag"), "-d": ("detach", "flag"), "--ttl": ("ttl", "float"),
             "--root": ("root", "str"), "--in-process": ("in_process", "flag"), "--ksm": ("ksm", "flag"),
             "--no-aslr": ("no_aslr", "flag"), "--priority": ("priority", "str"),
             "--memory-cgroup": ("memory_cgroup", "str")}
_EXEC_OPTS = {"--timeout": ("timeout", "float"), "--root": ("root", "str")}


def parse(argv: list[str]) -> tuple[str, dict]:
    """argv (without the program name) -> (command, options). Raises Fallback for anything the
    full CLI should handle: other commands, unknown options, --help, values that do not parse,
    or a command not separated by `--` (click's rules for those are the full CLI's business)."""
    if not argv or argv[0] not in ("run", "exec"):
        raise Fallback
    command, rest = argv[0], argv[1:]
    table = _RUN_OPTS if command == "run" else _EXEC_OPTS
    opts: dict = {"layers": [], "timeout": RUN_TIMEOUT_S, "detach": False}
    positional: list[str] = []
    i = 0
    while i < len(rest):
        tok = rest[i]
        if tok == "--":
            opts["cmd"] = rest[i + 1:]
            break
        if tok.startswith("-") and tok != "-":
            name, eq, value = tok.partition("=")
            if name not in table:
                raise Fallback
            key, kind = table[name]
            if kind == "flag":
                if eq:
                    raise Fallback
                opts[key] = True
            else:
                if not eq:
                    i += 1
                    if i >= len(rest):
                        raise Fallback
                    value = rest[i]
                try:
                    v: object = int(value) if kind == "int" else float(value) if kind == "float" else value
                except ValueError:
                    raise Fallback from None
                if kind == "list":
                    opts[key].append(v)
                else:
                    opts[key] = v
        else:
            positional.append(tok)
        i += 1
    if len(positional) != 1:
        raise Fallback
    opts["target"] = positional[0]
    opts.setdefault("cmd", [])
    if command == "exec" and not opts["cmd"]:
        raise Fallback  # the full CLI names the error
    return command, opts


def socket_path() -> str | None:
    """The daemon socket to use, or None when $SHOAL_URL asks for something else: `local`
    (in-process) or an http(s) daemon (both the SDK's business)."""
    url = os.environ.get("SHOAL_URL")
    if not url:
        return DEFAULT_SOCKET
    return url[len("unix://"):] if url.startswith("unix://") else None


def create_body(opts: dict) -> dict:
    """POST /v1/sandboxes body (contract model: CreateRequest)."""
    body: dict = {"image": opts["target"]}
    if opts.get("layers"):
        body["layers"] = opts["layers"]
    for key in ("cpu", "memory_mb", "disk_mb", "ttl", "priority", "memory_cgroup"):
        if opts.get(key) is not None:  # 0 too: the daemon names it as out of range, never a silent default
            body[key] = opts[key]
    if opts.get("ksm"):
        body["ksm"] = True
    if opts.get("no_aslr"):
        body["aslr"] = False
    return body


def exec_body(opts: dict) -> dict:
    """POST /v1/sandboxes/{id}/exec body (contract model: ExecRequest)."""
    return {"argv": opts["cmd"] or ["/bin/sh", "-c", "true"], "timeout": opts["timeout"]}


# ------------------------------------------------------------------------------------------ HTTP
class Connection:
    """HTTP/1.1 over a Unix socket, one request at a time, kept alive between requests."""

    def __init__(self, path: str):
        self.path = path
        self.sock: Any = None  # a connected socket.socket (or _socket.socket)
        self.buf = b""
        self.headers = {"host": "shoald", "accept": "application/json"}
        key = os.environ.get("SHOAL_API_KEY")
        if key:
            self.headers["authorization"] = f"Bearer {key}"

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(self.path)
        except OSError:
            s.close()
            raise
        self.sock, self.buf = s, b""

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    # -- reading
    def _fill(self) -> None:
        assert self.sock is not None
        try:
            data = self.sock.recv(65536)
        except OSError as e:  # a timeout, or the daemon went away mid-answer
            self.close()
            raise DaemonError("SandboxError", f"shoald at {self.path} stopped answering: {e}") from None
        if not data:
            raise DaemonError("SandboxError", f"shoald at {self.path} closed the connection")
        self.buf += data

    def _line(self) -> bytes:
        while (i := self.buf.find(b"\r\n")) < 0:
            self._fill()
        line, self.buf = self.buf[:i], self.buf[i + 2:]
        return line

    def _exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        data, self.buf = self.buf[:n], self.buf[n:]
        return data

    def _body(self, headers: dict):
        """Yield the response body in pieces as they arrive (chunked or Content-Length)."""
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int(self._line().split(b";")[0], 16)
                if size == 0:
                    while self._line():  # trailers, then the blank line
                        pass
                    return
                yield self._exact(size)
                self._line()
        else:
            n = int(headers.get("content-length", "0"))
            while n > 0:
                if not self.buf:
                    self._fill()
                piece, self.buf = self.buf[:n], self.buf[n:]
                n -= len(piece)
                yield piece

    # -- a request
    def request(self, method: str, target: str, body: dict | None = None, timeout: float | None = HTTP_TIMEOUT_S):
        """Send a request; returns (status, headers, body iterator). The body must be consumed
        before the next request on this connection."""
        if self.sock is None:
            self.connect()
        assert self.sock is not None
        self.sock.settimeout(timeout)
        payload = dumps(body).encode() if body is not None else b""
        head = f"{method} {target} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in self.headers.items())
        if body is not None:
            head += "content-type: application/json\r\n"
        head += f"content-length: {len(payload)}\r\n\r\n"
        try:
            self.sock.sendall(head.encode() + payload)
            status_line = self._line()
            headers: dict[str, str] = {}
            while line := self._line():
                k, _, v = line.decode("latin-1").partition(":")
                headers[k.strip().lower()] = v.strip()
        except OSError as e:
            self.close()
            raise DaemonError("SandboxError", f"shoald at {self.path} is unreachable: {e}") from None
        status = int(status_line.split()[1])
        return status, headers, self._body(headers)

    def call(self, method: str, target: str, body: dict | None = None, timeout: float | None = HTTP_TIMEOUT_S):
        """A whole request: the JSON answer, or DaemonError with the daemon's error type and message."""
        status, headers, chunks = self.request(method, target, body, timeout)
        data = b"".join(chunks)
        if headers.get("connection", "").lower() == "close":
            self.close()
        if status >= 400:
            raise _error(status, data)
        return loads(data.decode()) if data else None


_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")


def quote(segment: str) -> str:
    """Percent-encode one URL path segment (what urllib.parse.quote(s, safe="") gives, without
    importing it): a sandbox id typed by a user cannot break the request line."""
    return "".join(chr(b) if b in _SAFE else f"%{b:02X}" for b in segment.encode("utf-8", "surrogateescape"))


def _error(status: int, data: bytes) -> DaemonError:
    try:
        err = loads(data.decode(errors="replace"))["error"]
        return DaemonError(err.get("type") or "ShoalError", err.get("message") or f"HTTP {status}")
    except (ValueError, KeyError, TypeError):
        return DaemonError("ShoalError", f"HTTP {status}: {data[:500].decode(errors='replace')}")


def sse_events(chunks):
    """Server-Sent Events from a body iterator: (event, decoded JSON data), in order."""
    pending = b""
    for chunk in chunks:
        pending += chunk
        while (i := pending.find(b"\n\n")) >= 0:
            raw, pending = pending[:i], pending[i + 2:]
            event, data = "message", ""
            for line in raw.decode("utf-8").split("\n"):
                if line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: "):
                    data = line[6:]
            yield event, loads(data) if data else None


def stream_exec(conn: Connection, sandbox_id: str, body: dict, on_stdout, on_stderr) -> dict:
    """POST …/exec?stream=true: output to the callbacks as it comes; returns the result (ExecResult JSON)."""
    timeout = body.get("timeout")
    status, headers, chunks = conn.request("POST", f"/v1/sandboxes/{quote(sandbox_id)}/exec?stream=true", body,
                                           timeout=None if timeout is None else timeout + 30)
    if status >= 400:
        raise _error(status, b"".join(chunks))
    result = None
    for event, data in sse_events(chunks):
        if event == "stdout":
            on_stdout(data)
        elif event == "stderr":
            on_stderr(data)
        elif event == "result":
            result = data
        elif event == "error":
            raise DaemonError(data.get("type", "ShoalError"), data.get("message", "exec failed"))
    if headers.get("connection", "").lower() == "close":
        conn.close()
    if result is None:
        raise DaemonError("SandboxError", "shoald ended the exec stream without a result")
    return result


# ------------------------------------------------------------------------------------------ commands
def _write(stream):
    def out(text: str) -> None:
        stream.write(text)
        stream.flush()
    return out


def run_fast(command: str, opts: dict, conn: Connection) -> int:
    """`shoal run` / `shoal exec` through the daemon; returns the exit status."""
    on_out, on_err = _write(sys.stdout), _write(sys.stderr)
    if command == "exec":
        return stream_exec(conn, opts["target"], exec_body(opts), on_out, on_err)["exit_code"]
    sandbox_id = conn.call("POST", "/v1/sandboxes", create_body(opts))["id"]
    if opts["detach"] and not opts["cmd"]:
        print(sandbox_id)
        return 0
    done = False
    try:
        code = stream_exec(conn, sandbox_id, exec_body(opts), on_out, on_err)["exit_code"]
        done = True
        return code
    finally:
        if opts["detach"]:
            print(sandbox_id)
        else:
            if not done:  # an interrupted stream leaves unread bytes: remove it on a fresh connection
                conn.close()
            conn.call("DELETE", f"/v1/sandboxes/{quote(sandbox_id)}")


def daemon_connection(opts: dict) -> Connection | None:
    """A connection to shoald, or None when none answers (or --in-process)."""
    if opts.get("in_process"):
        return None
    path = socket_path()
    if path is None or not os.path.exists(path):
        return None
    conn = Connection(path)
    try:
        conn.connect()
    except OSError:
        return None  # a stale socket (the daemon is gone), or not ours to reach: the SDK explains
    return conn


def run_local(command: str, opts: dict) -> int:
    """`shoal run` / `shoal exec` in this process, through the SDK (which honours $SHOAL_URL unless
    --in-process); imports the SDK and the host, not typer or rich."""
    from .sdk.sandbox import Sandbox

    on_out, on_err = _write(sys.stdout), _write(sys.stderr)
    root = opts.get("root")
    if command == "exec":
        sb = Sandbox.connect(opts["target"], root=root)
        return sb.commands.run(opts["cmd"], timeout=opts["timeout"], on_stdout=on_out, on_stderr=on_err).exit_code
    sb = Sandbox.create(opts["target"], layers=opts["layers"] or None, memory_mb=opts.get("memory_mb"),
                        cpu=opts.get("cpu"), disk_mb=opts.get("disk_mb"), ttl=opts.get("ttl"), root=root,
                        url=LOCAL if opts.get("in_process") else None, ksm=bool(opts.get("ksm")),
                        aslr=not opts.get("no_aslr"), priority=opts.get("priority") or "normal",
                        memory_cgroup=opts.get("memory_cgroup"))
    if opts["detach"] and not opts["cmd"]:
        print(sb.id)
        return 0
    try:
        return sb.commands.run(opts["cmd"] or ["/bin/sh", "-c", "true"], timeout=opts["timeout"],
                               on_stdout=on_out, on_stderr=on_err).exit_code
    finally:
        if opts["detach"]:
            print(sb.id)
        else:
            sb.kill()


def dispatch(command: str, opts: dict) -> int:
    """Run a parsed `run` / `exec` through the daemon when one answers, else in this process."""
    conn = daemon_connection(opts)
    if conn is None:
        return run_local(command, opts)
    try:
        return run_fast(command, opts, conn)
    finally:
        conn.close()


def try_fast(argv: list[str]) -> int:
    """Run argv (`run` / `exec`) without the full CLI, or raise Fallback when it should handle it."""
    command, opts = parse(argv)
    return dispatch(command, opts)


def _print_error(kind: str, message: str) -> None:
    red = sys.stderr.isatty() and not os.environ.get("NO_COLOR")
    label = "\x1b[31merror:\x1b[0m" if red else "error:"
    sys.stderr.write(f"{label} {message}\n")


def _broken_pipe() -> None:
    """The reader went away (`shoal run … | head`): exit as a process killed by SIGPIPE would,
    without a traceback, and without Python's complaint when it flushes stdout at exit."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except OSError:
        pass
    sys.exit(141)


def main() -> None:
    """Entry point of `shoal`: the fast path when it applies, else the full (typer) CLI."""
    try:
        code = try_fast(sys.argv[1:])
        sys.stdout.flush()
    except Fallback:
        from .cli import main as full_main

        try:
            full_main()
        except BrokenPipeError:
            _broken_pipe()
        return
    except ShoalError as e:  # the daemon's errors (DaemonError) and the in-process path's alike
        _print_error(getattr(e, "kind", type(e).__name__), str(e))
        sys.exit(2)  # as the full CLI does for Shoal's typed errors
    except BrokenPipeError:  # the sandbox is already removed (run_fast's finally)
        _broken_pipe()
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(code)


if __name__ == "__main__":
    main()
