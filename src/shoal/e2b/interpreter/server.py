"""The code interpreter's execute server, run inside a `code-interpreter` sandbox (port 49999).

It speaks what `e2b-code-interpreter`'s `Sandbox.run_code()` and its context calls expect, and drives
IPython kernels through jupyter_client directly (no Jupyter server):

- `POST /execute` {code, context_id, language, env_vars} answers a stream of JSON lines: `stdout` and
  `stderr` ({text, timestamp in ns}), `result` (one per display or the cell's value: text, html,
  markdown, svg, png, jpeg, pdf, latex, json, javascript; `is_main_result` for the value),
  `error` ({name, value, traceback}), `number_of_executions` ({execution_count}), `end_of_execution`.
- `POST /contexts` {language, cwd} -> {id, language, cwd}; `GET /contexts`; `DELETE /contexts/{id}`;
  `POST /contexts/{id}/restart`. Each context is its own kernel; the default one starts with the server.

Standard library + jupyter_client only (what the image installs): it is not imported by Shoal itself.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import re
import select
import socket
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

PORT = 49999
LANGUAGES = ("python",)
# Jupyter MIME types -> the result fields the SDK reads
MIME = {"text/plain": "text", "text/html": "html", "text/markdown": "markdown", "image/svg+xml": "svg",
        "image/png": "png", "image/jpeg": "jpeg", "application/pdf": "pdf", "text/latex": "latex",
        "application/json": "json", "application/javascript": "javascript"}
MAX_BODY = 16 << 20


class Kernel:
    """One context: an IPython kernel and the client that talks to it. One execution at a time."""

    def __init__(self, language: str, cwd: str, context_id: str | None = None):
        self.id = context_id or str(uuid.uuid4())
        self.language, self.cwd = language, cwd
        self.lock = threading.Lock()
        self.ready = threading.Event()
        self.failed: str | None = None
        self.km: Any = None
        self.kc: Any = None

    def start(self) -> None:
        from jupyter_client.manager import KernelManager

        try:
            self.km = KernelManager(kernel_name="python3")
            self.km.start_kernel(cwd=self.cwd)
            self.kc = self.km.client()
            self.kc.start_channels()
            self.kc.wait_for_ready(timeout=120)
        except Exception as e:  # reported to every request for this context
            self.failed = f"{type(e).__name__}: {e}"
        finally:
            self.ready.set()

    def wait_ready(self) -> None:
        self.ready.wait(180)
        if self.failed or self.kc is None:
            raise RuntimeError(f"the kernel did not start: {self.failed or 'timed out'}")

    def json(self) -> dict[str, str]:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    def _run_silent(self, code: str) -> None:
        msg_id = self.kc.execute(code, silent=True, store_history=False)
        self._drain(msg_id, None)

    def _drain(self, msg_id: str, emit: Any, gone: Any = None) -> None:
        """Iopub messages of one request until the kernel goes idle; `emit` gets the SDK's lines.
        `gone()` says the client left: the cell is interrupted and the rest of its output dropped."""
        while True:
            try:
                msg = self.kc.get_iopub_msg(timeout=0.2)
            except queue.Empty:
                if gone is not None and emit is not None and gone():
                    self.km.interrupt_kernel()
                    emit = None
                if not self.km.is_alive():
                    if emit is not None:
                        emit({"type": "error", "name": "KernelDied", "value": "the kernel exited", "traceback": ""})
                    return
                continue
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind, c = msg["msg_type"], msg["content"]
            if kind == "status" and c.get("execution_state") == "idle":
                return
            if emit is None:
                continue
            if kind == "stream":
                emit({"type": "stderr" if c.get("name") == "stderr" else "stdout", "text": c.get("text", ""),
                      "timestamp": time.time_ns()})
            elif kind == "execute_input":
                emit({"type": "number_of_executions", "execution_count": c.get("execution_count")})
            elif kind in ("execute_result", "display_data"):
                emit(_result(c.get("data", {}), kind == "execute_result"))
            elif kind == "error":
                emit({"type": "error", "name": c.get("ename", ""), "value": c.get("evalue", ""),
                      "traceback": "\n".join(c.get("traceback", []))})

    def execute(self, code: str, env: dict[str, str] | None, emit: Any, gone: Any = None) -> None:
        self.wait_ready()
        with self.lock:
            if env:  # E2B's env_vars hold for this execution only: set, run, put back
                self._run_silent("import os as __shoal_os\n"
                                 f"__shoal_env_saved = {{k: __shoal_os.environ.get(k) for k in {list(env)!r}}}\n"
                                 f"__shoal_os.environ.update({env!r})\n")
            try:
                msg_id = self.kc.execute(code, store_history=True, allow_stdin=False, stop_on_error=True)
                try:
                    self._drain(msg_id, emit, gone)
                except (BrokenPipeError, ConnectionResetError):  # the client left: stop the cell, wait for idle
                    self.km.interrupt_kernel()
                    self._drain(msg_id, None)
                    raise
            finally:
                if env:
                    self._run_silent("for __k, __v in __shoal_env_saved.items():\n"
                                     "    __shoal_os.environ.pop(__k, None) if __v is None "
                                     "else __shoal_os.environ.__setitem__(__k, __v)\n")

    def restart(self) -> None:
        self.wait_ready()
        with self.lock:
            self.km.restart_kernel(now=True)
            self.kc.wait_for_ready(timeout=120)

    def shutdown(self) -> None:
        try:
            self.wait_ready()
            self.kc.stop_channels()
            self.km.shutdown_kernel(now=True)
        except Exception:
            pass


def _result(data: dict[str, Any], main: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "result", "is_main_result": main}
    extra: dict[str, Any] = {}
    for mime, value in data.items():
        field = MIME.get(mime)
        if field is not None:
            out[field] = value
        elif mime.startswith("application/vnd."):
            extra[mime] = value
    if extra:
        out["extra"] = extra
    return out


class Contexts:
    def __init__(self, cwd: str):
        self.cwd = cwd
        self.lock = threading.Lock()
        self.default = self._start("python", cwd)
        self.by_id: dict[str, Kernel] = {}

    @staticmethod
    def _start(language: str, cwd: str) -> Kernel:
        k = Kernel(language, cwd)
        threading.Thread(target=k.start, daemon=True).start()
        return k

    def create(self, language: str, cwd: str) -> Kernel:
        k = self._start(language, cwd)
        with self.lock:
            self.by_id[k.id] = k
        return k

    def get(self, context_id: str | None) -> Kernel | None:
        if not context_id:
            return self.default
        if context_id == self.default.id:
            return self.default
        with self.lock:
            return self.by_id.get(context_id)

    def remove(self, context_id: str) -> bool:
        with self.lock:
            k = self.by_id.pop(context_id, None)
        if k is None:
            return False
        k.shutdown()
        return True

    def all(self) -> list[Kernel]:
        with self.lock:
            return [self.default, *self.by_id.values()]


CONTEXTS: Contexts


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "shoal-interpreter"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        pass

    def _body(self) -> Any:
        n = int(self.headers.get("Content-Length") or 0)
        if n > MAX_BODY:
            raise ValueError(f"body over {MAX_BODY} bytes")
        raw = self.rfile.read(n) if n else b""
        return json.loads(raw) if raw.strip() else {}

    def _json(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _empty(self, status: int = 204) -> None:
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _error(self, status: int, message: str) -> None:
        self._json(status, {"error": message})

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path in ("/health", "/"):
            self._json(200, {"status": "ok"})
        elif self.path == "/contexts":
            self._json(200, [k.json() for k in CONTEXTS.all()])
        else:
            self._error(404, f"no route {self.path}")

    def do_DELETE(self) -> None:  # noqa: N802
        m = re.fullmatch(r"/contexts/([\w-]+)", self.path)
        if m is None:
            self._error(404, f"no route {self.path}")
        elif CONTEXTS.remove(m.group(1)):
            self._empty()
        else:
            self._error(404, f"context {m.group(1)} not found")

    def do_POST(self) -> None:  # noqa: N802
        try:
            body = self._body()
        except ValueError as e:
            self._error(400, f"bad request body: {e}")
            return
        if self.path == "/execute":
            self._execute(body)
        elif self.path == "/contexts":
            language = body.get("language") or "python"
            if language not in LANGUAGES:
                self._error(400, f"language {language!r} is not supported here (only {', '.join(LANGUAGES)})")
                return
            self._json(200, CONTEXTS.create(language, body.get("cwd") or CONTEXTS.cwd).json())
        elif m := re.fullmatch(r"/contexts/([\w-]+)/restart", self.path):
            k = CONTEXTS.get(m.group(1))
            if k is None:
                self._error(404, f"context {m.group(1)} not found")
                return
            k.restart()
            self._empty()
        else:
            self._error(404, f"no route {self.path}")

    def _execute(self, body: dict[str, Any]) -> None:
        code = body.get("code")
        if not isinstance(code, str):
            self._error(400, "code must be a string")
            return
        language = body.get("language") or "python"
        if body.get("context_id"):
            k = CONTEXTS.get(body["context_id"])
            if k is None:
                self._error(404, f"context {body['context_id']} not found")
                return
        elif language not in LANGUAGES:
            self._error(400, f"language {language!r} is not supported here (only {', '.join(LANGUAGES)})")
            return
        else:
            k = CONTEXTS.default
        env = body.get("env_vars") or None
        if env is not None and not (isinstance(env, dict) and all(isinstance(v, str) for v in env.values())):
            self._error(400, "env_vars must be an object of strings")
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def emit(line: dict[str, Any]) -> None:
            data = json.dumps(line).encode() + b"\n"
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

        def gone() -> bool:
            """The client closed its end (nothing more is read from it during an execution)."""
            try:
                if not select.select([self.connection], [], [], 0)[0]:
                    return False
                return self.connection.recv(1, socket.MSG_PEEK) == b""
            except OSError:
                return True

        try:
            try:
                k.execute(code, env, emit, gone)
            except RuntimeError as e:  # the kernel never started
                emit({"type": "error", "name": "KernelError", "value": str(e), "traceback": ""})
            emit({"type": "end_of_execution"})
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True


def main() -> None:
    global CONTEXTS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=PORT)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--cwd", default=os.environ.get("HOME") or "/")
    a = ap.parse_args()
    server = ThreadingHTTPServer((a.host, a.port), Handler)  # listening before the kernel is up
    server.daemon_threads = True
    CONTEXTS = Contexts(a.cwd)
    print(f"execute server on {a.host}:{a.port}", file=sys.stderr, flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
