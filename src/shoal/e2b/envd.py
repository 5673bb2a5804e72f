"""E2B's in-sandbox daemon ("envd") served from outside the sandbox, over the Shoal contract.

Connect-RPC services `process.Process` and `filesystem.Filesystem` (JSON codec, see wire.py) and the
plain routes `GET /health` and `GET/POST /files`. Every request names its sandbox in `E2b-Sandbox-Id`
and proves it with `X-Access-Token` (the token create returned). A sandbox that is missing, killed,
timed out or paused answers 502, which is how the SDK's `is_running()` tells.
"""
from __future__ import annotations

import asyncio
import base64
import gzip
import hashlib
import posixpath
import re
import secrets
import shlex
import stat as st
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from ..core.contract import (
    ExecRequest,
    FileEntry,
    ProcessHandle,
    PtySize,
    StartRequest,
    WatchEvent,
    WatchHandle,
    check_xattrs,
)
from ..core.errors import (
    FileOpError,
    InvalidArgument,
    NotSupported,
    PathOutsideSandbox,
    QuotaExceeded,
    SandboxNotFound,
    ShoalError,
)
from . import wire
from .front import ApiError, Front, not_running
from .state import Box

MAX_UPLOAD = 1 << 30  # bytes of one POST /files body
RING = 4 << 20  # bytes of each output stream a process keeps for Connect
XATTR_PREFIX = "user.e2b."  # where envd keeps upload metadata (X-Metadata-* headers)
SIGNALS = {"SIGNAL_SIGKILL": 9, "SIGNAL_SIGTERM": 15, "SIGNAL_SIGINT": 2, "SIGNAL_SIGHUP": 1, "SIGNAL_UNSPECIFIED": 9}


@dataclass
class Proc:
    pid: int
    handle: ProcessHandle
    config: dict[str, Any]
    tag: str | None = None
    pty: bool = False  # output travels as `data.pty`, input as `input.pty`


@dataclass(frozen=True)
class Account:
    """Who an envd call acts as: E2B's `user` (the request's Basic auth user, else the front's default)."""

    name: str
    uid: int
    gid: int
    home: str
    run_as: str | None  # the contract's `user`; None = the sandbox's root


ACCOUNTS_TTL_S = 2.0  # how long a sandbox's /etc/passwd and /etc/group are cached by the front


@dataclass
class Watcher:
    path: str
    recursive: bool
    snapshot: dict[str, tuple[str, int, float, int]]  # the polling fallback's last listing
    events: list[dict[str, Any]] = field(default_factory=list)
    handle: WatchHandle | None = None  # the backend's watch (inotify); None: poll the listing


# the contract's event types as envd's; overflow has no E2B equivalent (the events are lost either way)
EVENT_TYPES = {"create": "EVENT_TYPE_CREATE", "write": "EVENT_TYPE_WRITE", "remove": "EVENT_TYPE_REMOVE",
               "rename": "EVENT_TYPE_RENAME", "chmod": "EVENT_TYPE_CHMOD"}


def envd_events(evs: list[WatchEvent]) -> list[dict[str, Any]]:
    return [{"name": e.name, "type": EVENT_TYPES[e.type]} for e in evs if e.type in EVENT_TYPES]


def _rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _permissions(mode: int) -> str:
    return st.filemode(mode)


def _ftype(t: str) -> str:
    return {"file": "FILE_TYPE_FILE", "dir": "FILE_TYPE_DIRECTORY", "symlink": "FILE_TYPE_SYMLINK"}.get(
        t, "FILE_TYPE_UNSPECIFIED")


def entry_json(e: FileEntry, path: str, names: Callable[[FileEntry], tuple[str, str]] | None = None) -> dict[str, Any]:
    mode = e.mode & 0o7777 | {"file": st.S_IFREG, "dir": st.S_IFDIR, "symlink": st.S_IFLNK}.get(e.type, 0)
    owner, group = names(e) if names else ("root", "root")
    out = {"name": e.name, "type": _ftype(e.type), "path": path, "size": str(e.size), "mode": e.mode & 0o7777,
           "permissions": _permissions(mode), "owner": owner, "group": group,
           "modifiedTime": _rfc3339(e.mtime)}
    meta = {k[len(XATTR_PREFIX):]: v for k, v in (e.xattrs or {}).items() if k.startswith(XATTR_PREFIX)}
    if meta:
        out["metadata"] = meta
    return out


def upload_metadata(request: Request) -> dict[str, str]:
    """`X-Metadata-<key>: value` headers as the `user.e2b.<key>` xattrs envd stores (keys lowercased)."""
    attrs = {XATTR_PREFIX + k[len("x-metadata-"):].lower(): v for k, v in request.headers.items()
             if k.lower().startswith("x-metadata-") and len(k) > len("x-metadata-")}
    try:
        return check_xattrs(attrs)
    except InvalidArgument as e:
        raise ApiError(400, f"X-Metadata-* headers: {e}") from None


