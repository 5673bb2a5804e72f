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
from pathlib import Path

from ...config import KsmConfig as KsmConfig  # the [ksm] section, in config.py (shoald's routes read it too)
from ...core.errors import SandboxError

KSM_SYSFS = Path("/sys/kernel/mm/ksm")
PAGE_SIZE = 4096

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
