"""File watching inside a container sandbox with inotify (`SandboxBackend.watch_dir`).

The watched directory is opened through the sandbox's root (/proc/<init>/root, which walks the sandbox's
own mount namespace) with openat2(RESOLVE_IN_ROOT), as the files API resolves paths, and the inotify
watch is added on that open directory (/proc/self/fd/N), so a symlink can never put a host directory
under watch. Subdirectories of a recursive watch are opened beneath it with RESOLVE_NO_SYMLINKS: a
symlink in the tree is reported as an entry but never followed.

Hostile callers: inotify's limits are per uid and a sandbox's root is the host's root, so every watch
here is charged against budgets this module keeps (watches per sandbox, watched directories per sandbox
and per process, both well under the kernel's per-uid limits). A tree with more directories than the
budget is refused at start (QuotaExceeded); one that grows past it later gets an `overflow` event.
Events are read from the kernel only while the reader's queue is empty, so what a watch holds in memory
is at most one read's worth; the kernel's own queue is bounded (fs.inotify.max_queued_events) and
reports IN_Q_OVERFLOW, passed on as an `overflow` event.
"""
from __future__ import annotations

import collections
import ctypes
import errno
import os
import posixpath
import select
import struct
import threading
import time
from dataclasses import dataclass

from ...core.contract import WATCH_QUEUE, WatchEvent, WatchHandle
from ...core.errors import FileOpError, InvalidArgument, PathOutsideSandbox, QuotaExceeded, SandboxNotFound
from ..files import RESOLVE_NO_MAGICLINKS, openat2
from ..pids import starttime

_libc = ctypes.CDLL(None, use_errno=True)
RESOLVE_NO_SYMLINKS, RESOLVE_BENEATH = 0x04, 0x08

IN_MODIFY, IN_ATTRIB, IN_MOVED_FROM, IN_MOVED_TO = 0x2, 0x4, 0x40, 0x80
IN_CREATE, IN_DELETE, IN_DELETE_SELF, IN_MOVE_SELF = 0x100, 0x200, 0x400, 0x800
IN_UNMOUNT, IN_Q_OVERFLOW, IN_IGNORED = 0x2000, 0x4000, 0x8000
IN_ONLYDIR, IN_EXCL_UNLINK, IN_ISDIR = 0x1000000, 0x4000000, 0x40000000
MASK = (IN_MODIFY | IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_DELETE_SELF
        | IN_MOVE_SELF | IN_ONLYDIR | IN_EXCL_UNLINK)
_HEAD = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (then the name, NUL-padded)
READ_BYTES = 64 << 10  # one read from the kernel: at most 4096 events
SCAN_REFILL_S = 10.0  # a watch's scans list scan_entries entries per this many seconds at most


def _kernel_limit(name: str, default: int) -> int:
    try:
        with open(f"/proc/sys/fs/inotify/{name}") as f:
            return int(f.read())
    except (OSError, ValueError):
        return default