def _rpc_error(e: Exception) -> wire.RpcError:
    """A backend error as the Connect code the SDK expects."""
    if isinstance(e, wire.RpcError):
        return e
    msg = str(e)
    if isinstance(e, FileOpError) and ("No such file" in msg or "not found" in msg.lower()):
        return wire.RpcError("not_found", msg)
    if isinstance(e, (InvalidArgument, PathOutsideSandbox, FileOpError)):
        return wire.RpcError("invalid_argument", msg)
    if isinstance(e, SandboxNotFound):
        return wire.RpcError("unavailable", f"The sandbox was not found: {msg}")
    if isinstance(e, NotSupported):
        return wire.RpcError("unimplemented", msg)
    if isinstance(e, QuotaExceeded):
        return wire.RpcError("resource_exhausted", msg)
    if isinstance(e, ShoalError):
        return wire.RpcError("internal", f"{type(e).__name__}: {msg}")
    return wire.RpcError("internal", f"{type(e).__name__}: {msg}")


def router(front: Front) -> APIRouter:
    r = APIRouter()
    be = front.backend

    # ------------------------------------------------------------------ routing + auth
    def box_for(request: Request) -> Box:
        sid = request.headers.get("e2b-sandbox-id")
        if not sid:
            raise ApiError(400, "missing E2b-Sandbox-Id header")
        box = front.boxes.get(sid)
        if box is None or box.paused:
            raise not_running(sid)
        token = request.headers.get("x-access-token")
        if token is None or not secrets.compare_digest(token, box.token):
            raise ApiError(401, "invalid or missing X-Access-Token for this sandbox")
        return box

    def box_for_files(request: Request, operation: str) -> Box:
        """A /files request: the routing headers + token, or a signed URL (which carries neither: the
        sandbox is the one whose token the signature was made with)."""
        q = request.query_params
        sig = q.get("signature")
        if sig is None:
            return box_for(request)
        exp = q.get("signature_expiration")
        if exp is not None:
            if not exp.isdigit():
                raise ApiError(400, "signature_expiration must be a unix time")
            if int(exp) < time.time():
                raise ApiError(401, "signature is already expired")
        if ":" in q.get("username", ""):  # `:` joins the signed fields: it would let one signature pass
            raise ApiError(400, "username must not contain ':'")  # for another path and operation
        sid = request.headers.get("e2b-sandbox-id")
        for box in [front.boxes.get(sid)] if sid else front.boxes.all():
            if box is not None and secrets.compare_digest(
                    sig, sign(q.get("path", ""), operation, q.get("username", ""), box.token, exp)):
                if box.paused:
                    raise not_running(box.id)
                return box
        raise ApiError(401, "invalid signature")

    def resolve(box: Box, path: Any) -> str:
        """Relative paths resolve under the user's home (or the sandbox's workdir when it has none)."""
        if not isinstance(path, str) or not path:
            raise wire.RpcError("invalid_argument", "path is required")
        return posixpath.normpath(path if path.startswith("/") else posixpath.join(box.home, path))

    # ------------------------------------------------------------------ users (E2B's `user=`)
    def user_name(request: Request) -> str:
        """The SDK names a user as HTTP Basic auth `user:` (no password); none = the default user."""
        auth = request.headers.get("authorization", "")
        if auth[:6].lower() != "basic ":
            return front.user
        try:
            name = base64.b64decode(auth[6:].strip(), validate=True).decode().partition(":")[0]
        except (ValueError, UnicodeDecodeError):
            raise ApiError(400, "malformed Authorization header (Basic base64(user:))") from None
        return name or front.user

    def table(box: Box, path: str, fresh: bool = False) -> list[list[str]]:
        """Rows of the sandbox's /etc/passwd or /etc/group, cached ACCOUNTS_TTL_S."""
        cached = box.accounts.get(path)
        if cached is None or fresh or time.monotonic() - cached[0] > ACCOUNTS_TTL_S:
            try:
                text = be.read_file(box.id, path, 4 << 20).decode("utf-8", "replace")
            except (FileOpError, PathOutsideSandbox, InvalidArgument):
                text = ""
            rows = [r.split(":") for r in text.splitlines() if r.count(":") >= 2 and not r.startswith("#")]
            cached = (time.monotonic(), rows)
            box.accounts[path] = cached
        return cached[1]

    def account(box: Box, name: str) -> Account:
        if name == "root":
            return Account("root", 0, 0, "/root", None)
        for fresh in (False, True):  # a user added since the cache was filled
            row = next((r for r in table(box, "/etc/passwd", fresh) if len(r) >= 7 and r[0] == name
                        and r[2].isdigit() and r[3].isdigit()), None)
            if row is not None:
                return Account(name, int(row[2]), int(row[3]), row[5] or "/", name)
        if name == front.user:  # an image without E2B's user: the sandbox's root, with the user's HOME
            return Account(name, 0, 0, box.home, None)
        raise InvalidArgument(f"user {name!r} does not exist in the sandbox (/etc/passwd)")

    def names(box: Box) -> Callable[[FileEntry], tuple[str, str]]:
        """uid/gid -> the sandbox's own user and group names (the number where it has none)."""
        users = {r[2]: r[0] for r in table(box, "/etc/passwd") if len(r) >= 3}
        groups = {r[2]: r[0] for r in table(box, "/etc/group") if len(r) >= 3}
        users.setdefault("0", "root")
        groups.setdefault("0", "root")

        def of(e: FileEntry) -> tuple[str, str]:
            u, g = str(e.uid if e.uid is not None else 0), str(e.gid if e.gid is not None else 0)
            return users.get(u, u), groups.get(g, g)

        return of

    def cmd_env(box: Box, acct: Account) -> dict[str, str]:
        """What the command's environment gets from who it runs as (a named user's HOME, USER and
        LOGNAME come from the backend, which resolves the same /etc/passwd)."""
        if acct.run_as is not None:
            return {}
        if acct.name == "root":
            return {"HOME": "/root", "USER": "root"}
        return {"HOME": box.home, "USER": acct.name} if box.has_home else {}

    def default_cwd(box: Box, acct: Account) -> str:
        if acct.home == box.home or acct.run_as is None and acct.name != "root":
            return box.home
        try:
            return acct.home if be.stat_file(box.id, acct.home).type == "dir" else box.home
        except (FileOpError, PathOutsideSandbox):
            return box.home

    def made_for(acct: Account) -> bool:
        return acct.run_as is not None and acct.uid != 0

    def missing(box: Box, acct: Account, path: str) -> list[str]:
        """The ancestors of `path` that do not exist yet (a write or make_dir creates them), for own()."""
        out: list[str] = []
        d = posixpath.dirname(path)
        while made_for(acct) and d not in ("/", ""):
            try:
                be.stat_file(box.id, d)
                break
            except FileOpError:
                out.append(d)
                d = posixpath.dirname(d)
        return out

    def own(box: Box, acct: Account, path: str, parents: list[str]) -> None:
        """What the files API made for a non-root user (the path and the parents it created) becomes
        theirs, as envd's are: their commands can then write there."""
        if made_for(acct):
            for p in [path, *parents]:
                be.chown(box.id, p, acct.uid, acct.gid)

    # ------------------------------------------------------------------ unary + stream plumbing
    def unary(name: str, fn: Callable[..., dict[str, Any]], as_user: bool = False) -> None:
        """as_user: fn also gets the Account the call acts as (E2B's `user=`)."""
        async def handler(request: Request) -> Response:
            box = box_for(request)
            try:
                req = wire.decode(await _body(request))
                if as_user:
                    acct = await run_in_threadpool(account, box, user_name(request))
                    out = await run_in_threadpool(fn, box, req, acct)
                else:
                    out = await run_in_threadpool(fn, box, req)
            except Exception as e:  # every failure travels as a Connect error
                if isinstance(e, SandboxNotFound):
                    front.boxes.pop(box.id)
                    raise not_running(box.id) from None
                err = _rpc_error(e)
                return Response(content=_dumps(err.to_json()), status_code=wire.HTTP_STATUS[err.code],
                                media_type=wire.UNARY_CONTENT_TYPE)
            return Response(content=_dumps(out), media_type=wire.UNARY_CONTENT_TYPE)

        r.add_api_route(f"/{name}", handler, methods=["POST"])

    def streaming(name: str, fn: Callable[[Box, dict[str, Any], Request], AsyncIterator[dict[str, Any]]]) -> None:
        async def handler(request: Request) -> Response:
            box = box_for(request)
            try:
                msgs = wire.split_envelopes(await _body(request))
            except wire.RpcError as e:
                return _stream_error(e)
            deadline_ms = request.headers.get("connect-timeout-ms")
            deadline = time.monotonic() + int(deadline_ms) / 1000 if deadline_ms and deadline_ms.isdigit() else None

            async def body() -> AsyncIterator[bytes]:
                # taken in the body, so that the finally below always gives it back
                if not front.streams.take(box.tenant, front.limits.streams):
                    yield wire.end_of_stream(wire.RpcError(
                        "resource_exhausted", f"this API key's tenant has {front.limits.streams} streams open "
                                              "(the front's limit); close some first"))
                    return
                try:
                    async for msg in fn(box, msgs[0] if msgs else {}, request):
                        yield wire.message(msg)
                        if deadline is not None and time.monotonic() > deadline:
                            raise wire.RpcError("deadline_exceeded", "the stream's deadline passed")
                except Exception as e:
                    yield wire.end_of_stream(_rpc_error(e))
                    return
                finally:
                    front.streams.give(box.tenant)
                yield wire.end_of_stream()

            return StreamingResponse(body(), media_type=wire.STREAM_CONTENT_TYPE)

        r.add_api_route(f"/{name}", handler, methods=["POST"])

    def keepalive_s(request: Request) -> float:
        v = request.headers.get("keepalive-ping-interval", "")
        return max(1.0, min(float(v), 300.0)) if v.replace(".", "", 1).isdigit() else 30.0

    # ------------------------------------------------------------------ process.Process
    def selected(box: Box, req: dict[str, Any]) -> Proc:
        sel = req.get("process") or {}
        with box.lock:
            if "pid" in sel:
                pid = wire.as_int(sel["pid"], "pid")
                proc = box.procs.get(pid)
            elif "tag" in sel:
                proc = next((p for p in box.procs.values() if p.tag == sel["tag"]), None)
            else:
                raise wire.RpcError("invalid_argument", "process selector needs pid or tag")
        if proc is None:
            raise wire.RpcError("not_found", f"process {sel} not found")
        return proc

    async def events(box: Box, proc: Proc, since: tuple[int, int], request: Request) -> AsyncIterator[dict]:
        loop = asyncio.get_running_loop()
        ka = keepalive_s(request)
        yield {"event": {"start": {"pid": proc.pid}}}
        cursor = since
        while True:
            out = await loop.run_in_executor(front.stream_pool, proc.handle.wait_output, cursor, ka)
            cursor = out.cursor
            if out.stdout:
                yield {"event": {"data": {"pty" if proc.pty else "stdout": wire.b64(out.stdout.encode())}}}
            if out.stderr:
                yield {"event": {"data": {"stderr": wire.b64(out.stderr.encode())}}}
            if out.exit_code is not None:
                with box.lock:
                    box.procs.pop(proc.pid, None)
                code = out.exit_code
                yield {"event": {"end": {"exitCode": code, "exited": code < 128,
                                         "status": f"exit status {code}" if code < 128
                                         else f"signal: {code - 128}"}}}
                return
            if not (out.stdout or out.stderr):
                if await request.is_disconnected():
                    return  # the client went away: the process keeps running (commands.connect)
                yield {"event": {"keepalive": {}}}

    def start(box: Box, req: dict[str, Any], request: Request) -> AsyncIterator[dict]:
        async def gen() -> AsyncIterator[dict]:
            cfg = req.get("process") or {}
            cmd = cfg.get("cmd")
            if not isinstance(cmd, str) or not cmd:
                raise wire.RpcError("invalid_argument", "process.cmd is required")
            pty = None
            if req.get("pty"):
                size = (req["pty"] or {}).get("size") or {}
                try:
                    pty = PtySize(rows=wire.as_int(size.get("rows"), "pty.size.rows", 24),
                                  cols=wire.as_int(size.get("cols"), "pty.size.cols", 80))
                except ValueError as e:
                    raise wire.RpcError("invalid_argument", f"bad PTY size: {e}") from None
            args = [str(a) for a in cfg.get("args") or []]
            envs = {str(k): str(v) for k, v in (cfg.get("envs") or {}).items()}
            await run_in_threadpool(room_for_a_process, box)
            acct = await run_in_threadpool(account, box, user_name(request))
            cwd = resolve(box, cfg["cwd"]) if cfg.get("cwd") else await run_in_threadpool(default_cwd, box, acct)
            env = {**cmd_env(box, acct), **envs}
            sreq = StartRequest(argv=[cmd, *args], cwd=cwd, env=env, stdin=bool(req.get("stdin")) and pty is None,
                                ring_bytes=RING, user=acct.run_as, pty=pty)
            handle = await run_in_threadpool(be.start, box.id, sreq)
            if handle.pid is None:
                handle.close()
                raise wire.RpcError("internal", f"{cmd!r} did not start")
            proc = Proc(pid=handle.pid, handle=handle, tag=req.get("tag") or None, pty=pty is not None,
                        config={"cmd": cmd, "args": args, "envs": envs, "cwd": cwd})
            with box.lock:
                box.procs[proc.pid] = proc
            async for ev in events(box, proc, (0, 0), request):
                yield ev
        return gen()

    def room_for_a_process(box: Box) -> None:
        """The per-sandbox cap on running processes the front tracks (each holds its output rings);
        finished ones nobody streamed are dropped here."""
        with box.lock:
            done = [p for p in box.procs.values() if p.handle.poll() is not None]
            for p in done:
                box.procs.pop(p.pid, None)
            live = len(box.procs)
        for p in done:
            p.handle.close()
        if front.limits.processes and live >= front.limits.processes:
            raise wire.RpcError("resource_exhausted", f"sandbox {box.id} runs {live} processes started through "
                                                      "the front (its limit); kill or wait for some first")

    def connect(box: Box, req: dict[str, Any], request: Request) -> AsyncIterator[dict]:
        async def gen() -> AsyncIterator[dict]:
            proc = selected(box, req)
            now = proc.handle.output((1 << 62, 1 << 62)).cursor  # only what comes from now on
            async for ev in events(box, proc, now, request):
                yield ev
        return gen()

    def list_procs(box: Box, req: dict[str, Any]) -> dict[str, Any]:
        with box.lock:
            procs = list(box.procs.values())
        live = []
        for p in procs:
            if p.handle.poll() is None:
                live.append({"config": p.config, "pid": p.pid, **({"tag": p.tag} if p.tag else {})})
        return {"processes": live}

    def send_input(box: Box, req: dict[str, Any]) -> dict[str, Any]:
        proc = selected(box, req)
        inp = req.get("input") or {}
        proc.handle.write_stdin(_input(inp))
        return {}

    def send_signal(box: Box, req: dict[str, Any]) -> dict[str, Any]:
        proc = selected(box, req)
        sig = req.get("signal", "SIGNAL_SIGKILL")
        signo = SIGNALS.get(sig) if isinstance(sig, str) else wire.as_int(sig, "signal")
        if not signo:
            raise wire.RpcError("invalid_argument", f"unknown signal {sig!r}")
        proc.handle.kill(signo)
        return {}

    def close_stdin(box: Box, req: dict[str, Any]) -> dict[str, Any]:
        selected(box, req).handle.close_stdin()
        return {}

    def update(box: Box, req: dict[str, Any]) -> dict[str, Any]:
        proc = selected(box, req)
        size = (req.get("pty") or {}).get("size")
        if not isinstance(size, dict):
            raise wire.RpcError("invalid_argument", "Update needs pty.size")
        if not proc.pty:
            raise wire.RpcError("invalid_argument", f"process {proc.pid} has no PTY")
        proc.handle.resize(wire.as_int(size.get("rows"), "rows", 0), wire.as_int(size.get("cols"), "cols", 0))
        return {}

    async def stream_input(request: Request) -> Response:
        """Client stream: a `start` naming the process, then `data` chunks, in order."""
        box = box_for(request)
        try:
            msgs = wire.split_envelopes(await _body(request))
            proc: Proc | None = None
            for m in msgs:
                ev = m.get("event") or m
                if "start" in ev:
                    proc = await run_in_threadpool(selected, box, ev["start"])
                elif "data" in ev:
                    if proc is None:
                        raise wire.RpcError("invalid_argument", "data before start")
                    inp = (ev["data"] or {}).get("input") or {}
                    await run_in_threadpool(proc.handle.write_stdin, _input(inp))
        except Exception as e:
            return _stream_error(_rpc_error(e))
        return Response(content=wire.message({}) + wire.end_of_stream(), media_type=wire.STREAM_CONTENT_TYPE)

    r.add_api_route("/process.Process/StreamInput", stream_input, methods=["POST"])
    streaming("process.Process/Start", start)
    streaming("process.Process/Connect", connect)
    unary("process.Process/List", list_procs)
    unary("process.Process/SendInput", send_input)
    unary("process.Process/SendSignal", send_signal)
    unary("process.Process/CloseStdin", close_stdin)
    unary("process.Process/Update", update)

    # ------------------------------------------------------------------ filesystem.Filesystem
    def stat(box: Box, req: dict[str, Any]) -> dict[str, Any]:
        path = resolve(box, req.get("path"))
        return {"entry": entry_json(be.stat_file(box.id, path), path, names(box))}

    def list_dir(box: Box, req: dict[str, Any]) -> dict[str, Any]:
        path = resolve(box, req.get("path"))
        depth = wire.as_int(req.get("depth"), "depth", 1) or 1
        if depth < 1:
            raise wire.RpcError("invalid_argument", "depth must be >= 1")
        top = be.stat_file(box.id, path)
        if top.type != "dir":
            raise wire.RpcError("invalid_argument", f"path {path!r} is not a directory")
        out: list[dict[str, Any]] = []
        nm = names(box)

        def walk(d: str, level: int) -> None:
            for e in sorted(be.list_files(box.id, d), key=lambda e: e.name):
                p = posixpath.join(d, e.name)
                out.append(entry_json(e, p, nm))
                if e.type == "dir" and level < depth:
                    walk(p, level + 1)

        walk(path, 1)
        return {"entries": out}

    def make_dir(box: Box, req: dict[str, Any], acct: Account) -> dict[str, Any]:
        path = resolve(box, req.get("path"))
        try:
            be.stat_file(box.id, path)
        except FileOpError:
            pass
        else:
            raise wire.RpcError("already_exists", f"{path!r} already exists")
        parents = missing(box, acct, path)
        be.mkdir(box.id, path)
        own(box, acct, path, parents)
        return {"entry": entry_json(be.stat_file(box.id, path), path, names(box))}

    def move(box: Box, req: dict[str, Any]) -> dict[str, Any]:
        src, dst = resolve(box, req.get("source")), resolve(box, req.get("destination"))
        be.stat_file(box.id, src)  # not_found before anything runs
        # no rename in the contract: mv inside the sandbox (its own view of the paths)
        res = be.exec(box.id, ExecRequest(argv=["/bin/sh", "-c", f"mv -f -- {shlex.quote(src)} {shlex.quote(dst)}"],
                                          timeout=60))
        if res.exit_code != 0:
            raise wire.RpcError("invalid_argument", f"move {src!r} -> {dst!r}: {res.stderr.strip()}")
        return {"entry": entry_json(be.stat_file(box.id, dst), dst, names(box))}

    def remove(box: Box, req: dict[str, Any]) -> dict[str, Any]:
        path = resolve(box, req.get("path"))
        be.stat_file(box.id, path)  # a missing path is not_found, as envd answers
        be.remove_file(box.id, path)
        return {}

    def snapshot(box: Box, path: str, recursive: bool) -> dict[str, tuple[str, int, float, int]]:
        out: dict[str, tuple[str, int, float, int]] = {}
        cap = front.limits.watch_entries

        def walk(d: str, prefix: str) -> None:
            for e in be.list_files(box.id, d):
                rel = prefix + e.name
                out[rel] = (e.type, e.size, e.mtime, e.mode)
                if cap and len(out) > cap:  # each poll re-lists the tree: a big one would cost every 50 ms
                    raise wire.RpcError("resource_exhausted", f"{path!r} holds more than {cap} entries to "
                                                              "watch (the front's limit); watch a smaller tree")
                if recursive and e.type == "dir":
                    walk(posixpath.join(d, e.name), rel + "/")

        walk(path, "")
        return out

    def diff(old: dict, new: dict) -> list[dict[str, Any]]:
        evs: list[dict[str, Any]] = []
        for name, meta in new.items():
            prev = old.get(name)
            if prev is None:
                evs.append({"name": name, "type": "EVENT_TYPE_CREATE"})
                if meta[0] == "file" and meta[1] > 0:
                    evs.append({"name": name, "type": "EVENT_TYPE_WRITE"})
            elif prev[1:3] != meta[1:3]:
                evs.append({"name": name, "type": "EVENT_TYPE_WRITE"})
            elif prev[3] != meta[3]:
                evs.append({"name": name, "type": "EVENT_TYPE_CHMOD"})
        evs.extend({"name": name, "type": "EVENT_TYPE_REMOVE"} for name in old if name not in new)
        return evs

    def open_watch(box: Box, path: str, recursive: bool) -> WatchHandle | None:
        """The backend's watch on `path`, or None where the backend cannot watch (then the front polls);
        one of the tenant's `limits.watches` for as long as it is open."""
        if be.stat_file(box.id, path).type != "dir":
            raise wire.RpcError("invalid_argument", f"path {path!r} is not a directory")
        if not front.watches.take(box.tenant, front.limits.watches):
            raise wire.RpcError("resource_exhausted", f"this API key's tenant has {front.limits.watches} "
                                                      "file watches open (the front's limit); close some first")
        try:
            return _TenantWatch(be.watch_dir(box.id, path, recursive), lambda: front.watches.give(box.tenant))
        except NotSupported:
            front.watches.give(box.tenant)
            return None
        except BaseException:
            front.watches.give(box.tenant)
            raise

    def watch_dir(box: Box, req: dict[str, Any], request: Request) -> AsyncIterator[dict]:
        async def gen() -> AsyncIterator[dict]:
            path = resolve(box, req.get("path"))
            recursive = bool(req.get("recursive"))
            handle = await run_in_threadpool(open_watch, box, path, recursive)
            if handle is None:
                async for msg in polled(box, path, recursive, request):
                    yield msg
                return
            loop = asyncio.get_running_loop()
            try:
                yield {"start": {}}  # WatchDirResponse's oneof sits in the message itself
                ka, last = keepalive_s(request), time.monotonic()
                while True:
                    evs = await loop.run_in_executor(front.stream_pool, handle.read, min(ka, 1.0), 512)
                    for ev in envd_events(evs):
                        yield {"filesystem": ev}
                        last = time.monotonic()
                    if handle.ended or front.boxes.get(box.id) is None:
                        return  # the watched directory or the sandbox went away
                    if not evs and await request.is_disconnected():
                        return
                    if time.monotonic() - last > ka:
                        yield {"keepalive": {}}
                        last = time.monotonic()
            finally:
                # not awaited: a cancelled stream (the client left) would cancel that await too; close
                # only wakes the reader and waits for its lock, which the wake-up frees at once
                handle.close()
        return gen()

    async def polled(box: Box, path: str, recursive: bool, request: Request) -> AsyncIterator[dict]:
        """WatchDir over a backend without watches: diff listings every POLL_S."""
        snap = await run_in_threadpool(snapshot, box, path, recursive)
        yield {"start": {}}
        ka, last = keepalive_s(request), time.monotonic()
        while True:
            await asyncio.sleep(POLL_S)
            if await request.is_disconnected() or front.boxes.get(box.id) is None:
                return
            try:
                new = await run_in_threadpool(snapshot, box, path, recursive)
            except FileOpError:
                return  # the watched directory went away
            for ev in diff(snap, new):
                yield {"filesystem": ev}
                last = time.monotonic()
            snap = new
            if time.monotonic() - last > ka:
                yield {"keepalive": {}}
                last = time.monotonic()

    def create_watcher(box: Box, req: dict[str, Any]) -> dict[str, Any]:
        path = resolve(box, req.get("path"))
        recursive = bool(req.get("recursive"))
        if front.limits.watchers and len(box.watchers) >= front.limits.watchers:
            raise wire.RpcError("resource_exhausted", f"sandbox {box.id} has {len(box.watchers)} watchers (the "
                                                      "front's limit); remove some first")
        handle = open_watch(box, path, recursive)
        wid = "w-" + secrets.token_hex(8)
        box.watchers[wid] = Watcher(path=path, recursive=recursive, handle=handle,
                                    snapshot=snapshot(box, path, recursive) if handle is None else {})
        return {"watcherId": wid}

    def get_watcher_events(box: Box, req: dict[str, Any]) -> dict[str, Any]:
        w = box.watchers.get(str(req.get("watcherId")))
        if w is None:
            raise wire.RpcError("not_found", f"watcher {req.get('watcherId')!r} not found")
        if w.handle is not None:  # what the watch queued since the last call (at most a few reads' worth)
            evs: list[dict[str, Any]] = []
            for _ in range(8):
                got = w.handle.read(0, 1024)
                evs += envd_events(got)
                if not got:
                    break
            return {"events": evs}
        new = snapshot(box, w.path, w.recursive)
        evs, w.snapshot = diff(w.snapshot, new), new
        return {"events": evs}

    def remove_watcher(box: Box, req: dict[str, Any]) -> dict[str, Any]:
        w = box.watchers.pop(str(req.get("watcherId")), None)
        if w is None:
            raise wire.RpcError("not_found", f"watcher {req.get('watcherId')!r} not found")
        if w.handle is not None:
            w.handle.close()
        return {}

    unary("filesystem.Filesystem/Stat", stat)
    unary("filesystem.Filesystem/ListDir", list_dir)
    unary("filesystem.Filesystem/MakeDir", make_dir, as_user=True)
    unary("filesystem.Filesystem/Move", move)
    unary("filesystem.Filesystem/Remove", remove)
    streaming("filesystem.Filesystem/WatchDir", watch_dir)
    unary("filesystem.Filesystem/CreateWatcher", create_watcher)
    unary("filesystem.Filesystem/GetWatcherEvents", get_watcher_events)
    unary("filesystem.Filesystem/RemoveWatcher", remove_watcher)

    # ------------------------------------------------------------------ plain HTTP routes
    @r.get("/health")
    def health(request: Request) -> Response:
        box_for(request)
        return Response(status_code=204)

    @r.get("/files")
    def download(request: Request, path: str | None = None) -> Response:
        box = box_for_files(request, "read")
        p = _http_path(resolve, box, path)
        try:
            data = be.read_file(box.id, p)
        except SandboxNotFound:
            raise not_running(box.id) from None
        except FileOpError as e:
            raise ApiError(404 if "No such file" in str(e) else 400, str(e)) from None
        headers = {"Content-Disposition": f'attachment; filename="{posixpath.basename(p)}"'}
        if "gzip" in request.headers.get("accept-encoding", "") and len(data) > 1024:
            return Response(gzip.compress(data, 1), media_type="application/octet-stream",
                            headers={**headers, "Content-Encoding": "gzip"})
        return Response(data, media_type="application/octet-stream", headers=headers)

    @r.post("/files")
    async def upload(request: Request, path: str | None = None) -> Response:
        box = box_for_files(request, "write")
        body = await _body(request, MAX_UPLOAD)
        ctype = request.headers.get("content-type", "")
        files: list[tuple[str, bytes]] = []
        if ctype.startswith("multipart/form-data"):
            parts = [(n, f, d) for n, f, d in parse_multipart(body, ctype) if n == "file"]
            for _, fname, payload in parts:
                name = fname or (path if len(parts) == 1 else None)
                if not name:
                    raise ApiError(400, "each multipart file needs a filename (its path)")
                files.append((name, payload))
        else:
            if not path:
                raise ApiError(400, "an octet-stream upload needs ?path=")
            if request.headers.get("content-encoding", "") == "gzip":
                try:
                    body = wire.gunzip(body, MAX_UPLOAD)
                except wire.TooLarge as e:
                    raise ApiError(413, e.message) from None
                except wire.RpcError as e:
                    raise ApiError(400, e.message) from None
            files.append((path, body))
        if not files:
            raise ApiError(400, "no file in the upload")
        attrs = upload_metadata(request)
        signed = request.query_params.get("signature") is not None
        signed_path = request.query_params.get("path") if signed else None
        try:
            # the SDK names the user in ?username= on /files (and signs it into a signed URL)
            name = request.query_params.get("username") or (front.user if signed else user_name(request))
            acct = await run_in_threadpool(account, box, name)
        except InvalidArgument as e:
            raise ApiError(400, str(e)) from None
        if signed_path:  # a signed URL writes the one path it was signed for, whatever the body names
            if len(files) != 1:
                raise ApiError(400, "a signed upload URL takes exactly one file")
            files = [(signed_path, files[0][1])]
        out = []
        for name, data in files:
            p = _http_path(resolve, box, name)
            try:
                parents = await run_in_threadpool(missing, box, acct, p)
                await run_in_threadpool(be.write_file, box.id, p, data)
                await run_in_threadpool(own, box, acct, p, parents)
                if attrs:
                    await run_in_threadpool(be.set_xattrs, box.id, p, attrs)
            except SandboxNotFound:
                raise not_running(box.id) from None
            except (FileOpError, InvalidArgument) as e:
                raise ApiError(400, str(e)) from None
            except NotSupported as e:
                raise ApiError(501, str(e)) from None
            out.append({"path": p, "name": posixpath.basename(p), "type": "file",
                        **({"metadata": {k[len(XATTR_PREFIX):]: v for k, v in attrs.items()}} if attrs else {})})
        return Response(_dumps(out), media_type="application/json")

    return r


