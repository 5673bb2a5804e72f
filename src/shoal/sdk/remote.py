"""The SDK over shoald's HTTP API: `RemoteSandbox` is a `Sandbox` with the same sub-objects and
methods, and the daemon's errors arrive as the same exception classes.

    sb = Sandbox.create("python:3.11", url="unix:///var/lib/shoal/shoald.sock")   # local daemon
    sb = Sandbox.create("python:3.11", url="https://host:8443", api_key="sk-...")  # remote, TLS
    sb = Sandbox.create("python:3.11", url="local")        # the daemon of this host's Shoal root

`SHOAL_URL` / `SHOAL_API_KEY` set the defaults. Without a URL the SDK runs sandboxes in-process.
"""
from __future__ import annotations

import base64
import io
import json
import os
import ssl
import tarfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from ..core import errors as E
from ..core.contract import ExecResult, FileEntry, SandboxInfo, SnapshotInfo
from .sandbox import BackgroundOutput, Cmd, ForkResult, OutputEvent, Sandbox, tar_of

DEFAULT_TIMEOUT = 120.0


class Client:
    """A small HTTP client for shoald; maps error bodies back to Shoal's exception classes."""

    def __init__(self, url: str | None = None, api_key: str | None = None, root: str | os.PathLike | None = None):
        url = url or os.environ.get("SHOAL_URL") or "local"
        self.api_key = api_key or os.environ.get("SHOAL_API_KEY")
        if url == "local":
            from ..config import load_settings

            url = "unix://" + str(load_settings(root).root / "shoald.sock")
        self.url = url
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        if url.startswith("unix://"):
            path = url[len("unix://"):]
            if not Path(path).exists():
                raise E.BackendUnavailable(f"no shoald socket at {path}: start it with `shoal serve`")
            self.http = httpx.Client(transport=httpx.HTTPTransport(uds=path), base_url="http://shoald",
                                     headers=headers, timeout=DEFAULT_TIMEOUT)
        elif url.startswith(("http://", "https://")):
            ca = os.environ.get("SHOAL_CA_CERT")  # a private CA (self-signed daemons); else the system store
            verify: Any = ssl.create_default_context(cafile=ca) if ca else True
            self.http = httpx.Client(base_url=url, headers=headers, timeout=DEFAULT_TIMEOUT, verify=verify)
        else:
            raise E.InvalidArgument(f"unsupported shoald URL {url!r}: use unix:///path, http(s)://host:port or 'local'")

    @staticmethod
    def raise_for(resp: httpx.Response) -> None:
        if resp.status_code < 400:
            return
        try:
            err = resp.json()["error"]
            cls = getattr(E, err.get("type", ""), None)
            if not (isinstance(cls, type) and issubclass(cls, E.ShoalError)):
                cls = E.ShoalError
            msg = err.get("message", resp.text)
        except (ValueError, KeyError, TypeError):
            cls, msg = E.ShoalError, f"HTTP {resp.status_code}: {resp.text[:500]}"
        raise cls(msg)

    def call(self, method: str, path: str, timeout: float | None = None, **kw) -> httpx.Response:
        try:
            resp = self.http.request(method, path, timeout=timeout or DEFAULT_TIMEOUT, **kw)
        except httpx.TransportError as e:
            err = E.SandboxError(f"shoald at {self.url} is unreachable: {e}")
            err.retryable = True
            raise err from e
        self.raise_for(resp)
        return resp

    def json(self, method: str, path: str, **kw) -> Any:
        r = self.call(method, path, **kw)
        return r.json() if r.content else None


class _RemoteHost:
    """Stand-in for Host in SDK objects: only the settings the SDK reads."""

    class settings:  # noqa: N801 - mirrors Host.settings attributes used by the SDK
        output_cap_bytes = 1 << 20
        root = None


