"""The container backend: namespaces + cgroups + overlayfs over shared EROFS layer mounts.

How a sandbox comes to life (see docs/architecture.md):
 1. the layer store mounts each layer of the image once per host (file-backed EROFS);
 2. this module creates the sandbox's cgroups (v1 or v2) and its state directory;
 3. `shoal-init launch` (C) starts a supervisor that mounts a size-capped tmpfs for the writable
    upper (with upper="disk": uses the ext4 loop mount made here instead) and clones the sandbox
    init into new namespaces; init mounts overlayfs (lowers = layer mounts, upper = tmpfs or ext4),
    /proc, /dev, pivots, hardens itself and serves exec requests on a Unix socket that only the
    host can reach;
 4. when init dies (kill, TTL, crash) the supervisor releases the tmpfs, cgroups and state dir and
    leaves a tombstone saying why. If the supervisor itself died, `sweep()` does the same.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import secrets
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from ...core.contract import (
    PORT_CONNECT_TIMEOUT,
    ExecRequest,
    ExecResult,
    Limits,
    NetworkPolicy,
    NetworkRequest,
    OutputCallback,
    PortSocket,
    ReclaimRequest,
    ReclaimResult,
    SandboxInfo,
    SandboxSpec,
    SandboxState,
    SessionRequest,
    StartRequest,
    TimeoutRequest,
    WatchHandle,
    check_seconds,
    to_ms,
)
from ...core.errors import InvalidArgument, QuotaExceeded, SandboxError, SandboxNotFound, SandboxOutOfMemory
from ..files import SandboxFiles
from ..local import LocalBackend
from ..pids import alive, starttime
from . import initclient, ksm
from .cgroups import CgroupDriver, cgroup_parent
from .native import helper_path
from .processes import ContainerProcess, ContainerSession
from .templates import ensure_empty_dir, ensure_mntns_template, ensure_sysfs_template

if TYPE_CHECKING:
    from ...host import Host

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
STARTUP_GRACE_S = 30.0
# committed() lists the state dirs (O(live sandboxes)) at most this often; own creates/removals in between
COMMITTED_RESCAN_S = 1.0
HOST_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
BUILD_CA_PATH = "/run/shoal-build/ca.crt"  # where build sandboxes see the host's CA bundle


# ------------------------------------------------------------------ upper = "disk"
# mke2fs options of a disk upper: no journal (the upper dies with the sandbox, nothing to recover),
# no reserved blocks (disk_mb is the sandbox's, not root's), lazy inode tables (a sparse image of
# ~0.4 MB until written), one inode per 8 KiB (a tmpfs has many; small files are common in repos).
_MKE2FS_OPTS = ["-q", "-F", "-t", "ext4", "-O", "^has_journal", "-m", "0", "-i", "8192",
                "-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard"]


def _upper_template(root: Path, disk_mb: int) -> Path:
    """An empty ext4 image of disk_mb MiB, made once per size and copied (sparse) per sandbox."""
    tpl = root / "uppers" / f"template-ext4-{disk_mb}m.img"
    if tpl.exists():
        return tpl
    tpl.parent.mkdir(parents=True, exist_ok=True)
    mkfs = shutil.which("mkfs.ext4") or shutil.which("mke2fs")
    if not mkfs:
        raise SandboxError("upper='disk' needs mkfs.ext4 (Debian package e2fsprogs)")
    tmp = tpl.with_name(f".{tpl.name}.{os.getpid()}.{threading.get_ident()}")
    with open(tmp, "wb") as f:
        f.truncate(disk_mb << 20)
    proc = subprocess.run([mkfs, *_MKE2FS_OPTS, str(tmp)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise SandboxError(f"mkfs.ext4 for a {disk_mb} MiB disk upper failed: {proc.stderr.strip()[:500]}")
    os.replace(tmp, tpl)
    return tpl


def _sparse_copy(src: Path, dst: Path) -> None:
    """Copy only the data extents of src (SEEK_DATA/SEEK_HOLE); holes stay holes."""
    with open(src, "rb") as s, open(dst, "wb") as o:
        size = os.fstat(s.fileno()).st_size
        os.ftruncate(o.fileno(), size)
        off = 0
        while off < size:
            try:
                data = os.lseek(s.fileno(), off, os.SEEK_DATA)
            except OSError:  # ENXIO: only a hole is left
                break
            hole = os.lseek(s.fileno(), data, os.SEEK_HOLE)
            pos = data
            while pos < hole:
                n = os.copy_file_range(s.fileno(), o.fileno(), hole - pos, pos, pos)
                if n <= 0:
                    raise OSError(f"copy_file_range stopped at {pos} of {src}")
                pos += n
            off = hole


_LOOP_CTL_GET_FREE, _LOOP_CONFIGURE, _LO_FLAGS_AUTOCLEAR = 0x4C82, 0x4C0A, 4
_MS_NOSUID, _MS_NODEV = 2, 4


def _loop_mount_ext4(img: Path, target: Path) -> None:
    """Attach img to a free loop device (LOOP_CONFIGURE, autoclear) and mount it as ext4: what
    `mount -o loop` does, without two process spawns per sandbox."""
    import ctypes
    import fcntl
    import struct

    libc = ctypes.CDLL(None, use_errno=True)
    backing = os.open(img, os.O_RDWR | os.O_CLOEXEC)
    try:
        ctl = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
        try:
            for _ in range(64):  # another process may take the same free device first: EBUSY, retry
                n = fcntl.ioctl(ctl, _LOOP_CTL_GET_FREE)
                dev = f"/dev/loop{n}"
                loop = os.open(dev, os.O_RDWR | os.O_CLOEXEC)
                try:
                    # struct loop_config: fd, block_size, loop_info64 (lo_flags at offset 52), reserved
                    cfg = bytearray(304)
                    struct.pack_into("=II", cfg, 0, backing, 0)
                    struct.pack_into("=I", cfg, 8 + 52, _LO_FLAGS_AUTOCLEAR)
                    try:
                        fcntl.ioctl(loop, _LOOP_CONFIGURE, bytes(cfg))
                    except OSError as e:
                        if e.errno == 16:  # EBUSY
                            continue
                        raise
                    if libc.mount(dev.encode(), str(target).encode(), b"ext4", _MS_NOSUID | _MS_NODEV, None) != 0:
                        err = ctypes.get_errno()
                        raise OSError(err, f"mount {dev} (ext4) on {target}: {os.strerror(err)}")
                    return  # closing our fd now is fine: the mount holds the device; autoclear frees it later
                finally:
                    os.close(loop)
            raise OSError("no free loop device after 64 tries")
        finally:
            os.close(ctl)
    finally:
        os.close(backing)


def _bind(src: Path, target: Path) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(str(src).encode(), str(target).encode(), None, 4096, None) != 0:  # MS_BIND
        err = ctypes.get_errno()
        raise OSError(err, f"bind {src} on {target}: {os.strerror(err)}")


def mount_disk_upper(root: Path, sandbox_id: str, disk_mb: int, target: Path) -> None:
    """Mount a fresh ext4 file system of disk_mb MiB (on a loop device, image under the Shoal root)
    at target. The image is unlinked at once: the loop device (autoclear) holds it, so unmounting
    the last reference frees device and space, and a crash cannot leave an image file behind."""
    img = root / "uppers" / f"{sandbox_id}.img"
    _sparse_copy(_upper_template(root, disk_mb), img)
    try:
        try:
            _loop_mount_ext4(img, target)
        except OSError as e:  # e.g. a kernel without LOOP_CONFIGURE (< 5.8): let mount(8) do it
            proc = subprocess.run(["mount", "-t", "ext4", "-o", "loop,nosuid,nodev", str(img), str(target)],
                                  capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise SandboxError(f"sandbox {sandbox_id}: mounting its disk upper failed: {e}; "
                                   f"mount(8): {proc.stderr.strip()}") from None
    finally:
        img.unlink(missing_ok=True)


class ContainerBackend(LocalBackend):
    """Sandboxes as Linux containers: namespaces + cgroups + overlayfs, run by a small C init."""

    name = "container"
    id_prefix = "sb"

    def __init__(self, host: Host, max_sandboxes: int = 4096):
        if os.geteuid() != 0:
            raise SandboxError("the container backend needs root (mounts, namespaces, cgroups)")
        super().__init__(host)
        settings = self.settings
        self.max_sandboxes = max_sandboxes
        for d in (settings.sandboxes_dir, settings.tombstones_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.cgroups = CgroupDriver.detect(parent=cgroup_parent(settings.root))
        self.cgroups.cpu_quota = settings.cpu_quota
        self.cgroups.prepare_parent(owner=settings.root)
        self.cgroups.configure_pools(settings.root / "mempools", settings.sandboxes_dir, settings.memory_pool_size,
                                     swap=settings.sandbox_swap)
        self.bound_sandboxes_memory()
        self.helper = str(helper_path(settings.root / "bin"))
        self.ksm_host = ksm.KsmHost(ksm.KsmConfig.from_settings(settings.extra))
        self._meta: dict[str, dict] = {}
        self._limits: dict[str, Limits] = {}  # committed()'s cache
        self._limits_scanned = float("-inf")  # when committed() last listed the state dirs
        self._lock = threading.Lock()

    def bound_sandboxes_memory(self, limit_mb: int | None = None) -> int | None:
        """Limit all of this root's sandboxes together (density.sandboxes_memory_mb, default RAM minus
        density.memory_reserve_mb): a full host then OOM-kills inside sandboxes, never shoald or the
        host. Returns the limit set (MiB), None if the kernel refused it (logged, not fatal)."""
        from ...config import sandboxes_memory_limit_mb

        mb = limit_mb or sandboxes_memory_limit_mb(self.settings)
        try:
            self.cgroups.set_parent_memory_limit(mb)
        except SandboxError as e:
            import logging

            logging.getLogger("shoal").warning("%s; sandboxes are bounded only one by one", e)
            return None
        return mb

    # ------------------------------------------------------------------ state
    def _dir(self, sandbox_id: str) -> Path:
        if not isinstance(sandbox_id, str) or not sandbox_id or "/" in sandbox_id or sandbox_id.startswith(".") \
                or len(sandbox_id) > 64:
            raise SandboxNotFound(f"invalid sandbox id {sandbox_id!r}")
        return self.settings.sandboxes_dir / sandbox_id

    def sock_path(self, sandbox_id: str) -> str:
        return str(self._dir(sandbox_id) / "agent.sock")

    def _load(self, sandbox_id: str) -> dict:
        meta = self._meta.get(sandbox_id)
        if meta is not None:
            return meta
        try:
            meta = json.loads((self._dir(sandbox_id) / "meta.json").read_text())
        except (FileNotFoundError, NotADirectoryError):
            raise self._gone(sandbox_id) from None
        except ValueError as e:
            raise SandboxError(f"sandbox {sandbox_id}: unreadable state ({e})") from e
        if meta.get("init_pid"):
            self._meta[sandbox_id] = meta
        return meta

    def state_dir_count(self) -> int:
        """Sandbox state dirs on this root (every process's): O(1) from the directory's link count
        (2 + subdirectories on ext4, tmpfs, xfs) where a listing is O(live sandboxes); a file system
        that does not count (btrfs, a merged overlayfs dir: 1) gets the listing."""
        n = os.stat(self.settings.sandboxes_dir).st_nlink
        return n - 2 if n >= 2 else len(os.listdir(self.settings.sandboxes_dir))

    def _gone_message(self, sandbox_id: str) -> str:
        tomb = self.settings.tombstones_dir / sandbox_id
        if tomb.exists():
            reason = tomb.read_text().strip() or "exited"
            explain = {"ttl": "its absolute TTL expired", "idle_ttl": "its idle TTL expired",
                       "killed": "it was killed"}.get(reason) or _explain_oom(reason) or reason
            return f"sandbox {sandbox_id} no longer exists: {explain}"
        return f"sandbox {sandbox_id} not found"

    def _gone(self, sandbox_id: str) -> SandboxNotFound:
        """The error for a sandbox that ended: SandboxOutOfMemory when its tombstone says oom."""
        msg = self._gone_message(sandbox_id)
        return SandboxOutOfMemory(msg) if "ran out of memory" in msg else SandboxNotFound(msg)

    def _live_meta(self, sandbox_id: str) -> dict:
        meta = self._load(sandbox_id)
        if not alive(meta.get("init_pid"), meta.get("init_start")):
            self._meta.pop(sandbox_id, None)
            raise self._gone(sandbox_id)
        return meta

    def _write_meta(self, meta: dict) -> None:
        d = self._dir(meta["id"])
        tmp = d / "meta.json.tmp"
        tmp.write_text(json.dumps(meta))
        os.replace(tmp, d / "meta.json")

    # ------------------------------------------------------------------ lifecycle
    def launch(self, spec: SandboxSpec, lower_dirs: list[Path]) -> SandboxInfo:
        """Start a sandbox. `lower_dirs` are the mounted layers, bottom -> top."""
        if not lower_dirs:
            raise InvalidArgument("a sandbox needs at least one mounted layer")
        marks = [("start", time.monotonic())]  # launch_phases(): where a create spends its time
        if self.state_dir_count() >= self.max_sandboxes:  # all processes on this host
            raise QuotaExceeded(f"host sandbox limit reached ({self.max_sandboxes}); kill some or retry later")
        if spec.ksm and (why := ksm.probe(self.helper)) != "ok":
            raise InvalidArgument(f"ksm=True is not available on this host: {why}")
        if spec.ksm:
            self.ksm_host.ensure_running()
        sysfs = ensure_sysfs_template(self.helper) if spec.network != "host" else None
        empty_dir = ensure_empty_dir()
        # builds (host network) bind host files into the root: they keep pivot_root
        mntns = ensure_mntns_template(self.helper) if spec.network != "host" else None
        sandbox_id = f"{self.id_prefix}-{self.settings.host_tag}-{secrets.token_hex(6)}"
        d = self._dir(sandbox_id)
        d.mkdir()
        marks.append(("checks", time.monotonic()))
        started: dict = {}  # what _launch_in got to: the partial sandbox to take down if it fails
        try:
            return self._launch_in(spec, lower_dirs, sandbox_id, d, sysfs, empty_dir, mntns, started, marks)
        except BaseException as e:
            self._abandon(sandbox_id, started)
            # the step may have wrapped it (cgroups: SandboxError from the OSError)
            cause = e if isinstance(e, OSError) else e.__cause__
            if isinstance(cause, OSError) and cause.errno in (errno.EMFILE, errno.ENFILE):
                nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
                raise QuotaExceeded(f"sandbox {sandbox_id} could not start: {cause.strerror} in the process that "
                                    f"creates it (RLIMIT_NOFILE {nofile}); close sessions or raise the "
                                    "limit") from e
            raise

    def _abandon(self, sandbox_id: str, started: dict) -> None:
        """Take down a create that failed part-way, with no file descriptor to spare (it may have failed
        for want of one): SIGKILL its init if the helper started it, wait for the supervisor, then
        release the cgroups and the state dir."""
        with self._lock:
            self._meta.pop(sandbox_id, None)
        init_pid, sup_pid = started.get("init_pid"), started.get("sup_pid")
        if init_pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(init_pid, signal.SIGKILL)
            with contextlib.suppress(OSError):  # a new sandbox is frozen only by a pause racing this
                if self.cgroups.is_frozen(sandbox_id):
                    self.cgroups.freeze(sandbox_id, False)
        deadline = time.monotonic() + 5.0
        while sup_pid and time.monotonic() < deadline:
            try:
                os.kill(sup_pid, 0)  # no /proc read: that needs a descriptor
            except ProcessLookupError:
                break
            time.sleep(0.005)
        self._cleanup(sandbox_id)

    def _launch_in(self, spec: SandboxSpec, lower_dirs: list[Path], sandbox_id: str, d: Path,
                   sysfs: Path | None, empty_dir: Path, mntns: Path | None, started: dict,
                   marks: list[tuple[str, float]]) -> SandboxInfo:
        (d / "rootfs").mkdir()
        (d / "disk").mkdir()
        limits = spec.limits
        meta = {"id": sandbox_id, "image": spec.image, "layers": list(spec.layers), "limits": limits.model_dump(),
                "created": time.time(), "ttl": spec.ttl, "idle_ttl": spec.idle_ttl, "env": spec.env,
                "base_env": spec.base_env,
                "hostname": spec.hostname or sandbox_id, "workdir": spec.workdir, "network": spec.network,
                "ksm": spec.ksm, "aslr": spec.aslr, "priority": spec.priority}
        self._write_meta(meta)
        marks.append(("meta", time.monotonic()))
        try:
            self.cgroups.create(sandbox_id, limits)
            if spec.priority == "idle":
                self.cgroups.set_cpu_idle(sandbox_id, True)
            if self.settings.sandbox_swap > 0:  # [density] sandbox_swap: swap under its own pressure
                mem = limits.memory_mb << 20
                self.cgroups.allow_swap(sandbox_id, mem, int(mem * self.settings.sandbox_swap))
        except Exception:
            _remove_state_dir(d)
            raise
        marks.append(("cgroup_dirs", time.monotonic()))
        if limits.upper == "disk":
            try:
                mount_disk_upper(self.settings.root, sandbox_id, limits.disk_mb, d / "disk")
            except Exception:
                self._cleanup(sandbox_id)
                raise
        # overlayfs wants the top-most lower first
        lower = ":".join(str(p) for p in reversed(lower_dirs))
        cmd: list[str] = [self.helper, "launch", "--state", str(d), "--lower", lower,
                          "--hostname", str(meta["hostname"]), "--disk-mb", str(limits.disk_mb),
                          "--empty-dir", str(empty_dir),
                          "--tombstone", str(self.settings.tombstones_dir / sandbox_id)]
        cmd += self.cgroups.helper_args(sandbox_id) + ["--oom-kill", limits.oom_kill]
        if limits.upper == "disk":
            cmd += ["--upper", "mounted"]
        if spec.network == "host":  # the host's netns: a fresh sysfs mount finds the host's superblock
            cmd += ["--net", "host"]
            if os.path.isfile(HOST_CA_BUNDLE):
                cmd += ["--ca-bundle", HOST_CA_BUNDLE]
        else:
            cmd += ["--sysfs", str(sysfs)]
        if mntns:
            cmd += ["--mntns", str(mntns)]
        if spec.ttl:
            cmd += ["--ttl-ms", str(to_ms(spec.ttl))]
        if spec.idle_ttl:
            cmd += ["--idle-ttl-ms", str(to_ms(spec.idle_ttl))]
        if spec.ksm:
            cmd += ["--ksm", "1"]
        if not spec.aslr:
            cmd += ["--aslr", "0"]
        # env={}: nothing of the host environment may leak into init (/proc/1/environ)
        marks.append(("args", time.monotonic()))
        proc = subprocess.run(cmd, capture_output=True, stdin=subprocess.DEVNULL, env={})
        returned = time.monotonic()
        line = proc.stdout.decode(errors="replace").strip()
        if proc.returncode != 0 or not line.startswith("OK "):
            self._cleanup(sandbox_id)
            detail = line[4:] if line.startswith("ERR ") else (line or proc.stderr.decode(errors="replace").strip())
            raise SandboxError(f"sandbox {sandbox_id} failed to start: {detail}")
        fields = line.split()
        init_pid, sup_pid = int(fields[1]), int(fields[2])
        started.update(init_pid=init_pid, sup_pid=sup_pid)
        meta.update(init_pid=init_pid, sup_pid=sup_pid, init_start=starttime(init_pid), sup_start=starttime(sup_pid))
        if len(fields) > 3 and fields[3].isdigit():  # the supervisor holds the upper as a detached mount on this fd
            meta["upper_fd"] = int(fields[3])
        helper_marks = next((f[2:] for f in fields[3:] if f.startswith("t=")), "")
        meta["launch_ms"] = launch_phases_ms(marks + parse_helper_marks(helper_marks)
                                             + [("returned", returned), ("pids", time.monotonic())])
        self._write_meta(meta)
        with self._lock:
            self._meta[sandbox_id] = meta
        self._limits[sandbox_id] = limits  # committed() sees it before its next rescan
        return self._info(meta)

    def _info(self, meta: dict, state: SandboxState | None = None) -> SandboxInfo:
        if state is None:
            running = alive(meta.get("init_pid"), meta.get("init_start"))
            state = (SandboxState.PAUSED if self.cgroups.is_frozen(meta["id"]) else SandboxState.RUNNING) \
                if running else SandboxState.DEAD
        return SandboxInfo(id=meta["id"], backend=self.name, image=meta["image"], layers=meta["layers"],
                           limits=Limits(**meta["limits"]),
                           state=state, created=meta["created"], ttl=meta.get("ttl"), idle_ttl=meta.get("idle_ttl"),
                           init_pid=meta.get("init_pid"), env=meta.get("env") or {},
                           base_env=meta.get("base_env") or {},
                           workdir=meta.get("workdir", "/"), network=meta.get("network", "none"),
                           ksm=meta.get("ksm", False), aslr=meta.get("aslr", True),
                           priority=meta.get("priority", "normal"),
                           memory_bytes=self.cgroups.memory_bytes(meta["id"]) if state != SandboxState.DEAD else None)

    def launch_phases(self, sandbox_id: str) -> dict[str, float]:
        """Where this sandbox's launch spent its time: milliseconds per step, in order, each named by
        the step it ends (see LAUNCH_STEPS); {} for a sandbox launched by a build without them."""
        meta = self._meta.get(sandbox_id) or self._load(sandbox_id)
        return dict(meta.get("launch_ms") or {})

    def info(self, sandbox_id: str) -> SandboxInfo:
        meta = self._live_meta(sandbox_id)
        return self._info(meta)

    def committed(self) -> list[Limits]:
        """Limits of every sandbox whose state dir exists, for admission decisions (shoald, per create).
        The listdir behind it is O(live sandboxes), 7 ms at 20,000, so it runs at most every
        COMMITTED_RESCAN_S; between, this process's own creates and removals keep the answer current,
        and other processes' (the CLI on the same root, a TTL's end) show up by the next rescan."""
        now = time.monotonic()
        if now - self._limits_scanned < COMMITTED_RESCAN_S:
            return list(self._limits.values())
        self._limits_scanned = now
        known, limits = self._limits, {}
        for name in os.listdir(self.settings.sandboxes_dir):
            lim = known.get(name)  # parsed once per sandbox: a Limits() per live sandbox per create adds up
            if lim is None:
                meta = self._meta.get(name)
                if meta is None:
                    try:
                        meta = self._load(name)
                    except (SandboxNotFound, SandboxError):
                        continue
                lim = Limits(**meta["limits"])
            limits[name] = lim
        self._limits = limits  # ended sandboxes drop out with their dirs
        return list(limits.values())

    def live_ids(self) -> set[str]:
        return set(os.listdir(self.settings.sandboxes_dir))

    def live_layers(self) -> set[str]:
        return {l for info in self.list() for l in info.layers}

    def kill(self, sandbox_id: str, reason: str = "killed") -> None:
        """End the sandbox; `reason` is its tombstone (an OOM under oom_kill="sandbox" passes its own)."""
        meta = self._load(sandbox_id)
        if not alive(meta.get("init_pid"), meta.get("init_start")):
            self._meta.pop(sandbox_id, None)
            self._cleanup(sandbox_id)
            raise self._gone(sandbox_id)
        # a frozen cgroup cannot die: thaw first so SIGKILL is delivered
        try:
            init_fd = os.pidfd_open(meta["init_pid"])
        except ProcessLookupError:
            init_fd = None
        sup_fd = None
        if alive(meta.get("sup_pid"), meta.get("sup_start")):
            try:
                sup_fd = os.pidfd_open(meta["sup_pid"])
            except ProcessLookupError:
                sup_fd = None
        try:
            if init_fd is not None and starttime(meta["init_pid"]) == meta["init_start"]:
                # said first: the supervisor keeps a tombstone already there, so it cannot take this
                # SIGKILL for the OOM killer's
                self._write_tombstone(sandbox_id, reason)
                try:
                    signal.pidfd_send_signal(init_fd, signal.SIGKILL)
                except ProcessLookupError:
                    pass  # it died on its own since (the OOM killer, or its last process exiting)
            if self.cgroups.is_frozen(sandbox_id):
                self.cgroups.freeze(sandbox_id, False)
            if sup_fd is not None:
                # the supervisor releases tmpfs, cgroups and the state dir; wait for it briefly
                waiter = select.poll()  # poll, not select: no FD_SETSIZE limit in a busy daemon
                waiter.register(sup_fd, select.POLLIN)
                waiter.poll(5000)
        finally:
            for fd in (init_fd, sup_fd):
                if fd is not None:
                    os.close(fd)
        with self._lock:
            self._meta.pop(sandbox_id, None)
        self._cleanup(sandbox_id, reason=reason)

    def kill_many(self, sandbox_ids: list[str], reason: str = "killed") -> list[str]:
        """End many sandboxes together (all signalled first, then waited for at once); returns the
        ids that were already gone. killmany.py says why."""
        from .killmany import kill_many

        return kill_many(self, sandbox_ids, reason)

    def _cleanup(self, sandbox_id: str, reason: str | None = None) -> None:
        """Release everything a sandbox holds on the host; safe to call twice."""
        self._limits.pop(sandbox_id, None)
        d = self.settings.sandboxes_dir / sandbox_id
        disk = d / "disk"
        if os.path.ismount(disk):
            from ...layers.erofs import unmount

            unmount(disk)
        self.cgroups.remove(sandbox_id)
        _remove_state_dir(d)
        tomb = self.settings.tombstones_dir / sandbox_id
        if reason and not tomb.exists():
            tomb.write_text(reason)

    def _write_tombstone(self, sandbox_id: str, reason: str) -> None:
        tomb = self.settings.tombstones_dir / sandbox_id
        tmp = tomb.with_name(f".{sandbox_id}.{threading.get_ident()}")
        tmp.write_text(reason)
        os.replace(tmp, tomb)

    def sweep(self) -> list[str]:
        """Reap sandboxes whose supervisor died (host crash, kill -9): kill leftovers, free resources."""
        reaped = []
        # cgroups are listed before the state dirs: a create makes its dir before its cgroups, so a
        # cgroup without a dir in the later listing belongs to no sandbox, even with creates in flight
        cgroups = self.cgroups.list_ids()
        for d in list(self.settings.sandboxes_dir.iterdir()):
            try:
                meta = json.loads((d / "meta.json").read_text())
            except (OSError, ValueError):
                if time.time() - d.stat().st_mtime > STARTUP_GRACE_S:
                    self._cleanup(d.name, reason="orphaned")
                    reaped.append(d.name)
                continue
            if not meta.get("init_pid"):
                if time.time() - meta.get("created", 0) > STARTUP_GRACE_S:
                    self._cleanup(d.name, reason="orphaned")
                    reaped.append(d.name)
                continue
            if alive(meta.get("sup_pid"), meta.get("sup_start")):
                continue
            if alive(meta["init_pid"], meta.get("init_start")):
                try:
                    os.kill(meta["init_pid"], signal.SIGKILL)
                except ProcessLookupError:
                    pass
                if self.cgroups.is_frozen(d.name):
                    self.cgroups.freeze(d.name, False)
                for _ in range(200):
                    if not alive(meta["init_pid"], meta.get("init_start")):
                        break
                    time.sleep(0.005)
            self._meta.pop(d.name, None)
            self._cleanup(d.name, reason="orphaned")
            reaped.append(d.name)
        for cg in cgroups - set(os.listdir(self.settings.sandboxes_dir)):
            self.cgroups.remove(cg, orphan=True)
        self.cgroups.sweep_pools()
        # a disk-upper image is unlinked right after its mount; one still here is from a crash between
        for img in (self.settings.root / "uppers").glob("sb-*.img"):
            try:
                if time.time() - img.stat().st_mtime > STARTUP_GRACE_S:
                    img.unlink()
            except OSError:
                pass
        cutoff = time.time() - 86400
        for t in self.settings.tombstones_dir.iterdir():
            if t.stat().st_mtime < cutoff:
                t.unlink(missing_ok=True)
        return reaped

    # ------------------------------------------------------------------ pause / TTL
    def pause(self, sandbox_id: str) -> None:
        """Freeze the sandbox; it also moves to the idle CPU class until resumed, so that whatever
        runs when it thaws (a resume racing a burst of work elsewhere) does not crowd out active ones."""
        self._live_meta(sandbox_id)
        self.cgroups.freeze(sandbox_id, True)
        self.cgroups.set_cpu_idle(sandbox_id, True, missing_ok=True)

    def resume(self, sandbox_id: str) -> None:
        meta = self._live_meta(sandbox_id)
        self._thaw(sandbox_id, meta)

    def _thaw(self, sandbox_id: str, meta: dict) -> None:
        # its own CPU class back first, so it runs at its priority from the first instruction
        self.cgroups.set_cpu_idle(sandbox_id, meta.get("priority") == "idle", missing_ok=True)
        self.cgroups.freeze(sandbox_id, False)

    def reclaim(self, sandbox_id: str, req: ReclaimRequest) -> ReclaimResult:
        """Push req.target of the sandbox's anonymous memory to swap (reclaim.py). It is frozen
        meanwhile; a running sandbox is thawed again after, a paused one stays paused."""
        import fcntl

        from .reclaim import reclaim

        meta = self._live_meta(sandbox_id)
        limits = Limits(**meta["limits"])
        self.cgroups.memory_dir(sandbox_id)  # a pooled sandbox has no memory cgroup to reclaim: InvalidArgument
        mem = limits.memory_mb << 20
        fd = os.open(self._dir(sandbox_id), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # one reclaim at a time: each restores the limit it lowered
            was_paused = self.cgroups.is_frozen(sandbox_id)
            if not was_paused:
                self.cgroups.freeze(sandbox_id, True)
            try:
                result = reclaim(self.cgroups, sandbox_id, req, limit_bytes=mem,
                                 swap_max=int(mem * self.settings.sandbox_swap))
            finally:
                if not was_paused:
                    self.cgroups.freeze(sandbox_id, False)
        finally:
            os.close(fd)
        return result.model_copy(update={"paused": was_paused})

    def ensure_running(self, sandbox_id: str) -> dict:
        """Any request to a paused sandbox resumes it first (DSec semantics)."""
        meta = self._live_meta(sandbox_id)
        if self.cgroups.is_frozen(sandbox_id):
            self._thaw(sandbox_id, meta)
        return meta

    def set_ttl(self, sandbox_id: str, req: TimeoutRequest) -> SandboxInfo:
        """Replace both lifetimes: `ttl` counts from now; None clears it (so does idle_ttl=None)."""
        ttl, idle_ttl = check_seconds("ttl", req.ttl), check_seconds("idle_ttl", req.idle_ttl)
        meta = self.ensure_running(sandbox_id)
        # record first: a short TTL may end the sandbox at once, and its supervisor then removes the
        # state dir, which a meta.json written afterwards would bring back as a zombie entry
        meta.update(ttl=ttl, idle_ttl=idle_ttl)
        self._write_meta(meta)
        try:
            initclient.set_lifetimes(self.sock_path(sandbox_id), sandbox_id, to_ms(ttl), to_ms(idle_ttl))
        except (OSError, SandboxError) as e:
            self._raise_if_ended(sandbox_id, meta, e)
            raise
        return self.info(sandbox_id)

    def _raise_if_ended(self, sandbox_id: str, meta: dict, e: Exception) -> None:
        """A control call failed (connection reset, empty reply): if the sandbox ended meanwhile (an
        earlier short TTL, a kill), say so with SandboxNotFound instead of an internal error."""
        if isinstance(e, SandboxNotFound):
            raise e
        deadline = time.monotonic() + 1.0
        while alive(meta.get("init_pid"), meta.get("init_start")):
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)
        self._meta.pop(sandbox_id, None)
        raise self._gone(sandbox_id) from None

    def touch(self, sandbox_id: str) -> None:
        """Count as activity for the idle TTL (used by file operations, which bypass init)."""
        meta = self._live_meta(sandbox_id)
        if meta.get("idle_ttl"):
            self.ensure_running(sandbox_id)
            try:
                initclient.ping(self.sock_path(sandbox_id), sandbox_id)
            except (OSError, SandboxError) as e:
                self._raise_if_ended(sandbox_id, meta, e)
                raise

    # ------------------------------------------------------------------ exec
    def env_for(self, sandbox_id: str, extra: dict[str, str] | None = None) -> dict[str, str]:
        meta = self._load(sandbox_id)
        env = {"PATH": DEFAULT_PATH, "HOME": "/root", "HOSTNAME": meta["hostname"], "LANG": "C.UTF-8"}
        env.update(meta.get("env") or {})
        if extra:
            env.update(extra)
        return env

    def exec(self, sandbox_id: str, req: ExecRequest, on_stdout: OutputCallback | None = None,
             on_stderr: OutputCallback | None = None) -> ExecResult:
        meta = self.ensure_running(sandbox_id)
        oom_before = self.cgroups.oom_kills(sandbox_id)
        own_before = self.cgroups.own_ooms(sandbox_id) if oom_before is not None else None
        try:
            ids, user_env = self._user(sandbox_id, req.user)
            result = initclient.run(self.sock_path(sandbox_id), sandbox_id, req.argv,
                                    self.env_for(sandbox_id, {**user_env, **req.env}),
                                    cwd=req.cwd or meta.get("workdir", "/"), timeout=req.timeout, stdin=req.stdin,
                                    output_cap=req.output_cap or self.settings.output_cap_bytes,
                                    on_stdout=on_stdout, on_stderr=on_stderr, ids=ids)
            return self._mark_oom(sandbox_id, meta, result, oom_before, own_before)
        except initclient.SandboxGone:
            # say why it ended (TTL, killed...) once the supervisor has written the tombstone
            deadline = time.monotonic() + 2
            while not (self.settings.tombstones_dir / sandbox_id).exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            self._meta.pop(sandbox_id, None)
            raise self._gone(sandbox_id) from None

    def _mark_oom(self, sandbox_id: str, meta: dict, result: ExecResult, before: int | None,
                  own_before: int | None = None) -> ExecResult:
        """oom_killed: the command ended by SIGKILL (itself, or a shell passing on its child's 137) while
        the sandbox's OOM-kill count grew (the kernel counts before it signals). Commands running at
        the same time in one sandbox cannot be told apart. Under oom_kill="sandbox" the sandbox is
        ending: say so instead."""
        killed = result.signal == signal.SIGKILL or result.exit_code == 128 + signal.SIGKILL
        if not killed or result.timed_out or before is None:
            return result
        after = self.cgroups.oom_kills(sandbox_id)
        if after is None and not alive(meta.get("init_pid"), meta.get("init_start")):
            # the cgroup is gone with the sandbox: its supervisor ended it (v2 sees the OOM kill at once
            # and, under oom_kill="sandbox", is quicker than this read); the tombstone says why
            raise self._await_end(sandbox_id, meta)
        if after is None or after <= before:
            return result
        result.oom_killed = True
        if meta.get("limits", {}).get("oom_kill") == "sandbox":
            self._end_for_oom(sandbox_id, own_before)
            raise self._await_end(sandbox_id, meta)
        return result

    def _end_for_oom(self, sandbox_id: str, own_before: int | None) -> None:
        """oom_kill="sandbox": end the sandbox one of whose processes the OOM killer took. Its supervisor
        does too where it can tell (a memory cgroup of its own: v2's memory.events, v1's notification
        and a look at the count after it); in a pooled memory cgroup it cannot tell whose process went,
        so the end of the process seen here is the only signal. Whichever is first writes the tombstone."""
        try:
            self.kill(sandbox_id, reason=self.cgroups.oom_reason(sandbox_id, own_before))
        except SandboxNotFound:
            pass

    def _await_end(self, sandbox_id: str, meta: dict) -> SandboxNotFound:
        """The error for a sandbox whose supervisor is ending it (waits for the tombstone briefly)."""
        deadline = time.monotonic() + 5
        while not (self.settings.tombstones_dir / sandbox_id).exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        self._meta.pop(sandbox_id, None)
        return self._gone(sandbox_id)

    def _spawn(self, sandbox_id: str, argv: list[str], env: dict[str, str] | None, cwd: str | None,
               timeout: float | None = None, stdin_pipe: bool = False, user: str | None = None,
               pty: tuple[int, int] | None = None) -> initclient.Process:
        """Start a process (killed when its connection closes) and hand back its pipes and control connection."""
        meta = self.ensure_running(sandbox_id)
        ids, user_env = self._user(sandbox_id, user)
        return initclient.Process(self.sock_path(sandbox_id), sandbox_id, argv,
                                  self.env_for(sandbox_id, {**user_env, **(env or {})}),
                                  cwd or meta.get("workdir", "/"), timeout, initclient.FLAG_KILL_ON_CLOSE,
                                  stdin_pipe=stdin_pipe, ids=ids, pty=pty)

    def _user(self, sandbox_id: str, user: str | None) -> tuple[initclient.Ids | None, dict[str, str]]:
        """A request's `user` as ids for init (resolved in the sandbox's /etc/passwd) and its env."""
        if user is None:
            return None, {}
        from ..users import resolve

        files = self.root_files(sandbox_id)
        u = resolve(user, lambda path, cap: files.read(path, max_bytes=cap))
        return initclient.Ids(u.uid, u.gid, u.groups), u.env()

    def start(self, sandbox_id: str, req: StartRequest) -> ContainerProcess:
        proc = self._spawn(sandbox_id, req.argv, req.env, req.cwd, timeout=req.timeout, stdin_pipe=req.stdin,
                           user=req.user, pty=(req.pty.rows, req.pty.cols) if req.pty else None)
        on_oom = None
        if self._load(sandbox_id).get("limits", {}).get("oom_kill") == "sandbox":
            own_before = self.cgroups.own_ooms(sandbox_id)
            on_oom = lambda: self._end_for_oom(sandbox_id, own_before)  # noqa: E731
        return ContainerProcess(proc, req.ring_bytes, list(req.argv),
                                oom_kills=lambda: self.cgroups.oom_kills(sandbox_id), on_oom=on_oom)

    def open_session(self, sandbox_id: str, req: SessionRequest) -> ContainerSession:
        meta = self._live_meta(sandbox_id)
        shell = req.shell or ("/bin/bash" if self.root_files(sandbox_id).exists("/bin/bash") else "/bin/sh")
        proc = self._spawn(sandbox_id, [shell], req.env, req.cwd, stdin_pipe=True)
        return ContainerSession(proc, shell, req.output_cap or self.settings.output_cap_bytes, sandbox_id,
                                before_run=lambda: self.ensure_running(sandbox_id),
                                idle_ttl=bool(meta.get("idle_ttl")))

    # ------------------------------------------------------------------ egress
    def set_network(self, sandbox_id: str, req: NetworkRequest) -> NetworkPolicy:
        """Replace the sandbox's egress allow rules (omitted = cleared). [] and {} = no egress."""
        from .network import EgressManager, parse_rules

        meta = self._live_meta(sandbox_id)
        if meta.get("network") == "host":
            raise InvalidArgument(f"sandbox {sandbox_id} uses the host network (a build sandbox)")
        allow, presets = req.allow or [], req.presets or {}
        rules = parse_rules(allow, presets, self.settings.egress_presets)
        mgr = EgressManager()
        pid = meta["init_pid"]
        mgr.apply(pid, rules)  # the filter first: the link never exists unfiltered
        net = mgr.attach(sandbox_id, pid) if rules or mgr.attached(pid) else None
        meta["egress"] = {"allow": list(allow), "presets": dict(presets),
                          "resolved": [str(r) for r in rules], "subnet": str(net) if net else None}
        self._write_meta(meta)
        return NetworkPolicy(**meta["egress"])

    def get_network(self, sandbox_id: str) -> NetworkPolicy:
        return NetworkPolicy(**(self._live_meta(sandbox_id).get("egress") or {}))

    def connect_port(self, sandbox_id: str, port: int, timeout: float = PORT_CONNECT_TIMEOUT) -> socket.socket:
        """127.0.0.1:`port` in the sandbox's network namespace (ports.py); resumes a paused sandbox."""
        from .ports import connect_in_netns

        meta = self.ensure_running(sandbox_id)
        if meta.get("network") == "host":  # its 127.0.0.1 is the host's: never a route to the host's services
            raise InvalidArgument(f"sandbox {sandbox_id} uses the host network (a build sandbox): no port route")
        if meta.get("idle_ttl"):
            self.touch(sandbox_id)
        return connect_in_netns(sandbox_id, meta["init_pid"], meta.get("init_start"), port, timeout)

    def port_sockets(self, sandbox_id: str, port: int) -> list[PortSocket]:
        """The sockets on `port` in the sandbox's netns and their holders (portsockets.py)."""
        from .portsockets import port_sockets

        meta = self._live_meta(sandbox_id)
        if meta.get("network") == "host":  # its tables are the host's: nothing there is the sandbox's alone
            raise InvalidArgument(f"sandbox {sandbox_id} uses the host network (a build sandbox)")
        return port_sockets(meta["init_pid"], self.cgroups.procs(sandbox_id), self.upper_dir(sandbox_id), port)

    def guard_port(self, sandbox_id: str, port: int) -> None:
        """An nftables rule in the sandbox's netns resets connections without the host's mark (portguard.py)."""
        from .portguard import guard

        meta = self._guardable(sandbox_id)
        guard(sandbox_id, meta["init_pid"], meta.get("init_start"), port)

    def port_guarded(self, sandbox_id: str, port: int) -> bool:
        from .portguard import guarded

        meta = self._guardable(sandbox_id)
        return guarded(sandbox_id, meta["init_pid"], meta.get("init_start"), port)

    def _guardable(self, sandbox_id: str) -> dict:
        meta = self._live_meta(sandbox_id)
        if meta.get("network") == "host":  # its netns is the host's: never filtered from here
            raise InvalidArgument(f"sandbox {sandbox_id} uses the host network (a build sandbox)")
        return meta

    def written_under(self, sandbox_id: str, paths: list[str], limit: int = 20) -> list[str]:
        """Entries of the sandbox's writable upper at or below `paths` (upperscan.py)."""
        from .upperscan import written_under

        self._live_meta(sandbox_id)
        return written_under(self.upper_dir(sandbox_id), paths, limit)

    def watch_dir(self, sandbox_id: str, path: str, recursive: bool = False) -> WatchHandle:
        """inotify on the sandbox's own view of `path` (watch.py); caps in `self.watch_limits`."""
        from .watch import ContainerWatch, WatchLimits

        meta = self._live_meta(sandbox_id)
        if meta.get("idle_ttl"):
            self.touch(sandbox_id)
        limits = getattr(self, "watch_limits", None) or WatchLimits()
        return ContainerWatch(sandbox_id, meta["init_pid"], meta.get("init_start"), path, recursive, limits)

    def upper_dir(self, sandbox_id: str) -> Path:
        """The sandbox's writable overlayfs upper (host path): its whole diff against its layers.
        The upper is mounted in no host mount namespace (one mount per live sandbox there would make
        every create O(N)): its supervisor holds it on an fd, reached through /proc."""
        meta = self._live_meta(sandbox_id)
        if meta.get("upper_fd") is not None and alive(meta.get("sup_pid"), meta.get("sup_start")):
            return Path(f"/proc/{meta['sup_pid']}/fd/{meta['upper_fd']}/upper")
        return self._dir(sandbox_id) / "disk" / "upper"

    @contextlib.contextmanager
    def upper_view(self, sandbox_id: str) -> Iterator[Path]:
        """The upper bound at a temporary host path while the block runs (a snapshot's mkfs.erofs
        resolves its source path, which a /proc/<pid>/fd path does not survive), unmounted after."""
        upper = self.upper_dir(sandbox_id)
        if str(upper).startswith(str(self.settings.sandboxes_dir)):  # an old supervisor's mounted upper
            yield upper
            return
        from ...layers.erofs import unmount

        view = Path(tempfile.mkdtemp(prefix=".upper-", dir=self.settings.sandboxes_dir.parent))
        try:
            try:
                _bind(upper, view)
            except OSError:
                # a kernel that binds no detached mount (< 6.15 attaches the upper inside the sandbox's
                # namespace, where no bind can reach it): a copy, slower but the same tree
                subprocess.run(["cp", "-a", f"{upper}/.", str(view)], check=True, capture_output=True)
                yield view
                return
            try:
                yield view
            finally:
                unmount(view)
        finally:
            if not os.path.ismount(view):  # never rmtree through a bind that failed to come off
                shutil.rmtree(view, ignore_errors=True)

    # ------------------------------------------------------------------ files
    def root_files(self, sandbox_id: str) -> SandboxFiles:
        """The files API over the sandbox's root, as init sees it. A file operation bypasses init, so it
        counts as activity for the idle TTL here (and resumes a paused sandbox, as any request does)."""
        meta = self._live_meta(sandbox_id)
        if meta.get("idle_ttl"):
            self.touch(sandbox_id)
        return SandboxFiles(f"/proc/{meta['init_pid']}/root", sandbox_id)

    def list(self) -> list[SandboxInfo]:
        out = []
        for d in sorted(self.settings.sandboxes_dir.iterdir()):
            try:
                meta = self._load(d.name)
            except (SandboxNotFound, SandboxError):
                continue
            if meta.get("init_pid") and alive(meta["init_pid"], meta.get("init_start")):
                out.append(self._info(meta))
        return out