POLL_S = 0.05  # WatchDir polls the directory this often on a backend without watch_dir (gVisor)


_DISPOSITION = re.compile(rb'(?i)^content-disposition:.*?;\s*name="([^"]*)"(?:.*?;\s*filename="([^"]*)")?', re.M)


def parse_multipart(body: bytes, ctype: str) -> list[tuple[str, str | None, bytes]]:
    """(field name, filename, content) of each part of a multipart/form-data body."""
    m = re.search(r'boundary="?([^";]+)"?', ctype)
    if not m:
        raise ApiError(400, "multipart body without a boundary")
    delim = b"\r\n--" + m.group(1).encode()
    out = []
    for part in (b"\r\n" + body).split(delim)[1:]:
        if part.startswith(b"--"):
            break  # the closing delimiter
        head, sep, data = part.partition(b"\r\n\r\n")
        d = _DISPOSITION.search(head)
        if not sep or d is None:
            raise ApiError(400, "malformed multipart part")
        fname = d.group(2)
        out.append((d.group(1).decode(errors="replace"), fname.decode(errors="replace") if fname is not None else None,
                    data))
    return out


def sign(path: str, operation: str, user: str, token: str, expiration: str | None) -> str:
    """E2B's v1 file-URL signature: sha256 of `path:operation:user:token[:expiration]`, base64 unpadded."""
    raw = f"{path}:{operation}:{user}:{token}" + (f":{expiration}" if expiration is not None else "")
    return "v1_" + base64.b64encode(hashlib.sha256(raw.encode()).digest()).rstrip(b"=").decode()


