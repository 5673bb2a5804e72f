"""`HttpBackend`: every contract method is one request to shoald, with the contract's own models as
bodies and replies; error bodies come back as the same exception classes (`from_wire`), and a daemon
that cannot be reached is a retryable `SandboxError`."""
from __future__ import annotations

import builtins
import json
import os
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import httpx
from pydantic import BaseModel, TypeAdapter

from ...config import DEFAULT_SOCKET
from ...core import errors as E
from ...core.contract import (
    API_PREFIX,
    DEFAULT_DOWNLOAD_MAX,
    DEFAULT_READ_MAX,
    PORT_CONNECT_TIMEOUT,
    BranchReply,
    BranchRequest,
    CreateRequest,
    Cursor,
    ExecRequest,
    ExecResult,
    FileEntry,
    ForkReply,
    ForkRequest,
    ImageSummary,
    NetworkPolicy,
    NetworkRequest,
    OutputCallback,
    PortSocket,
    ProcessHandle,
    ProcessInfo,
    ProcessOutput,
    ReclaimRequest,
    ReclaimResult,
    SandboxBackend,
    SandboxInfo,
    SessionHandle,
    SessionInfo,
    SessionRequest,
    SessionRunRequest,
    SnapshotInfo,
    SnapshotRequest,
    StartRequest,
    TimeoutRequest,
    WatchHandle,
    check_port,
)

if TYPE_CHECKING:
    from ...desktop.actions import ActionResult, DesktopAction

DEFAULT_TIMEOUT = 120.0  # seconds for a request that does not wait on a command
COMMAND_SLACK = 30.0  # a request that waits on a command may take its timeout plus this
WAIT_SLICE = 60.0  # a background wait() is a series of server-side waits of at most this long

FileEntries = list[FileEntry]  # an alias: inside the class, `list` is the contract's method
_SANDBOXES = TypeAdapter(list[SandboxInfo])
_ENTRIES = TypeAdapter(FileEntries)
ImageSummaries = list[ImageSummary]
_IMAGES = TypeAdapter(ImageSummaries)


def default_url() -> str:
    """$SHOAL_URL, else this host's daemon socket."""
    return os.environ.get("SHOAL_URL") or f"unix://{DEFAULT_SOCKET}"


def dead_peer_options(dead_peer_s: float) -> list[tuple[int, int, int]]:
    """Socket options that fail a connection whose peer stops acknowledging after about
    `dead_peer_s` (TCP_USER_TIMEOUT, with keepalive probes to match while idle)."""
    idle = max(1, int(dead_peer_s / 2))
    return [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1), (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle),
            (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1), (socket.IPPROTO_TCP, socket.TCP_KEEPCNT, idle),
            (socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(dead_peer_s * 1000))]


def _command_timeout(timeout: float | None) -> float | None:
    return None if timeout is None else timeout + COMMAND_SLACK