# everything a sandbox's state dir can hold (the supervisor's own cleanup removes the same names)
STATE_DIR_NAMES = ("agent.sock", "meta.json", "meta.json.tmp", "rootfs", "disk")


# The steps of a launch, each named by the mark that ends it (launch_phases()): Python's checks and
# templates, the first meta write, the cgroup directories, the helper's argv; then shoal-init's own
# marks (native/shoal_init.c, mark()): its exec (Python's fork/exec of it), the supervisor's fork, the
# upper tmpfs, the control socket, the init clone, the cgroup joins, init's wake-up, its cgroup namespace,
# the overlay, the rest of the root (/dev, /proc), the network, the hardening, the supervisor's
# read of init's result; last Python's wait for the launcher and its pid start times.
LAUNCH_STEPS = ("checks", "meta", "cgroup_dirs", "args", "exec", "forked", "upper", "socket", "clone", "joined",
                "go", "cgroupns", "overlay", "rootfs", "net", "hardened", "ready", "returned", "pids")


def parse_helper_marks(text: str) -> list[tuple[str, float]]:
    """shoal-init's "name:us,name:us" (CLOCK_MONOTONIC microseconds) as (name, seconds) pairs, the
    clock of time.monotonic(); malformed entries are skipped (the marks are a diagnosis, not state)."""
    out = []
    for item in text.split(","):
        name, _, us = item.partition(":")
        if name and us.isdigit():
            out.append((name, int(us) / 1e6))
    return out


