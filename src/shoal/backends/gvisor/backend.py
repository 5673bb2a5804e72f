"""The gvisor backend: the same EROFS layer stacks under gVisor's user-space kernel (runsc).

How a sandbox comes to life:
 1. the host mounts each layer once (shared with the container backend) and hands us the dirs;
 2. we mount a size-capped tmpfs (or the ext4 disk upper) for the writable upper and an overlay
    of the layers under it, on the host: `upper_dir()` is a real host path, so the host's one
    capture (snapshot, fork) works unchanged;
 3. we write an OCI bundle (oci.py) whose root is that overlay, with the limits as cgroup
    resources, and `runsc create` + `runsc start` it (no network: --network=none);
 4. a detached supervisor (supervisor.py) enforces the TTLs and releases everything when the
    sandbox ends, whoever created it; sweep() does it if the supervisor died.
Commands are `runsc exec` processes whose stdio are our pipes; files are read and written on the
host overlay (resolved inside its root with openat2), which the sandbox sees at once because the
gofer runs with --file-access=shared. Differences from the container backend: docs/backends.md.
"""
from __future__ import annotations

import codecs
import contextlib
import ctypes
import json
import os
import re
import secrets
import select
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from ...core.contract import (
    PORT_CONNECT_TIMEOUT,
    Cursor,
    ExecRequest,
    ExecResult,
    Limits,
    NetworkPolicy,
    NetworkRequest,
    OutputCallback,
    ProcessHandle,
    ProcessOutput,
    SandboxInfo,
    SandboxSpec,
    SandboxState,
    SessionHandle,
    SessionRequest,
    StartRequest,
    TimeoutRequest,
    check_port,
)
from ...core.errors import (
    BackendUnavailable,
    CommandTimeout,
    InvalidArgument,
    NotSupported,
    QuotaExceeded,
    SandboxError,
    SandboxNotFound,
    SessionClosed,
)
from ..container.cgroups import cgroup_parent
from ..container.initclient import CappedBuffer, RingLog
from ..container.parents import record_owner
from ..files import SandboxFiles
from ..local import LocalBackend
from ..pids import alive, starttime
from ..shell import MarkedCommand
from . import oci
from .relay import HOST_BUSYBOX, open_relay, relay_mount
from .supervisor import cleanup

if TYPE_CHECKING:
    from ...host import Host

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
STARTUP_GRACE_S = 30.0
STDIN_WRITE_TIMEOUT_S = 5.0  # a write to a full stdin pipe waits this long for the process to read
RUNSC_TIMEOUT_S = 60.0  # one runsc control call (create, pause, kill...); they take ~20-150 ms
_ID = re.compile(r"gv-[a-z0-9]{1,12}-[0-9a-f]{12}")
_RUNSC_STATE = re.compile(r"(gv-[a-z0-9]{1,12}-[0-9a-f]{12})_sandbox:")
_SUPERVISOR = str(Path(__file__).with_name("supervisor.py"))
_libc = ctypes.CDLL(None, use_errno=True)
# tombstone reason -> what a request for the ended sandbox is told
_WHY = {"ttl": "its absolute TTL expired", "idle_ttl": "its idle TTL expired", "killed": "it was killed",
        "oom": "it ran out of memory (under gVisor an OOM ends the whole sandbox)",
        "pids": "it hit its process limit on the host (under gVisor a fork bomb can end the whole sandbox)",
        "orphaned": "its supervisor died and it was reaped",
        "exited": "its pid 1 exited (under gVisor `kill -9 1` from inside ends the sandbox)"}


def _signal_exact(pid: int | None, start: int | None, sig: int) -> bool:
    """Signal the process (pid, start time) if it still is that process: a pidfd pins it, so a
    reused pid is never signalled. Returns whether it was alive."""
    if not pid:
        return False
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    try:
        if starttime(pid) != start:
            return False
        signal.pidfd_send_signal(fd, sig)
        return True
    except ProcessLookupError:
        return False
    finally:
        os.close(fd)


def _mount(source: str, target: Path, fstype: str, options: str) -> None:
    if len(options) > 4000:  # the kernel takes one page of mount data
        raise SandboxError(f"{fstype} mount options too long ({len(options)} bytes): too many layers")
    nosuid_nodev = 2 | 4
    if _libc.mount(source.encode(), str(target).encode(), fstype.encode(), nosuid_nodev, options.encode()) != 0:
        err = ctypes.get_errno()
        raise SandboxError(f"mount {fstype} on {target}: {os.strerror(err)}")


