"""The asyncio SDK: `shoal.AsyncSandbox` mirrors `shoal.Sandbox` method for method.

Sandbox operations are short blocking syscalls on local sockets and pipes; each call runs in a
worker thread (asyncio.to_thread) so the event loop never blocks, and streaming output arrives as
an async iterator.
"""
from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

from dataclasses import dataclass

from ..core.contract import ExecResult, FileEntry, SandboxInfo, SnapshotInfo
from .args import BackendArgs
from .sandbox import BackgroundOutput, Cmd, CommandHandle, OutputEvent, Sandbox, Session

_t = asyncio.to_thread


class AsyncCommandHandle:
    def __init__(self, h: CommandHandle):
        self._h = h
        self.pid = h.pid

    def poll(self) -> int | None:
        return self._h.poll()

    def output(self, since: tuple[int, int] = (0, 0)) -> BackgroundOutput:
        return self._h.output(since)

    async def wait(self, timeout: float | None = None) -> ExecResult:
        return await _t(self._h.wait, timeout)

    async def kill(self, sig: int = 9) -> None:
        self._h.kill(sig)

    async def close(self) -> None:
        self._h.close()


class AsyncCommands:
    def __init__(self, sb: Sandbox):
        self._c = sb.commands

    async def run(self, cmd: Cmd, **kw) -> ExecResult:
        return await _t(self._c.run, cmd, **kw)

    async def start(self, cmd: Cmd, **kw) -> AsyncCommandHandle:
        return AsyncCommandHandle(await _t(self._c.start, cmd, **kw))

    async def stream(self, cmd: Cmd, **kw) -> AsyncIterator[OutputEvent | ExecResult]:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        put = lambda item: loop.call_soon_threadsafe(q.put_nowait, item)  # noqa: E731

        def work():
            try:
                put(self._c.run(cmd, on_stdout=lambda t: put(OutputEvent("stdout", t)),
                                on_stderr=lambda t: put(OutputEvent("stderr", t)), **kw))
            except BaseException as e:
                put(e)
            put(None)

        fut = loop.run_in_executor(None, work)
        while (item := await q.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item
        await fut


class AsyncSession:
    def __init__(self, s: Session):
        self._s = s

    async def run(self, cmd: str, timeout: float | None = 60.0) -> ExecResult:
        return await _t(self._s.run, cmd, timeout)

    async def close(self) -> None:
        await _t(self._s.close)

    async def __aenter__(self) -> "AsyncSession":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class AsyncSessions:
    def __init__(self, sb: Sandbox):
        self._s = sb.sessions

    async def create(self, shell: str | None = None, cwd: str = "/", env: dict[str, str] | None = None) -> AsyncSession:
        return AsyncSession(await _t(self._s.create, shell, cwd, env))


class AsyncFiles:
    def __init__(self, sb: Sandbox):
        self._f = sb.files

    async def read(self, path: str, encoding: str = "utf-8") -> str:
        return await _t(self._f.read, path, encoding)

    async def read_bytes(self, path: str, max_bytes: int = 64 << 20) -> bytes:
        return await _t(self._f.read_bytes, path, max_bytes)

    async def write(self, path: str, data: str | bytes, mode: int = 0o644) -> int:
        return await _t(self._f.write, path, data, mode)

    async def list(self, path: str = "/") -> list[FileEntry]:
        return await _t(self._f.list, path)

    async def stat(self, path: str) -> FileEntry:
        return await _t(self._f.stat, path)

    async def exists(self, path: str) -> bool:
        return await _t(self._f.exists, path)

    async def mkdir(self, path: str) -> None:
        await _t(self._f.mkdir, path)

    async def remove(self, path: str) -> None:
        await _t(self._f.remove, path)

    async def upload(self, dest_dir: str, src: str | os.PathLike | bytes) -> int:
        return await _t(self._f.upload, dest_dir, src)

    async def download(self, path: str, dest: str | os.PathLike | None = None, max_bytes: int = 1 << 30) -> bytes:
        return await _t(self._f.download, path, dest, max_bytes)


class AsyncSandbox:
    def __init__(self, sb: Sandbox):
        self._sb = sb
        self.id = sb.id
        self.commands = AsyncCommands(sb)
        self.files = AsyncFiles(sb)
        self.sessions = AsyncSessions(sb)

    @classmethod
    async def create(cls, image: str | None = None, *, layers: list[str] | None = None, cpu: float | None = None,
                     memory_mb: int | None = None, disk_mb: int | None = None, pids: int | None = None,
                     ttl: float | None = None, idle_ttl: float | None = None, env: dict[str, str] | None = None,
                     backend: str = "container", args: BackendArgs | None = None,
                     from_snapshot: str | SnapshotInfo | None = None,
                     root: str | os.PathLike | None = None, url: str | None = None,
                     api_key: str | None = None) -> "AsyncSandbox":
        sb = await _t(Sandbox.create, image, layers=layers, cpu=cpu, memory_mb=memory_mb, disk_mb=disk_mb,
                      pids=pids, ttl=ttl, idle_ttl=idle_ttl, env=env, backend=backend, args=args,
                      from_snapshot=from_snapshot, root=root, url=url, api_key=api_key)
        return cls(sb)

    @classmethod
    async def connect(cls, sandbox_id: str, root: str | os.PathLike | None = None, url: str | None = None,
                      api_key: str | None = None) -> "AsyncSandbox":
        return cls(await _t(Sandbox.connect, sandbox_id, root, url, api_key))

    @classmethod
    async def list(cls, root: str | os.PathLike | None = None, url: str | None = None,
                   api_key: str | None = None) -> list[SandboxInfo]:
        return await _t(Sandbox.list, root, url, api_key)

    async def info(self) -> SandboxInfo:
        return await _t(self._sb.info)

    async def is_running(self) -> bool:
        return await _t(self._sb.is_running)

    async def pause(self) -> None:
        await _t(self._sb.pause)

    async def resume(self) -> None:
        await _t(self._sb.resume)

    async def set_timeout(self, ttl: float | None = None, idle_ttl: float | None = None) -> None:
        await _t(self._sb.set_timeout, ttl, idle_ttl)

    async def kill(self) -> None:
        await _t(self._sb.kill)

    async def set_network(self, allow: list[str] | None = None, presets: dict[str, bool] | None = None) -> dict:
        return await _t(self._sb.set_network, allow, presets)

    async def get_network(self) -> dict:
        return await _t(self._sb.get_network)

    async def snapshot(self, exclude: list[str] | None = None) -> SnapshotInfo:
        return await _t(self._sb.snapshot, exclude)

    async def fork(self, n: int, **kw) -> "AsyncForkResult":
        res = await _t(self._sb.fork, n, **kw)
        return AsyncForkResult(res.snapshot, [AsyncSandbox(c) for c in res.sandboxes], res.failed)

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, *exc) -> None:
        try:
            await self.kill()
        except Exception:
            pass


@dataclass
class AsyncForkResult:
    snapshot: SnapshotInfo
    sandboxes: list[AsyncSandbox]
    failed: list[tuple[int, BaseException]]

    @property
    def ok(self) -> bool:
        return not self.failed
