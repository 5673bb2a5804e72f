"""File access inside a sandbox from the host, confined to the sandbox root.

Every path is resolved with openat2(RESOLVE_IN_ROOT) against the sandbox's root directory
(/proc/<init>/root): `..` stops at the sandbox root and absolute symlinks are resolved as if the
sandbox root were `/`, so no path or symlink can reach a host file. The final component is opened
with O_NOFOLLOW where a symlink would be written through.
"""
from __future__ import annotations

import ctypes
import errno
import io
import os
import shutil
import stat
import tarfile
from pathlib import PurePosixPath

from ..core.contract import FileEntry, FileType, check_xattrs
from ..core.errors import FileOpError, InvalidArgument, PathOutsideSandbox

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_SYS_OPENAT2 = 437
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_IN_ROOT = 0x10


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def openat2(dirfd: int, path: str, flags: int, mode: int = 0,
            resolve: int = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS) -> int:
    # O_NOCTTY always: a terminal the sandbox planted at a path must never become the opener's
    # controlling terminal (a session leader such as shoald under systemd would then take its signals)
    # (openat2 refuses any flag beside O_PATH but O_CLOEXEC, O_DIRECTORY and O_NOFOLLOW)
    how = _OpenHow(flags | os.O_CLOEXEC | (0 if flags & os.O_PATH else os.O_NOCTTY), mode, resolve)
    fd = _libc.syscall(_SYS_OPENAT2, dirfd, path.encode("utf-8", "surrogateescape"), ctypes.byref(how),
                       ctypes.sizeof(how))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return fd


def _norm(path: str) -> str:
    if not isinstance(path, str) or not path:
        raise InvalidArgument(f"invalid sandbox path {path!r}")
    if "\0" in path:
        raise InvalidArgument("sandbox paths may not contain NUL bytes")
    return path


def _type(mode: int) -> FileType:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "other"