class HttpBackend(SandboxBackend):
    name = "http"

    def __init__(self, url: str | None = None, api_key: str | None = None, *,
                 ssl_context: ssl.SSLContext | None = None, dead_peer_s: float | None = None):
        """`url`: one daemon, or several equivalent ones (a fleet's gateway replicas) separated by
        commas: a request that could not reach one is sent to the next when that is safe (nothing
        was sent, or the request is idempotent). `ssl_context`: TLS settings for https URLs (a
        client certificate, a private CA); default $SHOAL_CA_CERT, else the system store.
        `dead_peer_s`: over TCP, give up on a peer that stops acknowledging (cut off, powered off)
        after about this long, instead of waiting for the request's timeout: connects time out
        after it, and the socket has TCP_USER_TIMEOUT and keepalive probes to match."""
        self.url = url = url or default_url()
        self.api_key = api_key if api_key is not None else os.environ.get("SHOAL_API_KEY")
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        urls = [u.strip() for u in url.split(",") if u.strip()] if "," in url else [url]
        self._clients = [self._client(u, headers, ssl_context, dead_peer_s) for u in urls]
        self._urls = urls
        self._tls = ssl_context
        self._current = 0
        self.http = self._clients[0]

    @staticmethod
    def _client(url: str, headers: dict[str, str], ssl_context: ssl.SSLContext | None,
                dead_peer_s: float | None = None) -> httpx.Client:
        if url.startswith("unix://"):
            path = url[len("unix://"):]
            try:
                os.stat(path)
            except PermissionError:
                raise E.BackendUnavailable(f"cannot reach shoald's socket {path}: permission denied; join the "
                                           "`shoal` group (sudo usermod -aG shoal $USER, then log in again)") from None
            except OSError:
                raise E.BackendUnavailable(f"no shoald socket at {path}: start the daemon (`sudo shoal serve`), "
                                           "or point $SHOAL_URL at one") from None
            return httpx.Client(transport=httpx.HTTPTransport(uds=path), base_url="http://shoald",
                                headers=headers, timeout=DEFAULT_TIMEOUT)
        if url.startswith(("http://", "https://")):
            verify: Any = ssl_context
            if verify is None:
                ca = os.environ.get("SHOAL_CA_CERT")  # a private CA (self-signed daemons); else the system store
                verify = ssl.create_default_context(cafile=ca) if ca else True
            if dead_peer_s is None:
                return httpx.Client(base_url=url, headers=headers, timeout=DEFAULT_TIMEOUT, verify=verify)
            opts = dead_peer_options(dead_peer_s)
            return httpx.Client(base_url=url, headers=headers, verify=verify,
                                timeout=httpx.Timeout(DEFAULT_TIMEOUT, connect=dead_peer_s),
                                transport=httpx.HTTPTransport(verify=verify, socket_options=opts))
        raise E.InvalidArgument(f"unsupported shoald URL {url!r}: use unix:///path or http(s)://host:port")

    def __repr__(self) -> str:
        return f"HttpBackend({self.url})"

    # ---------------------------------------------------------------- requests
    @staticmethod
    def raise_for(resp: httpx.Response) -> None:
        """The daemon's error body as the exception class it names."""
        if resp.status_code < 400:
            return
        try:
            err = resp.json()["error"]
        except (ValueError, KeyError, TypeError):
            err = None
        if not isinstance(err, dict):
            raise E.ShoalError(f"HTTP {resp.status_code} from shoald: {resp.text[:500]}")
        raise E.from_wire(err, f"HTTP {resp.status_code}")

    def _unreachable(self, e: Exception) -> E.SandboxError:
        err = E.SandboxError(f"shoald at {self.url} is unreachable: {e}")
        err.retryable = True
        return err

    def _attempts(self) -> Iterator[tuple[int, httpx.Client]]:
        """The clients to try, the last one that answered first."""
        n = len(self._clients)
        for i in range(n):
            k = (self._current + i) % n
            yield k, self._clients[k]

    def _answered(self, k: int) -> None:
        if k != self._current:
            self._current, self.http = k, self._clients[k]

    @staticmethod
    def _timeout(client: httpx.Client, seconds: float | None) -> httpx.Timeout:
        """A request's own timeout, keeping the client's connect timeout."""
        return httpx.Timeout(seconds, connect=client.timeout.connect)

    @staticmethod
    def _safe_to_resend(e: httpx.TransportError, method: str, headers: dict[str, str]) -> bool:
        """Whether a request that failed in transport may go to another replica: nothing was sent
        (no connection), or sending it twice does no harm (idempotent methods, keyed creates)."""
        return isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)) or method in ("GET", "HEAD", "PUT", "DELETE") \
            or any(k.lower() == "idempotency-key" for k in headers)

    def call(self, method: str, path: str, *, body: BaseModel | None = None,
             timeout: float | None = DEFAULT_TIMEOUT, **kw: Any) -> httpx.Response:
        """One request under API_PREFIX (`path` is the rest); raises the daemon's error, if any."""
        if body is not None:
            kw["content"] = body.model_dump_json()
            kw["headers"] = {**kw.get("headers", {}), "content-type": "application/json"}
        failure: httpx.TransportError | None = None
        for k, client in self._attempts():
            try:
                resp = client.request(method, API_PREFIX + path, timeout=self._timeout(client, timeout), **kw)
            except httpx.TransportError as e:
                failure = e
                if len(self._clients) > 1 and self._safe_to_resend(e, method, kw.get("headers", {})):
                    continue
                break
            self._answered(k)
            self.raise_for(resp)
            return resp
        assert failure is not None
        raise self._unreachable(failure) from failure

    def json(self, method: str, path: str, **kw: Any) -> Any:
        r = self.call(method, path, **kw)
        return r.json() if r.content else None

    @staticmethod
    def _sb(sandbox_id: str) -> str:
        if not isinstance(sandbox_id, str) or not sandbox_id:
            raise E.SandboxNotFound(f"invalid sandbox id {sandbox_id!r}")
        return "/sandboxes/" + quote(sandbox_id, safe="")

    # ---------------------------------------------------------------- lifecycle
    def create(self, req: CreateRequest, idempotency_key: str | None = None) -> SandboxInfo:
        """Every create carries an idempotency key (a fresh one unless given): retried on another
        replica after a cut connection, it answers the sandbox the first attempt made."""
        key = idempotency_key or uuid.uuid4().hex
        return SandboxInfo.model_validate(self.json("POST", "/sandboxes", body=req,
                                                    headers={"idempotency-key": key}))

    def info(self, sandbox_id: str) -> SandboxInfo:
        return SandboxInfo.model_validate(self.json("GET", self._sb(sandbox_id)))

    def list(self) -> list[SandboxInfo]:
        return _SANDBOXES.validate_python(self.json("GET", "/sandboxes"))

    def kill(self, sandbox_id: str) -> None:
        self.call("DELETE", self._sb(sandbox_id))

    def pause(self, sandbox_id: str) -> None:
        self.call("POST", self._sb(sandbox_id) + "/pause")

    def resume(self, sandbox_id: str) -> None:
        self.call("POST", self._sb(sandbox_id) + "/resume")

    def set_ttl(self, sandbox_id: str, req: TimeoutRequest) -> SandboxInfo:
        return SandboxInfo.model_validate(self.json("PUT", self._sb(sandbox_id) + "/timeout", body=req))

    def reclaim(self, sandbox_id: str, req: ReclaimRequest) -> ReclaimResult:
        return ReclaimResult.model_validate(self.json("POST", self._sb(sandbox_id) + "/reclaim", body=req))

    # ---------------------------------------------------------------- commands
    def exec(self, sandbox_id: str, req: ExecRequest, on_stdout: OutputCallback | None = None,
             on_stderr: OutputCallback | None = None) -> ExecResult:
        path, timeout = self._sb(sandbox_id) + "/exec", _command_timeout(req.timeout)
        if not (on_stdout or on_stderr):
            return ExecResult.model_validate(self.json("POST", path, body=req, timeout=timeout))
        result = None
        for event, data in self._events(path, req, timeout):
            if event == "result":
                result = ExecResult.model_validate_json(data)
            elif event == "error":
                raise E.from_wire(json.loads(data), "exec failed")
            elif event == "stdout" and on_stdout:
                on_stdout(json.loads(data))
            elif event == "stderr" and on_stderr:
                on_stderr(json.loads(data))
        if result is None:
            raise E.SandboxError(f"shoald at {self.url} ended the exec stream of {sandbox_id} without a result")
        return result

    def _events(self, path: str, req: ExecRequest, timeout: float | None) -> Iterator[tuple[str, str]]:
        """The Server-Sent Events of a streamed exec: (event, data). Another replica is tried only
        when this one could not be reached at all (an exec is never sent twice)."""
        failure: httpx.TransportError | None = None
        for k, client in self._attempts():
            try:
                with client.stream("POST", API_PREFIX + path, params={"stream": "true"},
                                   content=req.model_dump_json(), headers={"content-type": "application/json"},
                                   timeout=self._timeout(client, timeout)) as resp:
                    self._answered(k)
                    if resp.status_code >= 400:
                        resp.read()
                        self.raise_for(resp)
                    event = "message"
                    for line in resp.iter_lines():
                        if line.startswith("event: "):
                            event = line[7:]
                        elif line.startswith("data: "):
                            yield event, line[6:]
                return
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                failure = e
                continue
            except httpx.TransportError as e:
                raise self._unreachable(e) from e
        assert failure is not None
        raise self._unreachable(failure) from failure

    def start(self, sandbox_id: str, req: StartRequest) -> ProcessHandle:
        info = ProcessInfo.model_validate(self.json("POST", self._sb(sandbox_id) + "/commands", body=req))
        return HttpProcessHandle(self, sandbox_id, info, req.argv)

    def open_session(self, sandbox_id: str, req: SessionRequest) -> SessionHandle:
        info = SessionInfo.model_validate(self.json("POST", self._sb(sandbox_id) + "/sessions", body=req))
        return HttpSessionHandle(self, sandbox_id, info)

    # ---------------------------------------------------------------- desktop
    def desktop_screenshot(self, sandbox_id: str, scale: float | None = None) -> bytes:
        params = {} if scale is None else {"scale": scale}
        return self.call("GET", self._sb(sandbox_id) + "/desktop/screenshot", params=params).content

    def desktop_action(self, sandbox_id: str, action: DesktopAction) -> ActionResult:
        from ...desktop.actions import ActionResult

        return ActionResult.model_validate(self.json("POST", self._sb(sandbox_id) + "/desktop/actions", body=action))

    # ---------------------------------------------------------------- files
    def read_file(self, sandbox_id: str, path: str, max_bytes: int = DEFAULT_READ_MAX) -> bytes:
        return self.call("GET", self._sb(sandbox_id) + "/files", params={"path": path, "max_bytes": max_bytes}).content

    def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> int:
        return self.json("PUT", self._sb(sandbox_id) + "/files", params={"path": path, "mode": mode}, content=data,
                         headers={"content-type": "application/octet-stream"})["bytes"]

    def list_files(self, sandbox_id: str, path: str = "/") -> FileEntries:
        return _ENTRIES.validate_python(self.json("GET", self._sb(sandbox_id) + "/files/list", params={"path": path}))

    def stat_file(self, sandbox_id: str, path: str) -> FileEntry:
        return FileEntry.model_validate(self.json("GET", self._sb(sandbox_id) + "/files/stat", params={"path": path}))

    def mkdir(self, sandbox_id: str, path: str) -> None:
        self.call("POST", self._sb(sandbox_id) + "/files/mkdir", params={"path": path})

    def set_xattrs(self, sandbox_id: str, path: str, attrs: dict[str, str]) -> None:
        self.call("POST", self._sb(sandbox_id) + "/files/xattrs", params={"path": path}, json=attrs)

    def chown(self, sandbox_id: str, path: str, uid: int, gid: int) -> None:
        self.call("POST", self._sb(sandbox_id) + "/files/chown", params={"path": path, "uid": uid, "gid": gid})

    def remove_file(self, sandbox_id: str, path: str) -> None:
        self.call("DELETE", self._sb(sandbox_id) + "/files", params={"path": path})

    def upload_tar(self, sandbox_id: str, dest_dir: str, tar: bytes) -> int:
        return self.json("POST", self._sb(sandbox_id) + "/files/upload", params={"dest": dest_dir}, content=tar,
                         headers={"content-type": "application/x-tar"})["entries"]

    def download_tar(self, sandbox_id: str, path: str, max_bytes: int = DEFAULT_DOWNLOAD_MAX) -> bytes:
        return self.call("GET", self._sb(sandbox_id) + "/files/download",
                         params={"path": path, "max_bytes": max_bytes}).content

    # ---------------------------------------------------------------- snapshots
    def snapshot(self, sandbox_id: str, req: SnapshotRequest) -> SnapshotInfo:
        return SnapshotInfo.model_validate(self.json("POST", self._sb(sandbox_id) + "/snapshot", body=req))

    def fork(self, sandbox_id: str, req: ForkRequest) -> ForkReply:
        return ForkReply.model_validate(self.json("POST", self._sb(sandbox_id) + "/fork", body=req))

    # ---------------------------------------------------------------- episodes (beyond the contract)
    def branch_episode(self, episode: str, req: BranchRequest) -> BranchReply:
        """Branch an episode of shoald's trajectory log at a step (rollout.branch); the reply's
        sandbox is this client's. Unless `req` names them, the branch reattaches through this
        backend's address."""
        if req.address is None:
            req = req.model_copy(update={"address": self.address})
        return BranchReply.model_validate(self.json("POST", "/episodes/" + quote(episode, safe="") + "/branch",
                                                    body=req))

    def episode_tree(self, episode: str) -> dict:
        return self.json("GET", "/episodes/" + quote(episode, safe="") + "/tree")

    # ---------------------------------------------------------------- network
    def connect_port(self, sandbox_id: str, port: int, timeout: float = PORT_CONNECT_TIMEOUT) -> socket.socket:
        """A tunnel through shoald (server/routes/ports.py, client in tunnel.py)."""
        from .tunnel import open_tunnel

        check_port(port)
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        path = f"{API_PREFIX}/sandboxes/{quote(sandbox_id, safe='')}/ports/{port}/connect?timeout={timeout:g}"
        return open_tunnel(self._urls[self._current], path, headers, self._tls, timeout + 30)

    def port_sockets(self, sandbox_id: str, port: int) -> builtins.list[PortSocket]:  # `list` is a method here
        check_port(port)
        return [PortSocket.model_validate(x) for x in self.json("GET", self._sb(sandbox_id) + f"/ports/{port}/sockets")]

    def guard_port(self, sandbox_id: str, port: int) -> None:
        check_port(port)
        self.json("POST", self._sb(sandbox_id) + f"/ports/{port}/guard")

    def port_guarded(self, sandbox_id: str, port: int) -> bool:
        check_port(port)
        return bool(self.json("GET", self._sb(sandbox_id) + f"/ports/{port}/guard")["guarded"])

    def written_under(self, sandbox_id: str, paths: builtins.list[str], limit: int = 20) -> builtins.list[str]:
        return [str(p) for p in self.json("POST", self._sb(sandbox_id) + "/written",
                                          json={"paths": paths, "limit": limit})]

    def get_network(self, sandbox_id: str) -> NetworkPolicy:
        return NetworkPolicy.model_validate(self.json("GET", self._sb(sandbox_id) + "/network"))

    def watch_dir(self, sandbox_id: str, path: str, recursive: bool = False) -> WatchHandle:
        """shoald's NDJSON watch stream (server/routes/watch.py, client in watch.py)."""
        from .watch import open_watch

        return open_watch(self, sandbox_id, path, recursive)

    def set_network(self, sandbox_id: str, req: NetworkRequest) -> NetworkPolicy:
        return NetworkPolicy.model_validate(self.json("PUT", self._sb(sandbox_id) + "/network", body=req))

    # ---------------------------------------------------------------- images
    def images(self) -> ImageSummaries:
        return _IMAGES.validate_python(self.json("GET", "/images"))

    def remove_image(self, ref: str) -> None:
        """Remove one of the caller's images (shoald's DELETE /v1/images/{ref}; shared ones: the admin's
        only). Its layers stay until shoald's gc finds them unused."""
        self.call("DELETE", "/images/" + quote(ref, safe="/:"))

    # ---------------------------------------------------------------- resources
    @property
    def address(self) -> str:
        return self.url

    def close(self) -> None:
        for c in self._clients:
            c.close()