# ------------------------------------------------------------------------------------------ commands
class RemoteCommandHandle:
    def __init__(self, sb: "RemoteSandbox", hid: str, pid: int | None, argv: Cmd):
        self._sb, self.id, self.pid, self.argv = sb, hid, pid, argv
        self._started = time.monotonic()
        self._last: dict | None = None

    def _poll(self, since: tuple[int, int] = (0, 0)) -> dict:
        self._last = self._sb._c.json("GET", f"{self._sb._p}/commands/{self.id}",
                                      params={"since_out": since[0], "since_err": since[1]})
        return self._last

    def poll(self) -> int | None:
        return self._poll((1 << 62, 1 << 62))["exit_code"]

    def output(self, since: tuple[int, int] = (0, 0)) -> BackgroundOutput:
        r = self._poll(since)
        return BackgroundOutput(r["stdout"], r["stderr"], tuple(r["cursor"]), r["lost_bytes"])  # type: ignore[arg-type]

    def wait(self, timeout: float | None = None) -> ExecResult:
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.005
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise E.CommandTimeout(f"background command {self.argv!r} still running after {timeout} s")
            time.sleep(delay)
            delay = min(delay * 2, 0.2)
        r = self._poll((0, 0))
        return ExecResult(exit_code=code, stdout=r["stdout"], stderr=r["stderr"], stdout_bytes=r["cursor"][0],
                          stderr_bytes=r["cursor"][1], stdout_truncated=r["lost_bytes"] > 0,
                          duration_s=time.monotonic() - self._started)

    def kill(self, sig: int = 9) -> None:
        self._sb._c.call("POST", f"{self._sb._p}/commands/{self.id}/kill", params={"signal": sig})

    def close(self) -> None:
        """Stop tracking (the daemon frees its pipes and buffers); kills the command if still running."""
        try:
            self._sb._c.call("DELETE", f"{self._sb._p}/commands/{self.id}")
        except E.SandboxNotFound:
            pass


class RemoteCommands:
    def __init__(self, sb: "RemoteSandbox"):
        self._sb = sb

    def _body(self, cmd: Cmd, cwd, env, timeout, stdin, output_cap) -> dict:
        body: dict[str, Any] = {"cmd": cmd, "cwd": cwd, "env": env, "timeout": timeout, "output_cap": output_cap}
        if stdin is not None:
            raw = stdin.encode() if isinstance(stdin, str) else stdin
            body.update(stdin=base64.b64encode(raw).decode(), stdin_base64=True)
        return body

    def run(self, cmd: Cmd, *, cwd: str | None = None, env: dict[str, str] | None = None,
            timeout: float | None = 60.0, stdin: bytes | str | None = None,
            on_stdout: Callable[[str], None] | None = None, on_stderr: Callable[[str], None] | None = None,
            output_cap: int | None = None, check: bool = False, background: bool = False) -> ExecResult:
        if background:
            return self.start(cmd, cwd=cwd, env=env, timeout=timeout)  # type: ignore[return-value]
        if isinstance(cmd, str) and not cmd.strip():
            raise E.InvalidArgument("empty command")
        body = self._body(cmd, cwd, env, timeout, stdin, output_cap)
        http_timeout = None if timeout is None else timeout + 30
        if on_stdout or on_stderr:
            result = None
            for ev in self._events(body, http_timeout):
                if isinstance(ev, ExecResult):
                    result = ev
                elif ev.stream == "stdout" and on_stdout:
                    on_stdout(ev.text)
                elif ev.stream == "stderr" and on_stderr:
                    on_stderr(ev.text)
            assert result is not None
        else:
            result = ExecResult.model_validate(self._sb._c.json("POST", f"{self._sb._p}/exec", json=body,
                                                                timeout=http_timeout))
        if check and result.timed_out:
            raise E.CommandTimeout(f"{cmd!r} timed out after {timeout} s in sandbox {self._sb.id}", result)
        if check and result.exit_code != 0:
            raise E.SandboxError(f"{cmd!r} exited with {result.exit_code} in sandbox {self._sb.id}: "
                                 f"{result.stderr[-500:]}")
        return result

    def _events(self, body: dict, timeout: float | None) -> Iterator[OutputEvent | ExecResult]:
        c = self._sb._c
        with c.http.stream("POST", f"{self._sb._p}/exec", params={"stream": "true"}, json=body,
                           timeout=timeout) as resp:
            if resp.status_code >= 400:
                resp.read()
                c.raise_for(resp)
            event = None
            for line in resp.iter_lines():
                if line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: "):
                    data = line[6:]
                    if event == "result":
                        yield ExecResult.model_validate_json(data)
                    elif event == "error":
                        err = json.loads(data)
                        raise getattr(E, err["type"], E.ShoalError)(err["message"])
                    elif event in ("stdout", "stderr"):
                        yield OutputEvent(event, json.loads(data))

    def stream(self, cmd: Cmd, *, cwd: str | None = None, env: dict[str, str] | None = None,
               timeout: float | None = 60.0, stdin: bytes | str | None = None,
               output_cap: int | None = None) -> Iterator[OutputEvent | ExecResult]:
        yield from self._events(self._body(cmd, cwd, env, timeout, stdin, output_cap),
                                None if timeout is None else timeout + 30)

    def start(self, cmd: Cmd, *, cwd: str | None = None, env: dict[str, str] | None = None,
              timeout: float | None = None, ring_bytes: int = 1 << 20) -> RemoteCommandHandle:
        r = self._sb._c.json("POST", f"{self._sb._p}/commands",
                             json={"cmd": cmd, "cwd": cwd, "env": env, "timeout": timeout})
        return RemoteCommandHandle(self._sb, r["id"], r["pid"], cmd)