class SandboxFiles:
    """Files API over one sandbox root (a directory fd the caller keeps valid)."""

    def __init__(self, root_path: str, sandbox_id: str):
        self.root_path = root_path
        self.sandbox_id = sandbox_id

    def _root(self) -> int:
        try:
            return os.open(self.root_path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise FileOpError(f"sandbox {self.sandbox_id} root is not reachable: {e.strerror}") from e

    def _err(self, e: OSError, op: str, path: str) -> FileOpError | PathOutsideSandbox:
        if e.errno == 18:  # EXDEV: resolution tried to leave the root
            return PathOutsideSandbox(f"{op} {path!r}: path escapes the sandbox root")
        return FileOpError(f"{op} {path!r} in sandbox {self.sandbox_id}: {e.strerror}")

    def _open(self, path: str, flags: int, mode: int = 0) -> int:
        root = self._root()
        try:
            return openat2(root, _norm(path), flags, mode)
        except OSError as e:
            raise self._err(e, "open", path) from e
        finally:
            os.close(root)

    def _open_typed(self, path: str, flags: int, op: str, regular_only: bool = False) -> int:
        """Open a regular file (or a directory, unless `regular_only`) without ever opening anything
        else: the path is resolved to an O_PATH fd, its type checked, and only then reopened through
        /proc/self/fd. A FIFO, socket or device the sandbox planted is refused, never opened (a FIFO
        would hang the host, a terminal could become its controlling tty)."""
        pfd = self._open(path, os.O_PATH | (flags & os.O_NOFOLLOW))
        try:
            st = os.fstat(pfd)
            if stat.S_ISDIR(st.st_mode) and regular_only:
                raise FileOpError(f"{op} {path!r}: is a directory")
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                raise FileOpError(f"{op} {path!r}: not a regular file")
            try:
                return os.open(f"/proc/self/fd/{pfd}", (flags & ~os.O_NOFOLLOW) | os.O_NOCTTY | os.O_CLOEXEC)
            except OSError as e:
                raise self._err(e, op, path) from e
        finally:
            os.close(pfd)

    def _parent(self, path: str) -> tuple[int, str]:
        """An O_PATH fd of the parent directory (resolved in root) and the final name."""
        p = PurePosixPath(_norm(path))
        name = p.name
        if name in ("", ".", ".."):
            raise InvalidArgument(f"{path!r} does not name a file")
        return self._open(str(p.parent), os.O_PATH | os.O_DIRECTORY), name

    # ------------------------------------------------------------------ API
    def read(self, path: str, max_bytes: int = 64 << 20) -> bytes:
        fd = self._open_typed(path, os.O_RDONLY, "read", regular_only=True)
        try:
            chunks, total = [], 0
            while chunk := os.read(fd, 1 << 20):
                total += len(chunk)
                if total > max_bytes:
                    raise FileOpError(f"read {path!r}: larger than max_bytes={max_bytes}")
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def write(self, path: str, data: bytes | str, mode: int = 0o644, make_parents: bool = True) -> int:
        if isinstance(data, str):
            data = data.encode()
        if make_parents:
            self.mkdir(str(PurePosixPath(path).parent), parents=True)
        pfd, name = self._parent(path)
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
            fd = os.open(name, flags, mode, dir_fd=pfd)
        except OSError as e:
            raise self._err(e, "write", path) from e
        finally:
            os.close(pfd)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise FileOpError(f"write {path!r}: not a regular file")
            os.set_blocking(fd, True)
            os.ftruncate(fd, 0)
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
        except OSError as e:
            raise self._err(e, "write", path) from e
        finally:
            os.close(fd)
        return len(data)

    def mkdir(self, path: str, parents: bool = True, mode: int = 0o755) -> None:
        p = PurePosixPath(_norm(path))
        parts = [str(x) for x in ([p] if not parents else list(reversed(p.parents))[1:] + [p])]
        for part in parts:
            if part in ("/", "."):
                continue
            pfd, name = self._parent(part)
            try:
                os.mkdir(name, mode, dir_fd=pfd)
            except FileExistsError:
                # never follow here: an absolute symlink would be resolved against the host root
                st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
                if not (stat.S_ISDIR(st.st_mode) or stat.S_ISLNK(st.st_mode)):
                    raise FileOpError(f"mkdir {part!r}: exists and is not a directory") from None
            except OSError as e:
                raise self._err(e, "mkdir", part) from e
            finally:
                os.close(pfd)

    def stat(self, path: str) -> FileEntry:
        if PurePosixPath(path).name in ("", "/"):
            pfd, name = self._open("/", os.O_PATH | os.O_DIRECTORY), "."
        else:
            pfd, name = self._parent(path)
        try:
            st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
        except OSError as e:
            raise self._err(e, "stat", path) from e
        finally:
            os.close(pfd)
        return FileEntry(name=PurePosixPath(path).name or "/", path=path, type=_type(st.st_mode), size=st.st_size,
                         mode=stat.S_IMODE(st.st_mode), mtime=st.st_mtime, uid=st.st_uid, gid=st.st_gid,
                         xattrs=self._xattrs(path, st.st_mode), ctime=st.st_ctime)

    def _xattrs(self, path: str, mode: int) -> dict[str, str] | None:
        """user.* xattrs of a regular file or directory (never read through a symlink, a FIFO or a device)."""
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            return None
        try:
            fd = self._open_typed(path, os.O_RDONLY | os.O_NOFOLLOW, "stat")
        except (FileOpError, PathOutsideSandbox):
            return None
        try:
            names = [n for n in os.listxattr(fd) if n.startswith("user.")]
            return {n: os.getxattr(fd, n).decode("utf-8", "replace") for n in names} or None
        except OSError:
            return None
        finally:
            os.close(fd)

    def set_xattrs(self, path: str, attrs: dict[str, str]) -> None:
        check_xattrs(attrs)
        fd = self._open_typed(path, os.O_RDONLY | os.O_NOFOLLOW, "set_xattrs")
        try:
            for k, v in attrs.items():
                os.setxattr(fd, k, v.encode())
        except OSError as e:
            if e.errno == errno.EOPNOTSUPP:
                raise FileOpError(f"set_xattrs {path!r} in sandbox {self.sandbox_id}: its filesystem does not store "
                                  "user.* xattrs (a tmpfs upper before Linux 6.6)") from e
            raise self._err(e, "set_xattrs", path) from e
        finally:
            os.close(fd)

    def chown(self, path: str, uid: int, gid: int) -> None:
        """The owner of `path` (the final component is never followed: a planted symlink is chowned
        itself, not what it names)."""
        if not (0 <= uid < 1 << 31 and 0 <= gid < 1 << 31):
            raise InvalidArgument(f"uid and gid must be in [0, 2^31), got {uid}:{gid}")
        if PurePosixPath(path).name in ("", "/"):
            pfd, name = self._open("/", os.O_PATH | os.O_DIRECTORY), "."
        else:
            pfd, name = self._parent(path)
        try:
            os.chown(name, uid, gid, dir_fd=pfd, follow_symlinks=False)
        except OSError as e:
            raise self._err(e, "chown", path) from e
        finally:
            os.close(pfd)

    def exists(self, path: str) -> bool:
        try:
            self.stat(path)
            return True
        except FileOpError:
            return False

    def remove(self, path: str) -> None:
        pfd, name = self._parent(path)
        try:
            st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                # fd-relative all the way down (shutil's safe variant): a symlink planted in the tree is
                # unlinked, never followed, so nothing outside the sandbox root can be reached
                shutil.rmtree(name, dir_fd=pfd)
            else:
                os.unlink(name, dir_fd=pfd)
        except OSError as e:
            raise self._err(e, "remove", path) from e
        finally:
            os.close(pfd)

    # ------------------------------------------------------------------ tar transfer
    def download(self, path: str, max_bytes: int = 1 << 30) -> bytes:
        """A tar archive of `path` (file or directory tree) inside the sandbox; symlinks are not followed.

        `max_bytes` bounds the file content read (a sandbox can create huge sparse files for free)."""
        buf = io.BytesIO()
        budget = [max_bytes]
        with tarfile.open(fileobj=buf, mode="w") as tf:
            top = self.stat(path)
            self._add_tar(tf, path, PurePosixPath(path).name or ".", top, budget)
        return buf.getvalue()

    def _add_tar(self, tf: tarfile.TarFile, path: str, arcname: str, entry: FileEntry, budget: list[int]) -> None:
        info = tarfile.TarInfo(arcname)
        info.mode, info.mtime = entry.mode, int(entry.mtime)
        if entry.type == "dir":
            info.type = tarfile.DIRTYPE
            tf.addfile(info)
            for child in self.list(path):
                self._add_tar(tf, child.path, f"{arcname}/{child.name}", child, budget)
        elif entry.type == "symlink":
            pfd, name = self._parent(path)
            try:
                info.linkname = os.readlink(name, dir_fd=pfd)
            finally:
                os.close(pfd)
            info.type = tarfile.SYMTYPE
            tf.addfile(info)
        elif entry.type == "file":
            if entry.size > budget[0]:
                raise FileOpError(f"download: {path!r} would exceed max_bytes; download less or raise the limit")
            data = self.read(path, max_bytes=budget[0])
            budget[0] -= len(data)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))

    def upload(self, dest_dir: str, tar_bytes: bytes) -> int:
        """Extract a tar archive under `dest_dir` inside the sandbox; returns the number of entries."""
        self.mkdir(dest_dir, parents=True)
        count = 0
        try:
            tf = tarfile.open(fileobj=io.BytesIO(tar_bytes), mode="r:*")
        except tarfile.TarError as e:
            raise InvalidArgument(f"upload: not a tar archive ({e})") from e
        with tf:
            for m in tf:
                rel = PurePosixPath(m.name)
                if rel.is_absolute() or ".." in rel.parts:
                    raise PathOutsideSandbox(f"upload: archive member {m.name!r} leaves the destination")
                target = str(PurePosixPath(dest_dir) / rel)
                count += 1
                if m.isdir():
                    self.mkdir(target, parents=True, mode=m.mode & 0o7777 or 0o755)
                elif m.isfile():
                    f = tf.extractfile(m)
                    self.write(target, f.read() if f else b"", mode=m.mode & 0o7777 or 0o644)
                elif m.issym():
                    self.mkdir(str(PurePosixPath(target).parent), parents=True)
                    pfd, name = self._parent(target)
                    try:
                        os.symlink(m.linkname, name, dir_fd=pfd)
                    except OSError as e:
                        raise self._err(e, "symlink", target) from e
                    finally:
                        os.close(pfd)
                else:
                    raise InvalidArgument(f"upload: member {m.name!r} has an unsupported type")
        return count

    # last in the class body: a method named `list` shadows the builtin in the annotations after it
    def list(self, path: str = "/") -> list[FileEntry]:
        fd = self._open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            out = []
            for name in sorted(os.listdir(fd)):
                try:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                out.append(FileEntry(name=name, path=str(PurePosixPath(path) / name), type=_type(st.st_mode),
                                     size=st.st_size, mode=stat.S_IMODE(st.st_mode), mtime=st.st_mtime,
                                     uid=st.st_uid, gid=st.st_gid))
            return out
        finally:
            os.close(fd)