class HttpProcessHandle(ProcessHandle):
    """A background command the daemon keeps under `id`."""

    def __init__(self, backend: HttpBackend, sandbox_id: str, info: ProcessInfo, argv: list[str]):
        self._be, self.sandbox_id = backend, sandbox_id
        self.id, self.pid, self.argv = info.id, info.pid, argv
        self._path = backend._sb(sandbox_id) + "/commands/" + quote(info.id, safe="")

    def __repr__(self) -> str:
        return f"HttpProcessHandle({self.sandbox_id}/{self.id}, {self.argv!r})"

    def output(self, since: Cursor = (0, 0)) -> ProcessOutput:
        return ProcessOutput.model_validate(self._be.json("GET", self._path,
                                                          params={"since_out": since[0], "since_err": since[1]}))

    def wait(self, timeout: float | None = None) -> ExecResult:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:  # server-side waits in slices: no request outlives a proxy's idle timeout
            left = WAIT_SLICE if deadline is None else max(0.001, min(WAIT_SLICE, deadline - time.monotonic()))
            try:
                return ExecResult.model_validate(self._be.json("POST", self._path + "/wait", params={"timeout": left},
                                                               timeout=left + COMMAND_SLACK))
            except E.CommandTimeout:
                if deadline is not None and time.monotonic() >= deadline:
                    raise E.CommandTimeout(f"background command {self.argv!r} in sandbox {self.sandbox_id} "
                                           f"still running after {timeout} s") from None

    def kill(self, signal: int = 9) -> None:
        self._be.call("POST", self._path + "/kill", params={"signal": signal})

    def wait_output(self, since: Cursor, timeout: float) -> ProcessOutput:
        wait = max(0.0, min(timeout, 60.0))  # the daemon waits (long poll): no 5 ms polling over HTTP
        return ProcessOutput.model_validate(self._be.json(
            "GET", self._path, params={"since_out": since[0], "since_err": since[1], "wait": wait},
            timeout=wait + COMMAND_SLACK))

    def write_stdin(self, data: bytes) -> None:
        self._be.call("POST", self._path + "/stdin", content=data, headers={"content-type": "application/octet-stream"})

    def close_stdin(self) -> None:
        self._be.call("POST", self._path + "/stdin/close")

    def resize(self, rows: int, cols: int) -> None:
        self._be.call("POST", self._path + "/resize", params={"rows": rows, "cols": cols})

    def close(self) -> None:
        """Stop tracking (the daemon frees its pipes and buffers); kills the command if still running."""
        try:
            self._be.call("DELETE", self._path)
        except E.SandboxNotFound:  # already forgotten, or the sandbox is gone
            pass