# ------------------------------------------------------------------------------------------ sessions
class RemoteSession:
    def __init__(self, sb: "RemoteSandbox", sid: str, shell: str):
        self._sb, self.id, self.shell = sb, sid, shell
        self.closed = False

    def run(self, cmd: str, timeout: float | None = 60.0) -> ExecResult:
        if self.closed:
            raise E.SessionClosed(f"session in sandbox {self._sb.id} is closed")
        try:
            return ExecResult.model_validate(self._sb._c.json(
                "POST", f"{self._sb._p}/sessions/{self.id}/run", json={"cmd": cmd, "timeout": timeout},
                timeout=None if timeout is None else timeout + 30))
        except E.SessionClosed:
            self.closed = True
            raise

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self._sb._c.call("DELETE", f"{self._sb._p}/sessions/{self.id}")
            except E.ShoalError:
                pass

    def __enter__(self) -> "RemoteSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RemoteSessions:
    def __init__(self, sb: "RemoteSandbox"):
        self._sb = sb

    def create(self, shell: str | None = None, cwd: str | None = None, env: dict[str, str] | None = None) -> RemoteSession:
        if shell is not None or env:
            raise E.InvalidArgument("remote sessions use the sandbox's default shell and env")
        r = self._sb._c.json("POST", f"{self._sb._p}/sessions", params={"cwd": cwd} if cwd else None)
        return RemoteSession(self._sb, r["id"], r["shell"])


# ------------------------------------------------------------------------------------------ files
class RemoteFiles:
    def __init__(self, sb: "RemoteSandbox"):
        self._sb = sb

    def read_bytes(self, path: str, max_bytes: int = 64 << 20) -> bytes:
        data = self._sb._c.call("GET", f"{self._sb._p}/files", params={"path": path}).content
        if len(data) > max_bytes:
            raise E.FileOpError(f"read {path!r}: larger than max_bytes={max_bytes}")
        return data

    def read(self, path: str, encoding: str = "utf-8") -> str:
        return self.read_bytes(path).decode(encoding, "replace")

    def write(self, path: str, data: str | bytes, mode: int = 0o644) -> int:
        raw = data.encode() if isinstance(data, str) else data
        return self._sb._c.json("PUT", f"{self._sb._p}/files", params={"path": path, "mode": mode}, content=raw,
                                headers={"content-type": "application/octet-stream"})["bytes"]

    def list(self, path: str = "/") -> list[FileEntry]:
        return [FileEntry.model_validate(x) for x in self._sb._c.json("GET", f"{self._sb._p}/files/list",
                                                                      params={"path": path})]

    def stat(self, path: str) -> FileEntry:
        return FileEntry.model_validate(self._sb._c.json("GET", f"{self._sb._p}/files/stat", params={"path": path}))

    def exists(self, path: str) -> bool:
        try:
            self.stat(path)
            return True
        except E.FileOpError:
            return False

    def mkdir(self, path: str) -> None:
        self._sb._c.call("POST", f"{self._sb._p}/files/mkdir", params={"path": path})

    def remove(self, path: str) -> None:
        self._sb._c.call("DELETE", f"{self._sb._p}/files", params={"path": path})

    def upload(self, dest_dir: str, src: str | os.PathLike | bytes) -> int:
        return self._sb._c.json("POST", f"{self._sb._p}/files/upload", params={"dest": dest_dir}, content=tar_of(src),
                                headers={"content-type": "application/x-tar"})["entries"]

    def download(self, path: str, dest: str | os.PathLike | None = None, max_bytes: int = 1 << 30) -> bytes:
        data = self._sb._c.call("GET", f"{self._sb._p}/files/download", params={"path": path}).content
        if dest is not None:
            with tarfile.open(fileobj=io.BytesIO(data)) as tf:
                tf.extractall(dest, filter="data")
        return data