def _http_path(resolve: Callable[[Box, Any], str], box: Box, path: str | None) -> str:
    try:
        return resolve(box, path)
    except wire.RpcError as e:
        raise ApiError(400, e.message) from None


async def _body(request: Request, cap: int = wire.MAX_MESSAGE) -> bytes:
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > cap:
            raise ApiError(413, f"request body over {cap} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _input(inp: dict[str, Any]) -> bytes:
    """ProcessInput's oneof: `stdin` bytes for a pipe, `pty` bytes for a terminal (the same fd here)."""
    if "pty" in inp:
        return wire.unb64(inp.get("pty", ""), "input.pty")
    return wire.unb64(inp.get("stdin", ""), "input.stdin")


def _dumps(obj: Any) -> bytes:
    import json

    return json.dumps(obj, separators=(",", ":")).encode()


def _stream_error(err: wire.RpcError) -> Response:
    return Response(content=wire.end_of_stream(err), media_type=wire.STREAM_CONTENT_TYPE)


class _TenantWatch(WatchHandle):
    """A backend watch that gives its tenant's slot back when closed (once)."""

    def __init__(self, handle: WatchHandle, give: Callable[[], None]):
        self._h = handle
        self._give: Callable[[], None] | None = give
        self._lock = threading.Lock()

    def read(self, timeout: float = 1.0, max_events: int = 1024) -> list[WatchEvent]:
        return self._h.read(timeout, max_events)

    @property
    def ended(self) -> bool:
        return self._h.ended

    def close(self) -> None:
        self._h.close()
        with self._lock:
            give, self._give = self._give, None
        if give is not None:
            give()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