class HttpSessionHandle(SessionHandle):
    def __init__(self, backend: HttpBackend, sandbox_id: str, info: SessionInfo):
        self._be, self.sandbox_id = backend, sandbox_id
        self.id, self.shell = info.id, info.shell
        self.closed = False
        self._path = backend._sb(sandbox_id) + "/sessions/" + quote(info.id, safe="")

    def __repr__(self) -> str:
        return f"HttpSessionHandle({self.sandbox_id}/{self.id}, {self.shell})"

    def run(self, cmd: str, timeout: float | None = 60.0) -> ExecResult:
        if self.closed:
            raise E.SessionClosed(f"session {self.id} in sandbox {self.sandbox_id} is closed")
        req = SessionRunRequest(cmd=cmd, timeout=timeout)
        try:
            return ExecResult.model_validate(self._be.json("POST", self._path + "/run", body=req,
                                                           timeout=_command_timeout(timeout)))
        except E.SessionClosed:
            self.closed = True
            raise

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self._be.call("DELETE", self._path)
        except E.ShoalError:  # the sandbox (and with it the session) may already be gone
            pass


# ------------------------------------------------------------------------------------ shared clients
_clients: dict[tuple[str, str | None, str | None], HttpBackend] = {}
_clients_lock = threading.Lock()


def client_for(url: str | None = None, api_key: str | None = None,
               root: str | os.PathLike | None = None) -> HttpBackend:
    """The shared HttpBackend for (url, key, root): one connection pool each. `url` defaults to
    $SHOAL_URL, else this host's daemon socket; `api_key` to $SHOAL_API_KEY. `root` only keys the
    cache (a daemon serves one root; pick it with the URL)."""
    url = url or default_url()
    key = api_key if api_key is not None else os.environ.get("SHOAL_API_KEY")
    cache_key = (url, key, None if root is None else str(root))
    with _clients_lock:
        client = _clients.get(cache_key)
        if client is None:
            client = _clients[cache_key] = HttpBackend(url, key)
        return client


def close_clients() -> None:
    """Close every shared client (their connections); later client_for() calls make new ones."""
    with _clients_lock:
        clients = list(_clients.values())
        _clients.clear()
    for c in clients:
        c.close()