class GvisorBackend(LocalBackend):
    name = "gvisor"
    id_prefix = "gv"

    def __init__(self, host: Host, max_sandboxes: int = 4096):
        super().__init__(host)
        if os.geteuid() != 0:
            raise SandboxError("the gvisor backend needs root (mounts, cgroups, runsc)")
        self.runsc = oci.find_runsc()
        self.max_sandboxes = max_sandboxes
        self.base = self.settings.root / "gvisor"
        self.tombstones = self.base / ".tombstones"
        self.runsc_root = self.base / ".runsc"  # runsc's own state (one dir per container)
        for d in (self.base, self.tombstones, self.runsc_root):
            d.mkdir(parents=True, exist_ok=True)
        self.cgroup_parent = cgroup_parent(self.settings.root) + "-gv"
        with contextlib.suppress(OSError):  # removed with the root's other parents once it is gone
            record_owner(cgroup_parent(self.settings.root), self.settings.root)

    # ------------------------------------------------------------------ state
    def _dir(self, sandbox_id: str) -> Path:
        if not isinstance(sandbox_id, str) or not _ID.fullmatch(sandbox_id):
            raise SandboxNotFound(f"invalid sandbox id {sandbox_id!r}")
        return self.base / sandbox_id

    def _gone_message(self, sandbox_id: str) -> str:
        try:
            reason = (self.tombstones / sandbox_id).read_text().strip() or "exited"
        except OSError:
            return f"sandbox {sandbox_id} not found"
        return f"sandbox {sandbox_id} no longer exists: {_WHY.get(reason, reason)}"

    def _load(self, sandbox_id: str) -> dict:
        d = self._dir(sandbox_id)
        if (d / "killed").exists():  # being released in the background
            raise SandboxNotFound(self._gone_message(sandbox_id))
        try:
            return json.loads((d / "meta.json").read_text())
        except (FileNotFoundError, NotADirectoryError):
            raise SandboxNotFound(self._gone_message(sandbox_id)) from None
        except ValueError as e:
            raise SandboxError(f"sandbox {sandbox_id}: unreadable state ({e})") from e

    def _write_meta(self, meta: dict) -> None:
        d = self._dir(meta["id"])
        tmp = d / f"meta.json.{os.getpid()}.{threading.get_ident()}"
        tmp.write_text(json.dumps(meta))
        os.replace(tmp, d / "meta.json")

    def _live_meta(self, sandbox_id: str) -> dict:
        meta = self._load(sandbox_id)
        if not meta.get("sandbox_pid"):
            raise SandboxNotFound(f"sandbox {sandbox_id} is still starting")
        if not alive(meta["sandbox_pid"], meta.get("sandbox_start")):
            self._await_end(sandbox_id, meta)
            raise SandboxNotFound(self._gone_message(sandbox_id))
        return meta

    def _await_end(self, sandbox_id: str, meta: dict, reason: str = "exited") -> None:
        """The sandbox's process is gone: give its supervisor a moment to clean up and leave the
        tombstone (it knows why: TTL, OOM...); clean up here if it is gone too."""
        d = self._dir(sandbox_id)
        deadline = time.monotonic() + 5.0
        while d.exists() and alive(meta.get("sup_pid"), meta.get("sup_start")) and time.monotonic() < deadline:
            time.sleep(0.01)
        if d.exists():
            cleanup(str(d), str(self.tombstones), reason)

    def _runsc(self, meta: dict, *args: str, timeout: float = RUNSC_TIMEOUT_S) -> subprocess.CompletedProcess:
        try:
            return subprocess.run([*meta["runsc"], *args], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=timeout, check=False, env={})
        except subprocess.TimeoutExpired:
            raise SandboxError(f"sandbox {meta['id']}: `runsc {args[0]}` did not answer in {timeout:.0f} s") from None

    def _control(self, meta: dict, *args: str) -> None:
        """A runsc control call that must succeed; a failure because the sandbox ended is SandboxNotFound."""
        r = self._runsc(meta, *args)
        if r.returncode != 0:
            if not alive(meta["sandbox_pid"], meta.get("sandbox_start")):
                self._await_end(meta["id"], meta)
                raise SandboxNotFound(self._gone_message(meta["id"]))
            raise SandboxError(f"sandbox {meta['id']}: runsc {args[0]} failed: {r.stderr.strip()[-500:]}")

    def _touch(self, sandbox_id: str) -> None:
        with contextlib.suppress(OSError):
            os.utime(self._dir(sandbox_id) / "activity")

    @contextlib.contextmanager
    def _busy(self, sandbox_id: str) -> Iterator[None]:
        """A request in flight: the idle TTL does not run meanwhile (the supervisor checks busy/)."""
        marker = self._dir(sandbox_id) / "busy" / f"{os.getpid()}-{secrets.token_hex(6)}"
        try:
            marker.touch()
        except OSError:
            pass
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                marker.unlink()
            self._touch(sandbox_id)

    def ensure_running(self, sandbox_id: str) -> dict:
        """Any request to a paused sandbox resumes it first, and counts as activity."""
        meta = self._live_meta(sandbox_id)
        if (self._dir(sandbox_id) / "paused").exists():
            self.resume(sandbox_id)
        self._touch(sandbox_id)
        return meta

    # ------------------------------------------------------------------ lifecycle
    def launch(self, spec: SandboxSpec, lower_dirs: list[Path]) -> SandboxInfo:
        if not lower_dirs:
            raise InvalidArgument("a sandbox needs at least one mounted layer")
        if len(self.live_ids()) >= self.max_sandboxes:
            raise QuotaExceeded(f"host gvisor sandbox limit reached ({self.max_sandboxes}); kill some or retry later")
        if spec.ksm or not spec.aslr or spec.priority != "normal":
            raise InvalidArgument("ksm, aslr=False and priority='idle' are options of the container backend; "
                                  "gVisor sandboxes do not take them")
        if spec.limits.memory_cgroup != "own":
            raise InvalidArgument("memory_cgroup='pooled' is an option of the container backend; gVisor sandboxes "
                                  "each have a memory cgroup of their own")
        runsc = oci.runsc_argv(self.runsc, self.runsc_root, spec.network)
        sandbox_id = f"gv-{self.settings.host_tag}-{secrets.token_hex(6)}"
        d = self._dir(sandbox_id)
        d.mkdir()
        for sub in ("upper", "rootfs", "bundle", "busy", "procs"):
            (d / sub).mkdir()
        (d / "activity").touch()
        limits = spec.limits
        now = time.time()
        meta = {"id": sandbox_id, "image": spec.image, "layers": list(spec.layers), "limits": limits.model_dump(),
                "created": now, "ttl": spec.ttl, "ttl_from": now, "idle_ttl": spec.idle_ttl, "env": spec.env,
                "base_env": spec.base_env, "hostname": spec.hostname or sandbox_id, "workdir": spec.workdir,
                "network": spec.network, "runsc": runsc, "cgroup_path": f"/{self.cgroup_parent}/{sandbox_id}"}
        self._write_meta(meta)
        try:
            self._mount_root(d, sandbox_id, limits, lower_dirs)
            tmp = d / "rootfs" / "tmp"
            if not tmp.is_dir() and not tmp.is_symlink():  # the /tmp bind mount needs it
                tmp.mkdir(mode=0o1777)
                os.chmod(tmp, 0o1777)
            relay = relay_mount() if spec.network != "host" else None
            config = oci.bundle_config(d / "rootfs", str(meta["hostname"]), limits, str(meta["cgroup_path"]),
                                       spec.network, [relay] if relay else None)
            meta["port_relay"] = relay is not None
            (d / "bundle" / "config.json").write_text(json.dumps(config))
            self._runsc_create(runsc, d, sandbox_id)
            pid = int((d / "sandbox.pid").read_text())
            meta.update(sandbox_pid=pid, sandbox_start=starttime(pid))
            self._write_meta(meta)
            sup = subprocess.Popen([sys.executable, "-I", "-S", _SUPERVISOR, str(d), str(self.tombstones)],
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   start_new_session=True, env={}, close_fds=True)
            meta.update(sup_pid=sup.pid, sup_start=starttime(sup.pid))
            self._write_meta(meta)
        except BaseException as e:
            cleanup(str(d), str(self.tombstones), None)
            if isinstance(e, subprocess.TimeoutExpired):
                raise SandboxError(f"sandbox {sandbox_id}: runsc did not start it in {RUNSC_TIMEOUT_S:.0f} s") from None
            if isinstance(e, OSError):
                raise SandboxError(f"sandbox {sandbox_id} failed to start: {e}") from e
            raise
        return self._info(meta)

    def _runsc_create(self, runsc: list[str], d: Path, sandbox_id: str) -> None:
        """`runsc create` + `runsc start`. The container's pid 1 inherits create's stdio, so its
        stderr is a pipe we read only until create exits: a host file there would let the sandbox
        fill the host's disk through /proc/1/fd/2; once we close our end, its writes fail (EPIPE)."""
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        # stdin and stdout are pipes too, never the host's /dev/null: runsc chowns the stdio it hands
        # the sandbox to the sandbox's user (nobody), and that would be the host's /dev/null inode
        in_r, in_w = os.pipe2(os.O_CLOEXEC)
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        os.close(in_w)  # pid 1 reads EOF
        try:
            proc = subprocess.Popen([*runsc, "create", "--bundle", str(d / "bundle"), "--pid-file",
                                     str(d / "sandbox.pid"), sandbox_id], stdin=in_r,
                                    stdout=out_w, stderr=err_w, env={})
        finally:
            os.close(err_w)
            os.close(in_r)
            os.close(out_w)
            os.close(out_r)  # its writes fail (EPIPE) rather than land anywhere on the host
        try:
            rc = proc.wait(timeout=RUNSC_TIMEOUT_S)
            os.set_blocking(err_r, False)
            try:
                detail = os.read(err_r, 65536).decode(errors="replace")
            except BlockingIOError:
                detail = ""
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise SandboxError(f"sandbox {sandbox_id}: runsc create took over {RUNSC_TIMEOUT_S:.0f} s") from None
        finally:
            os.close(err_r)
        if rc == 0:
            r = subprocess.run([*runsc, "start", sandbox_id], stdin=subprocess.DEVNULL, capture_output=True, env={},
                               timeout=RUNSC_TIMEOUT_S, check=False)
            rc, detail = r.returncode, r.stderr.decode(errors="replace")
        if rc != 0:
            raise SandboxError(f"sandbox {sandbox_id} failed to start under gVisor: {detail.strip()[-800:]}")

    def _mount_root(self, d: Path, sandbox_id: str, limits: Limits, lower_dirs: list[Path]) -> None:
        """The writable upper (tmpfs capped at disk_mb, or the ext4 disk upper) and the overlay on it."""
        if limits.upper == "disk":
            from ..container.backend import mount_disk_upper

            mount_disk_upper(self.settings.root, sandbox_id, limits.disk_mb, d / "upper")
        else:
            _mount("tmpfs", d / "upper", "tmpfs", f"size={limits.disk_mb}m,mode=755")
        (d / "upper" / "upper").mkdir(exist_ok=True)
        (d / "upper" / "work").mkdir(exist_ok=True)
        lower = ":".join(str(p) for p in reversed(lower_dirs))  # overlayfs wants the top-most lower first
        _mount("overlay", d / "rootfs", "overlay", f"lowerdir={lower},upperdir={d}/upper/upper,workdir={d}/upper/work")

    def _state(self, sandbox_id: str) -> SandboxState:
        return SandboxState.PAUSED if (self._dir(sandbox_id) / "paused").exists() else SandboxState.RUNNING

    def _memory_bytes(self, meta: dict) -> int | None:
        cg = meta["cgroup_path"].lstrip("/")
        for path in (f"/sys/fs/cgroup/memory/{cg}/memory.usage_in_bytes", f"/sys/fs/cgroup/{cg}/memory.current"):
            try:
                with open(path) as f:
                    return int(f.read())
            except (OSError, ValueError):
                continue
        return None

    def _info(self, meta: dict, state: SandboxState | None = None) -> SandboxInfo:
        state = state or self._state(meta["id"])
        return SandboxInfo(id=meta["id"], image=meta["image"], layers=meta["layers"], limits=Limits(**meta["limits"]),
                           state=state, created=meta["created"], backend=self.name, ttl=meta.get("ttl"),
                           idle_ttl=meta.get("idle_ttl"), init_pid=meta.get("sandbox_pid"),
                           memory_bytes=self._memory_bytes(meta) if state != SandboxState.DEAD else None,
                           env=meta.get("env") or {}, base_env=meta.get("base_env") or {},
                           workdir=meta.get("workdir", "/"), network=meta.get("network", "none"))

    def info(self, sandbox_id: str) -> SandboxInfo:
        return self._info(self._live_meta(sandbox_id))

    def live_ids(self) -> set[str]:
        return {n for n in os.listdir(self.base) if n.startswith("gv-")}

    def committed(self) -> list[Limits]:
        out = []
        for sid in self.live_ids():
            try:
                out.append(Limits(**self._load(sid)["limits"]))
            except (SandboxNotFound, SandboxError, KeyError):
                continue
        return out

    def live_layers(self) -> set[str]:
        """Layers under every sandbox that holds mounts, those still being released after a kill too
        (their overlays use the layer mounts until the supervisor unmounts them)."""
        out: set[str] = set()
        for sid in self.live_ids():
            with contextlib.suppress(OSError, ValueError):
                out.update(json.loads((self.base / sid / "meta.json").read_text()).get("layers", []))
        return out

    def kill(self, sandbox_id: str) -> None:
        """Ends the sandbox at once for every caller; its resources are released in the background by
        its supervisor (gVisor's Sentry takes ~1 s to exit under ptrace: no request waits for it)."""
        d = self._dir(sandbox_id)
        meta = self._load(sandbox_id)
        if not meta.get("sandbox_pid") or not alive(meta["sandbox_pid"], meta.get("sandbox_start")):
            self._await_end(sandbox_id, meta)
            raise SandboxNotFound(self._gone_message(sandbox_id))
        # the tombstone first, then the marker that makes every later request see the end
        tomb = self.tombstones / sandbox_id
        tmp = tomb.with_name(f".{sandbox_id}.{os.getpid()}")
        tmp.write_text("killed")
        os.replace(tmp, tomb)
        (d / "killed").touch()
        _signal_exact(meta["sandbox_pid"], meta.get("sandbox_start"), signal.SIGKILL)  # stop it now
        # SIGTERM before its handler is in place would end it without cleaning up: wait for it
        deadline = time.monotonic() + 5.0
        while not (d / "supervised").exists() and alive(meta.get("sup_pid"), meta.get("sup_start")) \
                and time.monotonic() < deadline:
            time.sleep(0.005)
        if not (d / "supervised").exists() or \
                not _signal_exact(meta.get("sup_pid"), meta.get("sup_start"), signal.SIGTERM):  # it runs runsc delete
            cleanup(str(d), str(self.tombstones), "killed")

    def sweep(self) -> list[str]:
        """Reap sandboxes whose supervisor died (host crash, kill -9), and runsc state of none."""
        reaped = []
        for sid in self.live_ids():
            d = self.base / sid
            try:
                meta = json.loads((d / "meta.json").read_text())
            except (OSError, ValueError):
                meta = {}
            if alive(meta.get("sup_pid"), meta.get("sup_start")):
                continue
            try:
                started = meta.get("created") or d.stat().st_mtime
            except OSError:  # released meanwhile
                continue
            if not meta.get("sup_pid") and time.time() - started < STARTUP_GRACE_S:
                continue  # a create in flight (maybe in another process)
            cleanup(str(d), str(self.tombstones), "orphaned")
            reaped.append(sid)
        # runsc state (`<id>_sandbox:<id>.state`) without a sandbox dir: a crash between the two. The
        # state is listed before the dirs: a create makes its dir first, so one in flight is never taken
        states = {m.group(1) for m in map(_RUNSC_STATE.match, os.listdir(self.runsc_root)) if m}
        for sid in states - self.live_ids():
            subprocess.run([*oci.runsc_argv(self.runsc, self.runsc_root, "none"), "delete", "--force", sid],
                           capture_output=True, check=False, timeout=RUNSC_TIMEOUT_S)
        # a disk-upper image is unlinked right after its mount; one still here is from a crash between
        for img in (self.settings.root / "uppers").glob("gv-*.img"):
            with contextlib.suppress(OSError):
                if time.time() - img.stat().st_mtime > STARTUP_GRACE_S:
                    img.unlink()
        cutoff = time.time() - 86400
        for t in self.tombstones.iterdir():
            with contextlib.suppress(OSError):
                if t.stat().st_mtime < cutoff:
                    t.unlink()
        return reaped

    def wait_released(self, timeout: float = 15.0) -> bool:
        """Wait until every ended sandbox has released its mounts and state (kill returns before
        that); for tests and tools that remove a whole root. True if none is left."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not any((self.base / sid / "killed").exists() for sid in self.live_ids()):
                return True
            time.sleep(0.05)
        return False

    # ------------------------------------------------------------------ pause / TTL
    def pause(self, sandbox_id: str) -> None:
        meta = self._live_meta(sandbox_id)
        marker = self._dir(sandbox_id) / "paused"
        if marker.exists():
            return
        self._control(meta, "pause", sandbox_id)
        marker.touch()

    def resume(self, sandbox_id: str) -> None:
        meta = self._live_meta(sandbox_id)
        marker = self._dir(sandbox_id) / "paused"
        if not marker.exists():
            return
        self._control(meta, "resume", sandbox_id)
        marker.unlink(missing_ok=True)

    def set_ttl(self, sandbox_id: str, req: TimeoutRequest) -> SandboxInfo:
        meta = self.ensure_running(sandbox_id)
        meta.update(ttl=req.ttl, idle_ttl=req.idle_ttl, ttl_from=time.time())
        self._write_meta(meta)
        # re-read the lifetimes now; a supervisor still starting (no handler yet: SIGHUP would end it)
        # reads meta.json after it is ready, so it sees this write anyway
        if (self._dir(sandbox_id) / "supervised").exists():
            _signal_exact(meta.get("sup_pid"), meta.get("sup_start"), signal.SIGHUP)
        return self._info(meta)

    # ------------------------------------------------------------------ commands
    def _env(self, meta: dict, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {"PATH": DEFAULT_PATH, "HOME": "/root", "HOSTNAME": meta["hostname"], "LANG": "C.UTF-8"}
        env.update(meta.get("env") or {})
        env.update(extra or {})
        for k, v in env.items():
            if not k or "=" in k or "\0" in k or "\0" in v:
                raise InvalidArgument(f"invalid environment variable {k!r}: names must be non-empty without '=' "
                                      "and neither name nor value may contain NUL")
        return env

    def _spawn(self, meta: dict, argv: list[str], env: dict[str, str] | None, cwd: str | None,
               stdin: bool, user: str | None = None) -> _Exec:
        cwd = cwd or meta.get("workdir") or "/"
        if "\0" in cwd:
            raise InvalidArgument("cwd may not contain NUL bytes")
        ids, user_env = None, {}
        if user is not None:  # resolved in the sandbox's own /etc/passwd (users.py), as on the container backend
            from ..users import resolve

            files = self._files(meta["id"])
            u = resolve(user, lambda path, cap: files.read(path, max_bytes=cap))
            ids, user_env = (u.uid, u.gid, u.groups), u.env()
        spec = oci.process_spec(argv, self._env(meta, {**user_env, **(env or {})}), cwd, meta["limits"]["pids"], ids)
        return _Exec(self, meta, spec, stdin)

    def exec(self, sandbox_id: str, req: ExecRequest, on_stdout: OutputCallback | None = None,
             on_stderr: OutputCallback | None = None) -> ExecResult:
        meta = self.ensure_running(sandbox_id)
        cap = req.output_cap or self.settings.output_cap_bytes
        with self._busy(sandbox_id):
            x = self._spawn(meta, req.argv, req.env, req.cwd, stdin=req.stdin is not None, user=req.user)
            try:
                return x.run_to_end(req.stdin, req.timeout, cap, on_stdout, on_stderr)
            finally:
                x.close()

    def start(self, sandbox_id: str, req: StartRequest) -> ProcessHandle:
        _unsupported(req.pty)
        meta = self.ensure_running(sandbox_id)
        x = self._spawn(meta, req.argv, req.env, req.cwd, stdin=req.stdin, user=req.user)
        return GvisorProcess(x, req.argv, req.ring_bytes, req.timeout)

    def open_session(self, sandbox_id: str, req: SessionRequest) -> SessionHandle:
        meta = self.ensure_running(sandbox_id)
        shell = req.shell
        if shell is None:
            shell = "/bin/bash" if self._files(sandbox_id).exists("/bin/bash") else "/bin/sh"
        x = self._spawn(meta, [shell], req.env, req.cwd, stdin=True)
        return GvisorSession(self, x, shell, req.output_cap or self.settings.output_cap_bytes)

    def kill_tree(self, meta: dict, pid: int, sig: int = 9, leader: bool = True) -> None:
        """Signal pid (inside the sandbox) and its descendants. runsc cannot signal a process group,
        so the tree is read from `runsc ps` (twice, to catch children forked in between)."""
        for _ in range(2):
            r = self._runsc(meta, "ps", meta["id"])
            children: dict[int, list[int]] = {}
            for line in r.stdout.splitlines()[1:]:
                cols = line.split()
                if len(cols) >= 3 and cols[1].isdigit() and cols[2].isdigit():
                    children.setdefault(int(cols[2]), []).append(int(cols[1]))
            targets, todo = [], [pid]
            while todo:
                p = todo.pop()
                targets.append(p)
                todo += children.get(p, [])
            if not leader:
                targets.remove(pid)
            if not targets:
                return
            for p in targets:
                self._runsc(meta, "kill", "--pid", str(p), meta["id"], str(sig))

    # ------------------------------------------------------------------ files
    def _files(self, sandbox_id: str) -> SandboxFiles:
        return SandboxFiles(str(self._dir(sandbox_id) / "rootfs"), sandbox_id)

    def root_files(self, sandbox_id: str) -> SandboxFiles:
        """File operations work on the host overlay: they count as activity but, as on the container
        backend, do not resume a paused sandbox (reading a frozen sandbox's files is a use case)."""
        self._live_meta(sandbox_id)
        self._touch(sandbox_id)
        return self._files(sandbox_id)

    def upper_dir(self, sandbox_id: str) -> Path:
        self._live_meta(sandbox_id)
        return self._dir(sandbox_id) / "upper" / "upper"

    # ------------------------------------------------------------------ network
    def get_network(self, sandbox_id: str) -> NetworkPolicy:
        self._live_meta(sandbox_id)
        return NetworkPolicy()

    def set_network(self, sandbox_id: str, req: NetworkRequest) -> NetworkPolicy:
        meta = self.ensure_running(sandbox_id)
        if meta.get("network") == "host":
            raise InvalidArgument(f"sandbox {sandbox_id} uses the host network (a build sandbox)")
        if req.allow or any((req.presets or {}).values()):
            raise BackendUnavailable("egress rules are not supported on the gvisor backend yet: its sandboxes run "
                                     "with runsc --network=none (no interface but lo); use backend='container' "
                                     "for allow-listed egress")
        return NetworkPolicy()

    def connect_port(self, sandbox_id: str, port: int, timeout: float = PORT_CONNECT_TIMEOUT) -> socket.socket:
        """127.0.0.1:`port` inside the sandbox, through a relay process run in it (relay.py)."""
        check_port(port)
        meta = self.ensure_running(sandbox_id)
        if meta.get("network") == "host":  # its 127.0.0.1 is the host's: never a route to the host's services
            raise InvalidArgument(f"sandbox {sandbox_id} uses the host network (a build sandbox): no port route")
        if not meta.get("port_relay"):
            raise NotSupported(f"sandbox {sandbox_id} has no port relay (created before it, or the host has no "
                               f"static {HOST_BUSYBOX}: apt-get install busybox-static)")
        self._touch(sandbox_id)
        return open_relay(lambda argv: self._spawn(meta, argv, None, "/", stdin=True), sandbox_id, port, timeout)

    # last in the class body: a method named `list` shadows the builtin in the annotations after it
    def list(self) -> list[SandboxInfo]:
        out = []
        for sid in sorted(self.live_ids()):
            try:
                meta = self._load(sid)
            except (SandboxNotFound, SandboxError):
                continue
            if meta.get("sandbox_pid") and alive(meta["sandbox_pid"], meta.get("sandbox_start")):
                out.append(self._info(meta))
        return out


# ---------------------------------------------------------------------------------------- processes
class _Exec:
    """One `runsc exec` of a process spec, its pipes, and its pid inside the sandbox."""

    def __init__(self, be: GvisorBackend, meta: dict, spec: dict, stdin: bool):
        self.be, self.meta, self.sid = be, meta, meta["id"]
        d = be._dir(self.sid) / "procs"
        token = secrets.token_hex(6)
        self.spec_path, self.pid_path = d / f"{token}.json", d / f"{token}.pid"
        self.spec_path.write_text(json.dumps(spec))
        try:
            self.proc = subprocess.Popen(
                [*meta["runsc"], "exec", "--process", str(self.spec_path), "--internal-pid-file", str(self.pid_path),
                 self.sid], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, env={}, start_new_session=True)
        except OSError as e:
            self.spec_path.unlink(missing_ok=True)
            raise SandboxError(f"sandbox {self.sid}: cannot run runsc exec: {e}") from e
        if not stdin and self.proc.stdin is not None:
            # no input: EOF at once. A pipe, not the host's /dev/null, which runsc would chown
            self.proc.stdin.close()
        self._pid: int | None = None

    @property
    def pid(self) -> int | None:
        """The process's pid inside the sandbox, once runsc has started it."""
        if self._pid is None:
            with contextlib.suppress(OSError, ValueError):
                self._pid = int(self.pid_path.read_text())
        return self._pid

    def started(self) -> bool:
        return self.pid is not None

    def signal(self, sig: int, leader: bool = True) -> None:
        """Signal the process tree; a tree killed before its pid is known takes runsc exec with it."""
        deadline = time.monotonic() + 2.0
        while self.pid is None and self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        if self.pid is not None and self.proc.poll() is None:
            self.be.kill_tree(self.meta, self.pid, sig, leader)
        elif leader and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def exit_status(self, rc: int, stderr: bytes) -> tuple[int, bytes]:
        """runsc exits 128 with its own message when the process could not start (no such program,
        bad cwd): report it as a shell would (127 / 126) with the message on stderr."""
        if rc == 128 and not self.started() and b"executing processes for container" in stderr:
            return (127 if b"no such file or directory" in stderr.lower() else 126), stderr
        return rc, stderr

    def run_to_end(self, stdin: bytes | None, timeout: float | None, cap: int, on_stdout: OutputCallback | None,
                   on_stderr: OutputCallback | None) -> ExecResult:
        started = time.monotonic()
        if stdin is not None:
            threading.Thread(target=_feed, args=(self.proc.stdin, stdin), daemon=True).start()
        bufs = {"stdout": CappedBuffer(cap), "stderr": CappedBuffer(cap)}
        cbs = {"stdout": on_stdout, "stderr": on_stderr}
        decs = {k: codecs.getincrementaldecoder("utf-8")("replace") for k in bufs}
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ, "stdout")  # type: ignore[arg-type]  # a PIPE: never None
        sel.register(self.proc.stderr, selectors.EVENT_READ, "stderr")  # type: ignore[arg-type]  # a PIPE: never None
        deadline = None if timeout is None else started + timeout
        timed_out = False
        exited_at = None
        try:
            while sel.get_map():
                now = time.monotonic()
                if deadline is not None and now >= deadline and not timed_out:
                    timed_out = True
                    self.signal(9)
                if self.proc.poll() is not None:
                    # a daemonised grandchild may hold the pipes: drain briefly, then stop reading
                    exited_at = exited_at or now
                    if now - exited_at > 0.5:
                        break
                wait = 0.05 if exited_at else (None if deadline is None or timed_out else max(0.0, deadline - now))
                if timed_out and not exited_at:
                    wait = 0.1
                for key, _ in sel.select(wait if wait is not None else 1.0):
                    data = os.read(key.fd, 65536)
                    if not data:
                        sel.unregister(key.fileobj)
                        continue
                    bufs[key.data].add(data)
                    cb = cbs[key.data]
                    if cb is not None:
                        text = decs[key.data].decode(data)
                        if text:
                            cb(text)
        finally:
            sel.close()
        try:
            rc = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        if not alive(self.meta["sandbox_pid"], self.meta.get("sandbox_start")):  # it ended meanwhile
            self.be._await_end(self.sid, self.meta)
            raise SandboxNotFound(self.be._gone_message(self.sid))
        err = bufs["stderr"].value()
        rc, err = self.exit_status(rc, err)
        return ExecResult(exit_code=137 if timed_out else rc, signal=9 if timed_out else None, timed_out=timed_out,
                          stdout=bufs["stdout"].value().decode("utf-8", "replace"),
                          stderr=err.decode("utf-8", "replace"),
                          stdout_bytes=bufs["stdout"].total, stderr_bytes=bufs["stderr"].total,
                          stdout_truncated=bufs["stdout"].truncated, stderr_truncated=bufs["stderr"].truncated,
                          duration_s=time.monotonic() - started)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.signal(9)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()
        self.spec_path.unlink(missing_ok=True)
        self.pid_path.unlink(missing_ok=True)