# ------------------------------------------------------------------------------------------ sandbox
class RemoteSandbox(Sandbox):
    """A sandbox owned by a shoald; same surface as the in-process Sandbox."""

    def __init__(self, client: Client, info: SandboxInfo):  # noqa: D107 - deliberately not calling super
        self._c = client
        self._host = _RemoteHost()
        self._info = info
        self.id = info.id
        self._p = f"/v1/sandboxes/{info.id}"
        self.commands = RemoteCommands(self)  # type: ignore[assignment]
        self.files = RemoteFiles(self)  # type: ignore[assignment]
        self.sessions = RemoteSessions(self)  # type: ignore[assignment]

    @classmethod
    def create_remote(cls, client: Client, **body) -> "RemoteSandbox":
        snap = body.get("from_snapshot")
        if isinstance(snap, SnapshotInfo):
            body["from_snapshot"] = snap.id
        info = SandboxInfo.model_validate(client.json("POST", "/v1/sandboxes", json=body))
        return cls(client, info)

    def info(self) -> SandboxInfo:
        self._info = SandboxInfo.model_validate(self._c.json("GET", self._p))
        return self._info

    def pause(self) -> None:
        self._c.call("POST", f"{self._p}/pause")

    def resume(self) -> None:
        self._c.call("POST", f"{self._p}/resume")

    def set_timeout(self, ttl: float | None = None, idle_ttl: float | None = None) -> None:
        self._info = SandboxInfo.model_validate(self._c.json("PUT", f"{self._p}/timeout",
                                                             json={"ttl": ttl, "idle_ttl": idle_ttl}))

    def kill(self) -> None:
        self._c.call("DELETE", self._p)

    def set_network(self, allow: list[str] | None = None, presets: dict[str, bool] | None = None) -> dict:
        return self._c.json("PUT", f"{self._p}/network", json={"allow": allow, "presets": presets})

    def get_network(self) -> dict:
        return self._c.json("GET", f"{self._p}/network")

    def snapshot(self, exclude: list[str] | None = None) -> SnapshotInfo:
        return SnapshotInfo.model_validate(self._c.json("POST", f"{self._p}/snapshot", json={"exclude": exclude}))

    def fork(self, n: int, *, copy_env: bool = False, inherit_ttl: bool = False,
             exclude: list[str] | None = None, **create_kw) -> ForkResult:
        if create_kw or exclude:
            raise E.InvalidArgument("remote fork takes n, copy_env and inherit_ttl")
        r = self._c.json("POST", f"{self._p}/fork", json={"n": n, "copy_env": copy_env, "inherit_ttl": inherit_ttl})
        res = ForkResult(snapshot=SnapshotInfo.model_validate(r["snapshot"]))
        res.sandboxes = [RemoteSandbox(self._c, SandboxInfo.model_validate(x)) for x in r["sandboxes"]]  # type: ignore[misc]
        res.failed = [(f["index"], getattr(E, f["type"], E.ShoalError)(f["message"])) for f in r["failed"]]
        return res

    def __repr__(self) -> str:
        return f"RemoteSandbox({self.id}, via {self._c.url})"


def connect_remote(sandbox_id: str, client: Client) -> RemoteSandbox:
    return RemoteSandbox(client, SandboxInfo.model_validate(client.json("GET", f"/v1/sandboxes/{sandbox_id}")))


def list_remote(client: Client) -> list[SandboxInfo]:
    return [SandboxInfo.model_validate(x) for x in client.json("GET", "/v1/sandboxes")]
