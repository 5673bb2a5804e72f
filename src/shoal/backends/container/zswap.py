"""The kernel's zswap in front of Shoal's swap, with a compressor zram's backends may lack.

zram compresses with the backends built into it (on many kernels only lzo, lzo-rle and lz4: about
3x on Python heaps). zswap compresses swapped-out pages through the crypto API instead, which often
offers deflate (about 5x on the same heaps; bench/results/reclaim.json), and keeps them in RAM in front
of the swap device; only what it rejects (pages that do not compress) reaches the device. With
`[density] zswap_compressor = "deflate"`, shoald turns zswap on with that compressor when it starts.

zswap is one host-wide setting, not a device: it applies to every swap area. So setup() records the
values it found (`/run/shoal/zswap.json`) before changing them, and teardown() puts exactly those back.
Pages already in zswap stay there after a teardown until they are touched or freed.
"""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path

from ...core.errors import BackendUnavailable, InvalidArgument
from .zram import state_lock

STATE_PATH = Path("/run/shoal/zswap.json")
PARAMS = Path("/sys/module/zswap/parameters")


def _param(name: str) -> str:
    return (PARAMS / name).read_text().strip()


def _set(name: str, value: str) -> None:
    with open(PARAMS / name, "w") as f:
        f.write(value)


def available() -> bool:
    return (PARAMS / "enabled").exists()


def settings() -> dict[str, str]:
    """zswap's current parameters (enabled, compressor, max_pool_percent, ...)."""
    return {p.name: p.read_text().strip() for p in PARAMS.iterdir()} if available() else {}


def stats() -> dict[str, int]:
    """Host-wide: RAM zswap's pool uses (`Zswap:` in /proc/meminfo) and the bytes it holds (`Zswapped:`)."""
    out = {"pool_bytes": 0, "stored_bytes": 0}
    with open("/proc/meminfo") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k == "Zswap":
                out["pool_bytes"] = int(v.split()[0]) * 1024
            elif k == "Zswapped":
                out["stored_bytes"] = int(v.split()[0]) * 1024
    return out


def _check_name(compressor: object) -> str:
    if not isinstance(compressor, str) or not compressor or not compressor.replace("-", "").isalnum():
        raise InvalidArgument(f"zswap compressor must be a name such as deflate or lzo, got {compressor!r}")
    return compressor


def current(state: Path = STATE_PATH) -> str | None:
    """The compressor Shoal turned zswap on with, if it did and zswap is still on; else None."""
    if not state.exists() or not available():
        return None
    try:
        ours = json.loads(state.read_text())["compressor"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return ours if _param("enabled") in ("Y", "1") and _param("compressor") == ours else None


def setup(compressor: str, state: Path = STATE_PATH) -> str:
    """Turn zswap on with this compressor; the values found before are recorded for teardown()."""
    _check_name(compressor)
    if not available():
        raise BackendUnavailable("zswap is not available on this kernel (no /sys/module/zswap); "
                                 "set zswap_compressor = \"\" in the config's density table")
    with state_lock(state):
        if not state.exists():  # the first setup records the host's own values; a repeated one keeps them
            before = {"enabled": _param("enabled"), "compressor": _param("compressor")}
            tmp = state.with_name(state.name + ".tmp")
            tmp.write_text(json.dumps({"before": before, "compressor": compressor}))
            os.replace(tmp, state)
        else:
            rec = json.loads(state.read_text())
            rec["compressor"] = compressor
            state.write_text(json.dumps(rec))
        try:
            if _param("compressor") != compressor:
                _set("compressor", compressor)
            _set("enabled", "Y")
        except OSError as e:
            _restore(state)
            if e.errno in (errno.EINVAL, errno.ENOENT):
                raise InvalidArgument(f"zswap compressor {compressor!r} is not offered by this kernel's crypto "
                                      f"API (see /proc/crypto; {e.strerror})") from None
            raise
        return compressor


def _restore(state: Path) -> bool:
    try:
        before = json.loads(state.read_text())["before"]
    except (OSError, ValueError, KeyError, TypeError):
        state.unlink(missing_ok=True)
        return False
    if available():
        if before.get("compressor") and _param("compressor") != before["compressor"]:
            try:
                _set("compressor", before["compressor"])
            except OSError:
                pass  # that compressor went away: leave ours, but still put `enabled` back
        _set("enabled", before.get("enabled", "N"))
    state.unlink(missing_ok=True)
    return True


def teardown(state: Path = STATE_PATH) -> bool:
    """Put zswap's settings back to what setup() found; False if Shoal had not changed them."""
    with state_lock(state):
        return _restore(state)