@dataclass
class WatchLimits:
    """What watches may take. The per-process caps stay at a quarter of the kernel's per-uid limits,
    which every root process on the host (and every sandbox, whose root is the host's) shares."""

    per_sandbox: int = 16  # open watches (inotify instances) per sandbox
    dirs_per_sandbox: int = 8192  # watched directories per sandbox, all its watches together
    scan_entries: int = 200_000  # entries a recursive watch may list when it starts (a huge tree costs time)
    instances: int = max(4, _kernel_limit("max_user_instances", 128) // 4)  # per process
    dirs: int = max(64, _kernel_limit("max_user_watches", 8192) // 4)  # per process


_lock = threading.Lock()
_by_sandbox: dict[str, list[int]] = {}  # sandbox id -> [watches, directories]
_total = [0, 0]  # this process: [watches, directories]


class ContainerWatch(WatchHandle):
    """One inotify instance watching a directory (and its subdirectories) of one sandbox."""

    def __init__(self, sandbox_id: str, pid: int, start: int | None, path: str, recursive: bool,
                 limits: WatchLimits):
        if not isinstance(path, str) or not path or "\0" in path:
            raise InvalidArgument(f"invalid sandbox path {path!r}")
        self.sandbox_id, self.recursive, self.limits = sandbox_id, bool(recursive), limits
        self.path = posixpath.normpath("/" + path.lstrip("/"))  # how events name it; resolved as given (below)
        self._given = path
        self._capped = False  # a cap stopped the watch from following new directories (reported once)
        self._lost = 0  # events dropped since the last read because the queue was full
        # what the scans of new directories may still list (a token bucket: a sandbox renaming a big
        # directory to and fro would otherwise have the host list it again for every rename)
        self._scan_budget, self._scan_t = float(limits.scan_entries), time.monotonic()
        self.scanned = 0  # entries listed by this watch's scans, in all
        self._starved = False  # the budget ran out (reported once until it refills)
        self._pending: collections.deque[WatchEvent] = collections.deque()
        self._wds: dict[int, str] = {}  # watch descriptor -> directory, relative to the watched one ("" = it)
        self._ended = self._closed = False
        self._read_lock = threading.Lock()
        self._fds: list[int] = []
        self._charged = False
        with _lock:
            mine = _by_sandbox.setdefault(sandbox_id, [0, 0])
            if mine[0] >= limits.per_sandbox:
                raise QuotaExceeded(f"sandbox {sandbox_id} has {mine[0]} file watches open (the limit); "
                                    "close one first")
            if _total[0] >= limits.instances:
                raise QuotaExceeded(f"this host has {_total[0]} file watches open (its limit, a quarter of "
                                    "fs.inotify.max_user_instances); try again later")
            mine[0] += 1
            _total[0] += 1
            self._charged = True
        try:
            self._open(pid, start)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ setup
    def _open(self, pid: int, start: int | None) -> None:
        try:
            self._pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            raise SandboxNotFound(f"sandbox {self.sandbox_id} has ended") from None
        self._fds.append(self._pidfd)
        if start is None or starttime(pid) != start:  # checked after opening: a reused pid cannot slip in
            raise SandboxNotFound(f"sandbox {self.sandbox_id} has ended")
        # the sandbox's root is held, not the watched directory: an open fd on it would keep its inode
        # alive after an rm -rf, and the kernel reports IN_DELETE_SELF only when the last reference goes
        self._root = os.open(f"/proc/{pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        self._fds.append(self._root)
        try:
            top = openat2(self._root, self._given, os.O_PATH | os.O_DIRECTORY)
        except OSError as e:
            if e.errno == errno.EXDEV:
                raise PathOutsideSandbox(f"watch {self.path!r}: path escapes the sandbox root") from None
            if e.errno == errno.ENOTDIR:
                raise FileOpError(f"watch {self.path!r} in sandbox {self.sandbox_id}: not a directory") from None
            raise FileOpError(f"watch {self.path!r} in sandbox {self.sandbox_id}: {e.strerror}") from None
        st = os.fstat(top)
        os.close(top)
        self._ident = (st.st_dev, st.st_ino)
        self._ifd = _libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self._ifd < 0:
            err = ctypes.get_errno()
            raise QuotaExceeded(f"inotify_init1: {os.strerror(err)} (the host's inotify instances are used up)")
        self._fds.append(self._ifd)
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._fds.append(self._wake)
        if not self._add("", strict=True):
            raise FileOpError(f"watch {self.path!r} in sandbox {self.sandbox_id}: the directory went away")
        if self.recursive:
            self._walk("", emit=False, strict=True)

    def _charge(self, strict: bool) -> bool:
        """Count one more watched directory; False (or QuotaExceeded when `strict`) past a cap."""
        with _lock:
            mine = _by_sandbox.setdefault(self.sandbox_id, [0, 0])
            over = (f"sandbox {self.sandbox_id} watches {mine[1]} directories (the limit)"
                    if mine[1] >= self.limits.dirs_per_sandbox else
                    f"this host watches {_total[1]} directories (its limit)" if _total[1] >= self.limits.dirs else "")
            if not over:
                mine[1] += 1
                _total[1] += 1
                return True
        if strict:
            raise QuotaExceeded(f"watch {self.path!r}: {over}; watch a smaller tree or not recursively")
        if not self._capped:
            self._capped = True
            self._pending.append(WatchEvent(type="overflow", detail=over + ": new subdirectories are not followed"))
        return False

    def _uncharge(self, n: int) -> None:
        with _lock:
            mine = _by_sandbox.get(self.sandbox_id)
            if mine is not None:
                mine[1] -= n
            _total[1] -= n

    def _dirfd(self, rel: str, flags: int) -> int:
        """A directory of the watched tree: the watched directory found again in the sandbox (it must
        still be the same one), then `rel` beneath it without following any symlink."""
        top = openat2(self._root, self._given, os.O_PATH | os.O_DIRECTORY)
        try:
            st = os.fstat(top)
            if (st.st_dev, st.st_ino) != self._ident:
                raise FileNotFoundError(errno.ENOENT, "the watched directory was replaced")
            return openat2(top, rel or ".", flags | os.O_DIRECTORY,
                           resolve=RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)
        finally:
            os.close(top)

    def _add(self, rel: str, strict: bool = False) -> bool:
        if not self._charge(strict):
            return False
        try:
            fd = self._dirfd(rel, os.O_PATH)
        except OSError:
            self._uncharge(1)  # gone already, or a symlink: nothing to watch
            return False
        try:
            wd = _libc.inotify_add_watch(self._ifd, f"/proc/self/fd/{fd}".encode(), MASK)
            err = ctypes.get_errno()
        finally:
            os.close(fd)
        if wd < 0:
            self._uncharge(1)
            if strict or err != errno.ENOSPC:
                if strict:
                    raise QuotaExceeded(f"watch {self.path!r}: inotify_add_watch: {os.strerror(err)}")
                return False
            self._pending.append(WatchEvent(type="overflow", detail="the host's inotify watches are used up"))
            return False
        if wd in self._wds:  # the same directory again (inotify keeps one watch per inode)
            self._uncharge(1)
        self._wds[wd] = rel
        return True

    def _walk(self, rel: str, emit: bool, strict: bool = False) -> None:
        """Watch every directory below `rel` (breadth first); `emit`: report what is already there as
        created (a directory that appeared with content before its watch was added)."""
        queue, scanned = collections.deque([rel]), 0
        now = time.monotonic()
        self._scan_budget = min(float(self.limits.scan_entries), self._scan_budget
                                + (now - self._scan_t) * self.limits.scan_entries / SCAN_REFILL_S)
        self._scan_t = now
        if self._scan_budget > 0:
            self._starved = False
        while queue:
            d = queue.popleft()
            try:
                fd = self._dirfd(d, os.O_RDONLY)
            except OSError:
                continue
            try:
                with os.scandir(fd) as it:
                    for e in it:
                        scanned += 1
                        self.scanned += 1
                        if not strict:
                            self._scan_budget -= 1
                            if self._scan_budget < 0:
                                if self._starved:
                                    return
                                self._starved = True
                                self._pending.append(WatchEvent(
                                    type="overflow", detail="new directories arrive faster than the watch may scan "
                                    f"them ({self.limits.scan_entries} entries per {SCAN_REFILL_S:g} s): "
                                    "their subdirectories are not followed"))
                                return
                        if scanned > self.limits.scan_entries:
                            msg = (f"watch {self.path!r}: more than {self.limits.scan_entries} entries "
                                   "below it; watch a smaller tree or not recursively")
                            if strict:
                                raise QuotaExceeded(msg)
                            self._pending.append(WatchEvent(type="overflow", detail=msg))
                            return
                        sub = posixpath.join(d, e.name)
                        is_dir = e.is_dir(follow_symlinks=False)
                        if emit:  # (and written, if it has content: its writes came before the watch)
                            self._emit("create", sub, is_dir)
                            if e.is_file(follow_symlinks=False) and e.stat(follow_symlinks=False).st_size:
                                self._emit("write", sub)
                        if is_dir and self._add(sub, strict):
                            queue.append(sub)
            except OSError:
                continue
            finally:
                os.close(fd)

    # ------------------------------------------------------------------ events
    def _emit(self, kind: str, rel: str, is_dir: bool = False, dest: str | None = None) -> WatchEvent:
        ev = WatchEvent.model_validate({"type": kind, "path": posixpath.join(self.path, rel) if rel else self.path,
                                        "name": rel, "is_dir": is_dir, "dest": dest})
        # bounded as it fills, not after: the scan of one new directory may find 200 000 entries
        if len(self._pending) < WATCH_QUEUE:
            self._pending.append(ev)
        else:
            self._lost += 1
        return ev

    def _end(self, detail: str) -> None:
        if not self._ended:
            self._ended = True
            self._pending.append(WatchEvent(type="end", detail=detail))

    def _drop_below(self, rel: str) -> None:
        """Stop watching `rel` and everything under it (moved out of the tree or away)."""
        gone = [wd for wd, r in self._wds.items() if r == rel or r.startswith(rel + "/")]
        for wd in gone:
            del self._wds[wd]
            _libc.inotify_rm_watch(self._ifd, wd)
        if gone:
            self._uncharge(len(gone))

    def _translate(self, buf: bytes) -> None:
        renames: dict[int, WatchEvent] = {}
        off = 0
        while off + _HEAD.size <= len(buf):
            wd, mask, cookie, n = _HEAD.unpack_from(buf, off)
            name = buf[off + _HEAD.size: off + _HEAD.size + n].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            off += _HEAD.size + n
            if mask & IN_Q_OVERFLOW:
                self._pending.append(WatchEvent(type="overflow", detail="the kernel's event queue overflowed "
                                                                        "(fs.inotify.max_queued_events)"))
                continue
            base = self._wds.get(wd)
            if base is None:
                continue  # a watch removed meanwhile
            if mask & IN_IGNORED:
                del self._wds[wd]
                self._uncharge(1)
                if base == "":
                    self._end("the watched directory is gone")
                continue
            if mask & (IN_DELETE_SELF | IN_MOVE_SELF | IN_UNMOUNT):
                if base == "":
                    self._end("the watched directory was " + ("moved" if mask & IN_MOVE_SELF else "removed"))
                continue  # a subdirectory's own removal is reported by its parent's watch
            rel = posixpath.join(base, name) if base else name
            is_dir = bool(mask & IN_ISDIR)
            if mask & IN_CREATE:
                self._emit("create", rel, is_dir)
                if is_dir and self.recursive and self._add(rel):
                    self._walk(rel, emit=True)  # what was made inside before the watch existed
            if mask & IN_MODIFY:
                self._emit("write", rel, is_dir)
            if mask & IN_ATTRIB:
                self._emit("chmod", rel, is_dir)
            if mask & IN_DELETE:
                self._emit("remove", rel, is_dir)
            if mask & IN_MOVED_FROM:
                renames[cookie] = self._emit("rename", rel, is_dir)
                if is_dir and self.recursive:
                    self._drop_below(rel)
            if mask & IN_MOVED_TO:
                old = renames.pop(cookie, None)
                if old is not None:
                    old.dest = posixpath.join(self.path, rel)
                self._emit("create", rel, is_dir)
                if is_dir and self.recursive and self._add(rel):
                    self._walk(rel, emit=False)

    def read(self, timeout: float = 1.0, max_events: int = 1024) -> list[WatchEvent]:
        if not isinstance(max_events, int) or max_events < 1:
            raise InvalidArgument(f"max_events must be a positive integer, not {max_events!r}")
        with self._read_lock:
            if self._closed:
                return []
            if not self._pending and not self._ended:
                self._fill(max(0.0, timeout))
            out: list[WatchEvent] = []
            while self._pending and len(out) < max_events:
                out.append(self._pending.popleft())
            return out

    def _fill(self, timeout: float) -> None:
        p = select.poll()
        for fd in (self._ifd, self._pidfd, self._wake):
            p.register(fd, select.POLLIN)
        for fd, _ in p.poll(timeout * 1000):
            if fd == self._pidfd:
                self._end(f"sandbox {self.sandbox_id} has ended")
            elif fd == self._ifd:
                try:
                    buf = os.read(self._ifd, READ_BYTES)
                except BlockingIOError:
                    continue
                self._translate(buf)
        if self._lost:  # a burst of new subdirectories listed at once
            self._pending.append(WatchEvent(type="overflow", detail=f"{self._lost} events dropped (queue full)"))
            self._lost = 0

    @property
    def queued(self) -> int:
        """Events waiting for the reader (bounded: what one read from the kernel yields, at most)."""
        return len(self._pending)

    @property
    def watched_dirs(self) -> int:
        return len(self._wds)

    @property
    def ended(self) -> bool:
        return self._closed or (self._ended and not self._pending)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if getattr(self, "_wake", None) is not None:
            os.eventfd_write(self._wake, 1)  # wake a read blocked in poll
        with self._read_lock:
            for fd in self._fds:
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._fds.clear()
            self._pending.clear()
            n, self._wds = len(self._wds), {}
        if n:
            self._uncharge(n)
        if self._charged:
            self._charged = False
            with _lock:
                mine = _by_sandbox.get(self.sandbox_id)
                if mine is not None:
                    mine[0] -= 1
                    if mine == [0, 0]:
                        del _by_sandbox[self.sandbox_id]
                _total[0] -= 1

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