def launch_phases_ms(marks: list[tuple[str, float]]) -> dict[str, float]:
    """Milliseconds from each mark to the next, keyed by the later one's name."""
    return {name: round((t - marks[i][1]) * 1e3, 3) for i, (name, t) in enumerate(marks[1:])}


def _remove_state_dir(d: Path) -> None:
    """rmtree, and where that could not list the dir (EMFILE: listing needs a descriptor), the known
    names by path: unlink and rmdir need none."""
    shutil.rmtree(d, ignore_errors=True)
    if not os.path.lexists(d):
        return
    for name in STATE_DIR_NAMES:
        p = d / name
        try:
            os.unlink(p)
        except IsADirectoryError:
            with contextlib.suppress(OSError):
                os.rmdir(p)
        except OSError:
            pass
    with contextlib.suppress(OSError):
        os.rmdir(d)


def _explain_oom(reason: str) -> str | None:
    """A tombstone `oom <MiB>` / `oom <MiB> shared` / `oom <MiB> pooled` (written by the supervisor) in words."""
    parts = reason.split()
    if not parts or parts[0] != "oom":
        return None
    mib = parts[1] if len(parts) > 1 and parts[1] != "0" else "?"
    if "shared" in parts[2:]:
        return f"it ran out of memory: this host's sandboxes together reached their limit of {mib} MiB"
    if "pooled" in parts[2:]:
        return (f"it ran out of memory: its memory pool (memory_cgroup='pooled') reached its limit of {mib} MiB "
                "and the OOM killer took this sandbox's process")
    return f"it ran out of memory: its limit of {mib} MiB"
