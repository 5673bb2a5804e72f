"""KSM (kernel same-page merging) for sandboxes that opt in with `ksm=True` (docs/ksm-and-scheduling.md).

Two halves:
- per sandbox, shoal-init's `--ksm 1` marks every process mergeable (prctl PR_SET_MEMORY_MERGE,
  Linux >= 6.4); `probe()` says whether this kernel has it;
- per host, ksmd (the scanner) must run for anything to merge. `KsmHost` starts it the first time a
  ksm sandbox is created, with the pace from the config's [ksm] section, unless the operator manages
  ksmd itself (`manage = false`). It is never stopped by Shoal: other users of the host may rely on it.

Stats come from /proc/<pid>/ksm_stat (ksm_merging_pages: this process's pages that are merged) and
/sys/kernel/mm/ksm (host totals).
"""
from __future__ import annotations

import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

from ...core.errors import InvalidArgument, SandboxError

KSM_SYSFS = Path("/sys/kernel/mm/ksm")
PAGE_SIZE = 4096


@dataclass(frozen=True)
class KsmConfig:
    """The [ksm] section of the config file."""

    manage: bool = True  # start ksmd (run=1) when the first ksm sandbox is created
    pages_to_scan: int = 1000  # pages ksmd scans per wake-up (kernel default 100: slow to converge)
    sleep_millisecs: int = 50  # ksmd's sleep between scans (kernel default 20)
    # may shoald's tenants ask for ksm=True? Merged pages are a timing side channel between every ksm
    # sandbox on the host, whoever owns it; so by default only the admin (or an in-process root) may
    tenants: bool = False

    @classmethod
    def from_settings(cls, extra: dict) -> KsmConfig:
        raw = extra.get("ksm", {})
        if not isinstance(raw, dict):
            raise InvalidArgument("config: [ksm] must be a table")
        unknown = set(raw) - {"manage", "pages_to_scan", "sleep_millisecs", "tenants"}
        if unknown:
            raise InvalidArgument(f"config [ksm]: unknown keys {', '.join(sorted(unknown))}")
        cfg = cls(**raw)
        for flag in ("manage", "tenants"):
            if not isinstance(getattr(cfg, flag), bool):
                raise InvalidArgument(f"config [ksm] {flag} must be true or false, got {getattr(cfg, flag)!r}")
        for name in ("pages_to_scan", "sleep_millisecs"):
            v = getattr(cfg, name)
            if isinstance(v, bool) or not isinstance(v, int) or not (0 < v <= 1_000_000):
                raise InvalidArgument(f"config [ksm] {name} must be an integer in 1..1000000, got {v!r}")
        return cfg


_probe_lock = threading.Lock()
_probe_result: dict[str, str] = {}


def probe(helper: str) -> str:
    """"ok", or why this kernel cannot merge a sandbox's pages (asked once per helper binary)."""
    with _probe_lock:
        if helper not in _probe_result:
            if not (KSM_SYSFS / "run").exists():
                _probe_result[helper] = "unsupported: this kernel has no KSM (/sys/kernel/mm/ksm missing; CONFIG_KSM)"
            else:
                proc = subprocess.run([helper, "ksm-probe"], capture_output=True, text=True, env={})
                _probe_result[helper] = proc.stdout.strip() or proc.stderr.strip() or f"exit {proc.returncode}"
        return _probe_result[helper]


def read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


class KsmHost:
    """The host's ksmd: its settings and totals."""

    def __init__(self, config: KsmConfig, sysfs: Path = KSM_SYSFS):
        self.config = config
        self.sysfs = sysfs
        self._started = False
        self._lock = threading.Lock()

    def ensure_running(self) -> None:
        """Start ksmd with the configured pace (once per process; a no-op with manage = false)."""
        if not self.config.manage or self._started:
            return
        with self._lock:
            if self._started:
                return
            try:
                self._write("pages_to_scan", self.config.pages_to_scan)
                self._write("sleep_millisecs", self.config.sleep_millisecs)
                if read_int(self.sysfs / "run") != 1:
                    self._write("run", 1)
            except OSError as e:
                raise SandboxError(f"cannot start ksmd ({self.sysfs}): {e}") from e
            self._started = True

    def _write(self, name: str, value: int) -> None:
        (self.sysfs / name).write_text(str(value))

    def stats(self) -> dict[str, int | None]:
        """Host totals: pages_shared (KSM pages kept), pages_sharing (mappings saved), full_scans, ..."""
        names = ("run", "pages_to_scan", "sleep_millisecs", "pages_shared", "pages_sharing", "pages_unshared",
                 "pages_volatile", "full_scans", "general_profit", "ksm_zero_pages")
        return {n: read_int(self.sysfs / n) for n in names}


def process_stat(pid: int) -> dict[str, int | str]:
    """/proc/<pid>/ksm_stat as a dict (ksm_merging_pages, ksm_merge_any: yes|no, ...); {} if gone."""
    out: dict[str, int | str] = {}
    try:
        text = Path(f"/proc/{pid}/ksm_stat").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        key, _, value = line.replace(":", " ").partition(" ")
        value = value.strip()
        out[key] = int(value) if value.lstrip("-").isdigit() else value
    return out


def merging_pages(pids: list[int]) -> int:
    """Pages of these processes that KSM has merged (the sum of their ksm_merging_pages)."""
    total = 0
    for pid in pids:
        v = process_stat(pid).get("ksm_merging_pages", 0)
        total += v if isinstance(v, int) else 0
    return total
