"""Shoal's own compressed swap: one zram device, set up when the operator enables it.

Reclaimed sandbox memory has to go somewhere; a zram device keeps it in RAM, compressed (about 2-4x
for interpreter heaps), so pushing an idle sandbox out costs CPU, not disk I/O, and paging it back
in on resume is a decompression. Shoal never touches a zram device it did not make: it asks the
kernel for a fresh one (`/sys/class/zram-control/hot_add`), records it in a state file
(`/run/shoal/zram.json`), and `teardown()` removes exactly that one. `setup()` is idempotent: a
second call with the same settings finds the device in the state file and returns it.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import struct
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ...core.errors import BackendUnavailable, InvalidArgument, SandboxError

if TYPE_CHECKING:
    from ...config import Settings

STATE_PATH = Path("/run/shoal/zram.json")
ZRAM_CONTROL = Path("/sys/class/zram-control")
SYS_BLOCK = Path("/sys/block")
_SWAP_FLAG_PREFER, _SWAP_PRIO_MASK = 0x8000, 0x7FFF
_PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class ZramConfig:
    size_mb: int
    algorithm: str = "lz4"
    priority: int = 100  # above a disk swap's default (-2...), so reclaimed pages land here first

    def check(self) -> None:
        if isinstance(self.size_mb, bool) or not isinstance(self.size_mb, int) or self.size_mb <= 0:
            raise InvalidArgument(f"zram size must be a positive number of MiB, got {self.size_mb!r}")
        if not isinstance(self.algorithm, str) or not self.algorithm.replace("-", "").isalnum():
            raise InvalidArgument(f"zram algorithm must be a name such as lz4 or lzo-rle, got {self.algorithm!r}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int) or \
                not 0 <= self.priority <= _SWAP_PRIO_MASK:
            raise InvalidArgument(f"zram priority must be an integer in [0, {_SWAP_PRIO_MASK}], got {self.priority!r}")


@dataclass(frozen=True)
class ZramDevice:
    index: int
    size_mb: int
    algorithm: str
    priority: int

    @property
    def name(self) -> str:
        return f"zram{self.index}"

    @property
    def path(self) -> str:
        return f"/dev/{self.name}"

    def stats(self) -> dict[str, int | float]:
        """The device's own accounting (mm_stat): bytes stored, their compressed size, RAM used."""
        fields = (SYS_BLOCK / self.name / "mm_stat").read_text().split()
        orig, compr, used = int(fields[0]), int(fields[1]), int(fields[2])
        return {"orig_data_size": orig, "compr_data_size": compr, "mem_used_total": used,
                "same_pages": int(fields[5]) if len(fields) > 5 else 0,
                "compression_ratio": round(orig / compr, 3) if compr else 0.0,
                "ratio_with_overhead": round(orig / used, 3) if used else 0.0}


def config_of(settings: Settings) -> ZramConfig | None:
    """The zram device the config asks for ([density] zram_mb, zram_algorithm, zram_priority), or None."""
    if not settings.zram_mb:
        return None
    return ZramConfig(settings.zram_mb, settings.zram_algorithm, settings.zram_priority)


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def swaps() -> dict[str, int]:
    """Active swap areas: device path -> priority (from /proc/swaps)."""
    out = {}
    with open("/proc/swaps") as f:
        next(f, None)
        for line in f:
            parts = line.split()
            if len(parts) >= 5:
                out[parts[0]] = int(parts[4])
    return out