def _feed(pipe, data: bytes) -> None:
    try:
        pipe.write(data)
        pipe.close()
    except (BrokenPipeError, OSError, ValueError):
        pass


class GvisorProcess(ProcessHandle):
    """A background process: a reader thread keeps its output in one ring buffer per stream."""

    def __init__(self, x: _Exec, argv: list[str], ring_bytes: int, timeout: float | None):
        self._x = x
        self._stdin_lock = threading.Lock()
        self.id = "p-" + secrets.token_hex(6)
        self.argv = list(argv)
        self._rings = {"stdout": RingLog(ring_bytes), "stderr": RingLog(ring_bytes)}
        self._exit: int | None = None
        self._timed_out = False
        self._started = time.monotonic()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._pump, daemon=True, name=f"gv-proc-{self.id}")
        self._thread.start()
        self._timer = None
        if timeout is not None:
            self._timer = threading.Timer(timeout, self._expire)
            self._timer.daemon = True
            self._timer.start()
        deadline = time.monotonic() + 2.0
        while not x.started() and x.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)

    @property
    def pid(self) -> int | None:  # type: ignore[override]  # a property over the ABC's attribute
        return self._x.pid

    def _expire(self) -> None:
        if not self._done.is_set():
            self._timed_out = True
            self._x.signal(9)

    def _pump(self) -> None:
        p = self._x.proc
        sel = selectors.DefaultSelector()
        sel.register(p.stdout, selectors.EVENT_READ, "stdout")  # type: ignore[arg-type]  # a PIPE: never None
        sel.register(p.stderr, selectors.EVENT_READ, "stderr")  # type: ignore[arg-type]  # a PIPE: never None
        exited_at = None
        try:
            while sel.get_map():
                if p.poll() is not None:
                    exited_at = exited_at or time.monotonic()
                    if time.monotonic() - exited_at > 0.5:
                        break
                for key, _ in sel.select(0.05 if exited_at else 0.5):
                    try:
                        data = os.read(key.fd, 65536)
                    except OSError:
                        data = b""
                    if not data:
                        sel.unregister(key.fileobj)
                        continue
                    self._rings[key.data].add(data)
        finally:
            sel.close()
            rc = p.wait()
            err, _ = self._rings["stderr"].since(0)[0], None
            self._exit = 137 if self._timed_out else self._x.exit_status(rc, err)[0]
            self._done.set()

    def output(self, since: Cursor = (0, 0)) -> ProcessOutput:
        out, c_out, lost_out = self._rings["stdout"].since(since[0])
        err, c_err, lost_err = self._rings["stderr"].since(since[1])
        return ProcessOutput(stdout=out.decode("utf-8", "replace"), stderr=err.decode("utf-8", "replace"),
                             cursor=(c_out, c_err), lost_bytes=lost_out + lost_err,
                             exit_code=self._exit if self._done.is_set() else None)

    def wait(self, timeout: float | None = None) -> ExecResult:
        if not self._done.wait(timeout):
            raise CommandTimeout(f"process {self.id} ({' '.join(self.argv)[:80]}) still running after {timeout} s")
        out, _, lost_out = self._rings["stdout"].since(0)
        err, _, lost_err = self._rings["stderr"].since(0)
        assert self._exit is not None
        return ExecResult(exit_code=self._exit, signal=9 if self._timed_out else None, timed_out=self._timed_out,
                          stdout=out.decode("utf-8", "replace"), stderr=err.decode("utf-8", "replace"),
                          stdout_bytes=len(out) + lost_out, stderr_bytes=len(err) + lost_err,
                          stdout_truncated=lost_out > 0, stderr_truncated=lost_err > 0,
                          duration_s=time.monotonic() - self._started)

    def kill(self, signal: int = 9) -> None:
        if not self._done.is_set():
            self._x.signal(signal)

    def write_stdin(self, data: bytes) -> None:
        """Blocks at most STDIN_WRITE_TIMEOUT_S, as on the container backend: a process that does not
        read its stdin must not hold the caller's thread."""
        with self._stdin_lock:
            pipe = self._x.proc.stdin
            if pipe is None or pipe.closed:
                raise InvalidArgument("the process's stdin is closed (or it was started without stdin=True)")
            fd = pipe.fileno()
            os.set_blocking(fd, False)
            deadline = time.monotonic() + STDIN_WRITE_TIMEOUT_S
            view, total = memoryview(data), len(data)
            try:
                while view:
                    try:
                        view = view[os.write(fd, view):]
                    except BlockingIOError:
                        left = deadline - time.monotonic()
                        poller = select.poll()
                        poller.register(fd, select.POLLOUT)
                        if left <= 0 or not poller.poll(left * 1000):
                            raise CommandTimeout(f"the process did not read its stdin for {STDIN_WRITE_TIMEOUT_S:g} "
                                                 f"s: {total - len(view)} of {total} bytes written") from None
            except BrokenPipeError:
                raise InvalidArgument("the process no longer reads its stdin") from None

    def close_stdin(self) -> None:
        with self._stdin_lock:
            pipe = self._x.proc.stdin
            if pipe is not None:
                with contextlib.suppress(OSError, ValueError):
                    pipe.close()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if not self._done.is_set():
            self._x.signal(9)
        self._thread.join(10)
        self._x.close()


