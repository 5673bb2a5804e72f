"""A minimal read-only FUSE file system spoken directly over /dev/fuse (no libfuse).

One flat directory of immutable files, each answered by a `FileSource` (for lazy layers: a layer's
EROFS image read chunk by chunk through the chunk cache). Only what a file-backed EROFS mount and a
human `ls` need is implemented: INIT, LOOKUP, GETATTR, OPEN, READ, RELEASE, OPENDIR, READDIR, STATFS;
everything else answers ENOSYS (writes EROFS: the mount is read-only).

Why not libfuse: the protocol subset is small, it keeps the install free of a compiled binding, and it
gives direct control over what matters here (max_pages = 1 MiB reads, FOPEN_KEEP_CACHE, passthrough
for the measurement in docs/lazy-loading.md). The kernel side is `include/uapi/linux/fuse.h`.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import stat
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, cast

if TYPE_CHECKING:
    from .fastread import FastPath

log = logging.getLogger(__name__)

_libc = ctypes.CDLL(None, use_errno=True)

# opcodes
LOOKUP, FORGET, GETATTR, OPEN, READ, STATFS, RELEASE, FLUSH, INIT = 1, 2, 3, 14, 15, 17, 18, 25, 26
OPENDIR, READDIR, RELEASEDIR, ACCESS, INTERRUPT, DESTROY, BATCH_FORGET = 27, 28, 29, 34, 36, 38, 42
_NO_REPLY = {FORGET, BATCH_FORGET, INTERRUPT}

# INIT flags (flags | flags2 << 32)
_ASYNC_READ, _MAX_PAGES, _PARALLEL_DIROPS, _INIT_EXT = 1 << 0, 1 << 22, 1 << 18, 1 << 30
_PASSTHROUGH = 1 << 37
# OPEN reply flags
FOPEN_DIRECT_IO, FOPEN_KEEP_CACHE, FOPEN_PASSTHROUGH = 1 << 0, 1 << 1, 1 << 7
# ioctl(/dev/fuse, FUSE_DEV_IOC_BACKING_OPEN, struct fuse_backing_map {i32 fd; u32 flags; u64 pad})
_FUSE_DEV_IOC_BACKING_OPEN = 0x4010E501

_IN_HDR = struct.Struct("<IIQQIIIHH")  # len opcode unique nodeid uid gid pid total_extlen padding
_OUT_HDR = struct.Struct("<IiQ")  # len error unique
# ino size blocks a/m/ctime a/m/ctimensec mode nlink uid gid rdev blksize flags
_ATTR = struct.Struct("<QQQQQQIIIIIIIIII")
_READ_IN = struct.Struct("<QQII")  # fh offset size read_flags (lock_owner, flags, padding follow)
_OPEN_OUT = struct.Struct("<QIi")  # fh open_flags backing_id
MAX_PAGES = 256  # 1 MiB per READ: one chunk per request
_BUF = (MAX_PAGES + 1) * 4096 + 4096
ROOT_INO = 1
TTL_S = 3600  # names and sizes never change: let the kernel cache them


class FileSource(Protocol):
    """What the file system serves: immutable files in one directory."""

    def lookup(self, name: str) -> int | None:
        """The file's size, or None when there is no such file."""

    def names(self) -> list[str]:
        """The files to list (a file may be looked up without being listed)."""

    def read(self, name: str, offset: int, size: int) -> bytes:
        """Bytes of the file; raise OSError(EIO, ...) when they cannot be had."""


class FastSource(FileSource, Protocol):
    """A source whose files the C fast path (shoal.lazy.fastread) may serve once their chunks are here."""

    def chunk_size(self, name: str) -> int | None:
        """The file's chunk size (None: never served in C)."""

    def chunk_fds(self, name: str, offset: int, size: int) -> list[tuple[int, int]]:
        """(chunk number, open descriptor) of the verified chunks a read just served spans; each
        descriptor stays open and its bytes unchanged for the server's life."""


@dataclass
class _Node:
    name: str
    size: int