@contextmanager
def state_lock(state: Path) -> Iterator[None]:
    """An exclusive flock beside a state file (zram's and zswap's): one set-up or tear-down at a time."""
    state.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(str(state) + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _read_state(state: Path) -> ZramDevice | None:
    try:
        return ZramDevice(**json.loads(state.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def current(state: Path = STATE_PATH) -> ZramDevice | None:
    """Shoal's zram device if it is set up and swapping, else None."""
    dev = _read_state(state)
    if dev is None or dev.path not in swaps():
        return None
    return dev


def _write_swap_header(path: str, size: int) -> None:
    """What mkswap writes: a version-1 header in the first page, the magic at its end."""
    header = bytearray(_PAGE)
    last_page = size // _PAGE - 1
    struct.pack_into("=III16s16s", header, 1024, 1, last_page, 0, uuid.uuid4().bytes, b"shoal-zram")
    header[_PAGE - 10:_PAGE] = b"SWAPSPACE2"
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.pwrite(fd, bytes(header), 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def _hot_add() -> int:
    if not ZRAM_CONTROL.is_dir():
        subprocess.run(["modprobe", "zram", "num_devices=0"], capture_output=True, check=False)
    if not ZRAM_CONTROL.is_dir():
        raise BackendUnavailable("zram is not available on this kernel (no /sys/class/zram-control; "
                                 "load the zram module, or set zram_mb = 0 in the config's density table)")
    return int((ZRAM_CONTROL / "hot_add").read_text())


def _release(index: int) -> None:
    """Reset and remove a zram device of ours (it must not be swapping any more)."""
    d = SYS_BLOCK / f"zram{index}"
    if not d.exists():
        return
    for _ in range(50):  # EBUSY while the kernel still holds the device open after swapoff
        try:
            (d / "reset").write_text("1")
            break
        except OSError:
            time.sleep(0.02)
    try:
        (ZRAM_CONTROL / "hot_remove").write_text(str(index))
    except OSError:
        pass


def setup(cfg: ZramConfig, state: Path = STATE_PATH) -> ZramDevice:
    """Shoal's zram swap device with these settings (made now, or the one already there)."""
    cfg.check()
    with state_lock(state):
        dev = current(state)
        if dev is not None:
            if (dev.size_mb, dev.algorithm, dev.priority) == (cfg.size_mb, cfg.algorithm, cfg.priority):
                return dev
            _teardown(dev, state)  # settings changed: a device's size and algorithm are fixed once set
        else:
            stale = _read_state(state)
            if stale is not None:  # recorded but not swapping (a crash mid-setup): free it
                _release(stale.index)
                state.unlink(missing_ok=True)
        index = _hot_add()
        d = SYS_BLOCK / f"zram{index}"
        try:
            algorithms = (d / "comp_algorithm").read_text().replace("[", "").replace("]", "").split()
            if cfg.algorithm not in algorithms:
                raise InvalidArgument(f"zram algorithm {cfg.algorithm!r} is not offered by this kernel "
                                      f"(have: {', '.join(algorithms)})")
            (d / "comp_algorithm").write_text(cfg.algorithm)
            (d / "disksize").write_text(str(cfg.size_mb << 20))
            dev = ZramDevice(index, cfg.size_mb, cfg.algorithm, cfg.priority)
            _write_swap_header(dev.path, cfg.size_mb << 20)
            flags = _SWAP_FLAG_PREFER | (cfg.priority & _SWAP_PRIO_MASK)
            if _libc().swapon(dev.path.encode(), flags) != 0:
                err = ctypes.get_errno()
                raise SandboxError(f"swapon {dev.path}: {os.strerror(err)}")
        except BaseException:
            _release(index)
            raise
        tmp = state.with_name(state.name + ".tmp")
        tmp.write_text(json.dumps(asdict(dev)))
        os.replace(tmp, state)
        return dev


def _swapoff(path: str, wait_s: float = 15.0) -> None:
    """swapoff, retried for a while: it fails with ENOMEM while a page it must bring back belongs to a
    cgroup at its limit (a sandbox being killed, or one at its limit that swapped), until that ends."""
    deadline = time.monotonic() + wait_s
    while _libc().swapoff(path.encode()) != 0:
        err = ctypes.get_errno()
        if err not in (errno.ENOMEM, errno.EBUSY, errno.EINTR) or time.monotonic() > deadline:
            raise SandboxError(f"swapoff {path}: {os.strerror(err)} (the device stays in use)")
        time.sleep(0.5)


def _teardown(dev: ZramDevice, state: Path) -> None:
    if dev.path in swaps():
        _swapoff(dev.path)
    _release(dev.index)
    state.unlink(missing_ok=True)


def teardown(state: Path = STATE_PATH) -> bool:
    """Stop swapping to Shoal's zram device and remove it; False if there was none."""
    with state_lock(state):
        dev = _read_state(state)
        if dev is None:
            return False
        _teardown(dev, state)
        return True