class GvisorSession(SessionHandle):
    """A long-lived shell. Each command is sent as `command eval '<cmd>'` followed by a random end
    marker on both streams, so a syntax error cannot kill the shell; its stdin is /dev/null."""

    def __init__(self, be: GvisorBackend, x: _Exec, shell: str, cap: int):
        self._be, self._x = be, x
        self.id = "s-" + secrets.token_hex(6)
        self.shell = shell
        self._cap = cap
        self.closed = False
        self._sel = selectors.DefaultSelector()
        self._sel.register(x.proc.stdout, selectors.EVENT_READ, "out")  # type: ignore[arg-type]  # a PIPE: never None
        self._sel.register(x.proc.stderr, selectors.EVENT_READ, "err")  # type: ignore[arg-type]  # a PIPE: never None

    def _gone(self) -> SessionClosed:
        self.closed = True
        return SessionClosed(f"session shell in sandbox {self._x.sid} exited (did the command run `exit`?)")

    def run(self, cmd: str, timeout: float | None = 60.0) -> ExecResult:
        if self.closed:
            raise SessionClosed(f"session in sandbox {self._x.sid} is closed")
        if not isinstance(cmd, str):
            raise InvalidArgument("session commands are shell strings")
        self._be.ensure_running(self._x.sid)
        mc = MarkedCommand(cmd, self._cap)
        timed_out = False
        deadline = None if timeout is None else mc.started + timeout
        with self._be._busy(self._x.sid):
            try:
                assert self._x.proc.stdin is not None
                self._x.proc.stdin.write(mc.script)
                self._x.proc.stdin.flush()
            except (BrokenPipeError, OSError, ValueError):
                raise self._gone() from None
            while not mc.done:
                now = time.monotonic()
                if deadline is not None and now > deadline:
                    if timed_out:  # the shell itself is stuck: give up on this session
                        self.close()
                        raise CommandTimeout(f"session command {cmd!r} timed out and the shell did not recover")
                    timed_out = True
                    self._x.signal(9, leader=False)  # the command's processes, not the shell
                    deadline = time.monotonic() + 5.0
                events = self._sel.select(None if deadline is None else max(0.0, deadline - now))
                for key, _ in events:
                    data = os.read(key.fd, 65536)
                    if not data:
                        raise self._gone()
                    mc.feed(key.data, data)
        return mc.result(timed_out)

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(Exception):
            self._sel.close()
        self._x.close()


def _unsupported(pty: object) -> None:
    """The contract's PTY is not wired into runsc exec (docs/e2b.md says why)."""
    if pty is not None:
        raise NotSupported("the gvisor backend cannot run a command on a PTY yet (pty=)")