class FuseServer:
    """Serves `source` at `mountpoint` with `threads` worker threads reading /dev/fuse.

    `open_flags` go into every OPEN reply (FOPEN_KEEP_CACHE by default: the files never change).
    `backing`: name -> local path to serve by FUSE passthrough (the kernel reads that file itself;
    measurement only, see docs/lazy-loading.md). `fast`: the C fast path (shoal.lazy.fastread),
    which answers READs of registered chunks of a `FastSource` without Python."""

    def __init__(self, mountpoint: Path, source: FileSource, threads: int = 4, open_flags: int = FOPEN_KEEP_CACHE,
                 backing: Callable[[str], str | None] | None = None, fsname: str = "shoal-lazy",
                 fast: FastPath | None = None):
        self.mountpoint, self.source, self.threads = Path(mountpoint), source, threads
        self.open_flags, self.backing, self.fsname = open_flags, backing, fsname
        self.fd = -1
        self._nodes: dict[int, _Node] = {}
        self._inos: dict[str, int] = {}
        self._lock = threading.Lock()
        self._workers: list[threading.Thread] = []
        self._passthrough = False
        # the C path needs a source that hands out its verified chunks' descriptors (a FastSource)
        self._fast_source = cast(FastSource, source) if fast is not None and hasattr(source, "chunk_fds") else None
        self.fast = fast if self._fast_source is not None else None

    # ------------------------------------------------------------------ lifecycle
    def mount(self) -> None:
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        self.fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        opts = f"fd={self.fd},rootmode=40000,user_id=0,group_id=0,allow_other,default_permissions"
        ms_rdonly, ms_nosuid, ms_nodev = 1, 2, 4
        if _libc.mount(self.fsname.encode(), str(self.mountpoint).encode(), b"fuse",
                       ms_rdonly | ms_nosuid | ms_nodev, opts.encode()) != 0:
            err = ctypes.get_errno()
            os.close(self.fd)
            raise OSError(err, f"mount fuse at {self.mountpoint}: {os.strerror(err)}")

    def start(self) -> None:
        for i in range(self.threads):
            t = threading.Thread(target=self._loop, name=f"fuse-{i}", daemon=True)
            t.start()
            self._workers.append(t)

    def wait(self) -> None:
        for t in self._workers:
            t.join()

    # ------------------------------------------------------------------ nodes
    def _node_for(self, name: str, size: int) -> int:
        with self._lock:
            ino = self._inos.get(name)
            if ino is None:
                ino = len(self._inos) + 2
                self._inos[name] = ino
                self._nodes[ino] = _Node(name, size)
                if self.fast is not None and self._fast_source is not None:
                    cs = self._fast_source.chunk_size(name)
                    if cs:
                        self.fast.node(ino, size, cs)
            return ino

    @staticmethod
    def _attr(ino: int, size: int, is_dir: bool) -> bytes:
        mode = (stat.S_IFDIR | 0o555) if is_dir else (stat.S_IFREG | 0o444)
        return _ATTR.pack(ino, size, (size + 511) // 512, 0, 0, 0, 0, 0, 0, mode, 2 if is_dir else 1,
                          0, 0, 0, 4096, 0)

    def _entry(self, ino: int, size: int) -> bytes:
        return struct.pack("<QQQQII", ino, 0, TTL_S, TTL_S, 0, 0) + self._attr(ino, size, False)

    # ------------------------------------------------------------------ the loop
    def _next(self, cbuf: ctypes.Array | None) -> bytes:
        """The next request Python answers (the fast path, if any, answers cached READs before)."""
        if self.fast is None or cbuf is None:
            return os.read(self.fd, _BUF)
        n = self.fast.serve(self.fd, cbuf)
        if n < 0:
            raise OSError(-n, os.strerror(-n))
        return ctypes.string_at(ctypes.addressof(cbuf), n)

    def _loop(self) -> None:
        cbuf = (ctypes.c_char * _BUF)() if self.fast is not None else None
        while True:
            try:
                req = self._next(cbuf)
            except OSError as e:
                if e.errno in (errno.EINTR, errno.EAGAIN, errno.ENOENT):
                    continue  # ENOENT: the request was interrupted before we read it
                if e.errno != errno.ENODEV:  # ENODEV: unmounted
                    log.error("fuse read: %s", e)
                return
            _, opcode, unique, nodeid, *_ = _IN_HDR.unpack_from(req)
            body = memoryview(req)[_IN_HDR.size:]
            if opcode in _NO_REPLY:
                continue
            try:
                reply = self._handle(opcode, nodeid, body)
                self._reply(unique, 0, reply)
            except OSError as e:
                self._reply(unique, -(e.errno or errno.EIO), b"")
            except Exception:  # a bug must not take the file system down: the caller gets EIO
                log.exception("fuse op %d", opcode)
                self._reply(unique, -errno.EIO, b"")
            if opcode == DESTROY:
                return

    def _reply(self, unique: int, error: int, payload: bytes) -> None:
        n = _OUT_HDR.size + (len(payload) if error == 0 else 0)
        try:
            os.writev(self.fd, [_OUT_HDR.pack(n, error, unique), payload] if error == 0 and payload
                      else [_OUT_HDR.pack(n, error, unique)])
        except OSError as e:  # ENOENT: the caller was interrupted and went away
            if e.errno not in (errno.ENOENT, errno.ENODEV):
                log.error("fuse reply: %s", e)

    def _handle(self, opcode: int, nodeid: int, body: memoryview) -> bytes:
        if opcode == READ:
            fh, offset, size, _ = _READ_IN.unpack_from(body)
            node = self._nodes.get(nodeid)
            if node is None:
                raise OSError(errno.EBADF, "stale node")
            if offset >= node.size:
                return b""
            data = self.source.read(node.name, offset, min(size, node.size - offset))
            if self.fast is not None and self._fast_source is not None:  # the next reads are answered in C
                for idx, fd in self._fast_source.chunk_fds(node.name, offset, len(data)):
                    self.fast.chunk(nodeid, idx, fd)
            return data
        if opcode == LOOKUP:
            name = bytes(body).split(b"\0", 1)[0].decode(errors="replace")
            size = self.source.lookup(name) if nodeid == ROOT_INO else None
            if size is None:
                raise OSError(errno.ENOENT, name)
            return self._entry(self._node_for(name, size), size)
        if opcode == GETATTR:
            if nodeid == ROOT_INO:
                return struct.pack("<QII", TTL_S, 0, 0) + self._attr(ROOT_INO, 0, True)
            node = self._nodes[nodeid]
            return struct.pack("<QII", TTL_S, 0, 0) + self._attr(nodeid, node.size, False)
        if opcode == OPEN:
            flags = struct.unpack_from("<I", body)[0]
            if flags & (os.O_WRONLY | os.O_RDWR):
                raise OSError(errno.EROFS, "read-only")
            backing_id = 0
            open_flags = self.open_flags
            if self.backing is not None and self._passthrough:
                path = self.backing(self._nodes[nodeid].name)
                if path is not None:
                    backing_id = self._backing_open(path)
                    open_flags |= FOPEN_PASSTHROUGH
            return _OPEN_OUT.pack(0, open_flags, backing_id)
        if opcode in (RELEASE, FLUSH, RELEASEDIR, ACCESS):
            return b""
        if opcode == OPENDIR:
            return _OPEN_OUT.pack(0, 0, 0)
        if opcode == READDIR:
            _, offset, size, _ = _READ_IN.unpack_from(body)
            return self._readdir(offset, size)
        if opcode == STATFS:
            return struct.pack("<QQQQQIIII24x", 0, 0, 0, 0, 0, 4096, 255, 4096, 0)
        if opcode == INIT:
            return self._init(body)
        if opcode == DESTROY:
            return b""
        raise OSError(errno.ENOSYS, f"opcode {opcode}")

    def _init(self, body: memoryview) -> bytes:
        major, minor, max_readahead, flags = struct.unpack_from("<IIII", body)
        if len(body) >= 20:
            flags |= struct.unpack_from("<I", body, 16)[0] << 32
        if major != 7:
            raise OSError(errno.EPROTO, f"FUSE protocol {major}.{minor}")
        want = _ASYNC_READ | _MAX_PAGES | _PARALLEL_DIROPS | _INIT_EXT
        stack_depth = 0
        if self.backing is not None and flags & _PASSTHROUGH:
            want |= _PASSTHROUGH
            stack_depth = 1
            self._passthrough = True
        got = flags & want
        return struct.pack("<IIIIHHIIHHII24x", 7, min(minor, 40), min(max_readahead, MAX_PAGES * 4096),
                           got & 0xFFFFFFFF, 16, 12, 128 * 1024, 1, MAX_PAGES, 0, got >> 32, stack_depth)

    def _backing_open(self, path: str) -> int:
        import fcntl

        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            arg = bytearray(struct.pack("<iIQ", fd, 0, 0))
            return fcntl.ioctl(self.fd, _FUSE_DEV_IOC_BACKING_OPEN, arg)
        finally:
            os.close(fd)

    def _readdir(self, offset: int, size: int) -> bytes:
        entries = [(ROOT_INO, ".", 4), (ROOT_INO, "..", 4)]
        for name in self.source.names():
            sz = self.source.lookup(name)
            if sz is not None:
                entries.append((self._node_for(name, sz), name, 8))
        out = bytearray()
        for i, (ino, name, typ) in enumerate(entries[offset:], offset + 1):
            raw = name.encode()
            ent = struct.pack("<QQII", ino, i, len(raw), typ) + raw
            ent += b"\0" * (-len(ent) % 8)
            if len(out) + len(ent) > size:
                break
            out += ent
        return bytes(out)


def unmount(path: Path) -> None:
    """Detach a FUSE mount (lazy): the server's reads then end with ENODEV."""
    if _libc.umount2(str(path).encode(), 2) != 0:
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOENT):
            raise OSError(err, f"umount {path}: {os.strerror(err)}")
