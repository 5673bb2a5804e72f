"""Where Shoal keeps its state, and the defaults a host uses.

Resolution order for the root: explicit argument > $SHOAL_ROOT > `root` in the config file
($SHOAL_CONFIG, else /etc/shoal/config.toml) > /var/lib/shoal.
"""
from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from .core.errors import InvalidArgument

DEFAULT_ROOT = Path("/var/lib/shoal")
DEFAULT_CONFIG = Path("/etc/shoal/config.toml")
# shoald's socket: the directory is root:shoal 0750 and the socket root:shoal 0660, so members of the
# `shoal` group (and root) can reach the daemon and nobody else can
DEFAULT_SOCKET = Path("/run/shoal/shoald.sock")
SOCKET_GROUP = "shoal"


@dataclass(frozen=True)
class Settings:
    root: Path = DEFAULT_ROOT
    default_memory_mb: int = 512
    default_cpu: float = 1.0
    default_disk_mb: int = 1024
    default_pids: int = 512
    output_cap_bytes: int = 1 << 20
    compression: str | None = None  # None = uncompressed EROFS (fastest to read); "lz4" / "lz4hc"
    # paths left out of every snapshot by default (e.g. answer files, caches); empty = exact copy
    snapshot_exclude: tuple[str, ...] = ()
    max_stack_depth: int = 16  # snapshot chains deeper than this are folded
    fold_threshold_bytes: int = 64 << 20  # layers smaller than this may be folded together
    host_id: str = ""  # encoded in sandbox ids (sb-<host_id>-<hex>); default: this machine's hostname
    # named egress rules, e.g. {"pypi": ["<mirror host>:443"]}; only from the config file
    egress_presets: dict = field(default_factory=dict)
    # ---- [density] memory safety (density-oom; docs/density-safety.md) -------------------------
    oom_kill: str = "command"  # a sandbox's default oom_kill policy: "command" or "sandbox"
    sandboxes_memory_mb: int = 0  # all sandboxes' memory together; 0 = RAM - memory_reserve_mb
    memory_reserve_mb: int = 0  # RAM kept out of the sandboxes' reach; 0 = max(1 GiB, 10% of RAM)
    system_cgroup: str = "shoal-system"  # shoald's own memory cgroup; "" = stay where started (systemd)
    system_memory_min_mb: int = 256  # v2 memory.min of that cgroup (v1 has no such protection)
    # ---- [density] pooled memory cgroups (docs/density.md, "Pooled memory cgroups")
    memory_cgroup: str = "own"  # a sandbox's default: "own" memory cgroup, or "pooled"
    memory_pool_size: int = 64  # sandboxes per pooled memory cgroup
    # a sandbox's `cpu` is a cap, a CFS quota of its own; false: a weight only (cpu.shares / cpu.weight),
    # no cap, since every quota write walks all the host's task groups (docs/density.md, "CPU quotas")
    cpu_quota: bool = True
    # ---- end of density-oom's fields ---------------------------------------------------------
    # ---- [density] reclaim of idle sandboxes (docs/density.md): zram swap, idle pause, reclaim
    zram_mb: int = 0  # size of Shoal's zram swap device; 0 = shoald sets none up
    zram_algorithm: str = "lz4"  # a compressor the kernel's zram offers (lz4, lzo-rle, zstd...)
    zram_priority: int = 100  # swap priority: above disk swap, so reclaimed pages go to zram first
    zswap_compressor: str = ""  # zswap in front of the swap with this crypto compressor (deflate); "" = leave zswap
    sandbox_swap: float = 0.0  # swap a sandbox may fill under its own pressure, x its memory limit
    idle_pause_s: float = 0.0  # shoald pauses a sandbox idle this long; 0 = never
    reclaim_after_s: float = 0.0  # ... and reclaims it once idle this long; 0 = never
    reclaim_target: float = 0.75  # fraction of its anonymous memory an idle reclaim pushes out
    # ---- end [density] reclaim
    # registries (host[:port][/repository-prefix]) whose Shoal images may load lazily: their EROFS
    # layers reach the host kernel unchecked (shoal.lazy.trust); also $SHOAL_TRUSTED_REGISTRIES
    trusted_registries: tuple[str, ...] = ()
    extra: dict = field(default_factory=dict)

    @property
    def host_tag(self) -> str:
        """Short lowercase id of this host, part of every sandbox id so a front can route by id."""
        import re
        import socket

        raw = self.host_id or os.environ.get("SHOAL_HOST_ID") or socket.gethostname().split(".")[0]
        tag = re.sub(r"[^a-z0-9]", "", raw.lower())[:12]
        return tag or "local"

    @property
    def layers_dir(self) -> Path:
        return self.root / "layers"

    @property
    def mounts_dir(self) -> Path:
        return self.root / "mnt"

    @property
    def sandboxes_dir(self) -> Path:
        return self.root / "sandboxes"

    @property
    def tombstones_dir(self) -> Path:
        return self.root / "tombstones"

    @property
    def db_path(self) -> Path:
        return self.root / "shoal.db"

    @property
    def tmp_dir(self) -> Path:
        return self.root / "tmp"


def _density_reclaim(table: object, cfg_path: Path) -> dict:
    """The reclaim fields of the config's [density] table, checked (other [density] keys are
    read elsewhere)."""
    if not isinstance(table, dict):
        raise InvalidArgument(f"{cfg_path}: [density] must be a table")
    out: dict = {}
    numbers = {"zram_mb": int, "zram_priority": int, "sandbox_swap": float, "idle_pause_s": float,
               "reclaim_after_s": float, "reclaim_target": float}
    for key, kind in numbers.items():
        if key not in table:
            continue
        v = table[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or (kind is int and not isinstance(v, int)):
            raise InvalidArgument(f"{cfg_path}: [density] {key} must be a non-negative "
                                  f"{'integer' if kind is int else 'number'}, got {v!r}")
        out[key] = kind(v)
    if "reclaim_target" in out and not 0 < out["reclaim_target"] <= 1:
        raise InvalidArgument(f"{cfg_path}: [density] reclaim_target must be in (0, 1], got {out['reclaim_target']}")
    if "zram_algorithm" in table:
        if not isinstance(table["zram_algorithm"], str):
            raise InvalidArgument(f"{cfg_path}: [density] zram_algorithm must be a string")
        out["zram_algorithm"] = table["zram_algorithm"]
    if "zswap_compressor" in table:
        v = table["zswap_compressor"]
        if not isinstance(v, str) or (v and not v.replace("-", "").isalnum()):
            raise InvalidArgument(f"{cfg_path}: [density] zswap_compressor must be a compressor name "
                                  f"or \"\", got {v!r}")
        out["zswap_compressor"] = v
    return out


def load_settings(root: str | os.PathLike | None = None) -> Settings:
    cfg_path = Path(os.environ.get("SHOAL_CONFIG", DEFAULT_CONFIG))
    data: dict = {}
    if cfg_path.is_file():
        try:
            data = tomllib.loads(cfg_path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise InvalidArgument(f"config file {cfg_path} is not valid TOML: {e}") from e
    chosen = root or os.environ.get("SHOAL_ROOT") or data.get("root") or DEFAULT_ROOT
    known = {k: data[k] for k in ("default_memory_mb", "default_cpu", "default_disk_mb", "default_pids",
                                  "output_cap_bytes", "compression", "max_stack_depth",
                                  "fold_threshold_bytes", "host_id") if k in data}
    if "egress_presets" in data:
        presets = data["egress_presets"]
        if not isinstance(presets, dict) or not all(isinstance(v, list) for v in presets.values()):
            raise InvalidArgument(f"{cfg_path}: egress_presets must map names to lists of addresses")
        known["egress_presets"] = presets
    if "trusted_registries" in data:
        from .lazy.trust import check_entry

        regs = data["trusted_registries"]
        if not isinstance(regs, list) or not all(isinstance(r, str) for r in regs):
            raise InvalidArgument(f"{cfg_path}: trusted_registries must be a list of \"host[:port][/prefix]\" strings")
        known["trusted_registries"] = tuple(check_entry(r) for r in regs)
    if "snapshot_exclude" in data:
        known["snapshot_exclude"] = tuple(str(p).strip("/") for p in data["snapshot_exclude"])
    known.update(_density_reclaim(data.get("density", {}), cfg_path))
    known.update(_density_oom_settings(data.get("density"), cfg_path))
    unknown = set(data) - set(known) - {"root", "density"}
    return Settings(root=Path(chosen).absolute(), extra={k: data[k] for k in unknown}, **known)


# ---- [density] memory safety (density-oom) -----------------------------------------------------
_DENSITY_OOM_INTS = ("sandboxes_memory_mb", "memory_reserve_mb", "system_memory_min_mb")
# a pool's OOM kill takes its biggest task, whoever's it is: past a few thousand members a pool is the
# one shared cgroup again
MAX_MEMORY_POOL_SIZE = 4096


def _density_oom_settings(table: object, cfg_path: Path) -> dict:
    """density-oom's fields of the [density] table (other [density] fields are read elsewhere)."""
    if table is None:
        return {}
    if not isinstance(table, dict):
        raise InvalidArgument(f"{cfg_path}: [density] must be a table")
    out: dict = {}
    for k in _DENSITY_OOM_INTS:
        if k in table:
            v = table[k]
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise InvalidArgument(f"{cfg_path}: density.{k} must be an integer >= 0 (MiB), got {v!r}")
            out[k] = v
    if "oom_kill" in table:
        if table["oom_kill"] not in ("command", "sandbox"):
            raise InvalidArgument(f"{cfg_path}: density.oom_kill must be 'command' or 'sandbox', "
                                  f"got {table['oom_kill']!r}")
        out["oom_kill"] = table["oom_kill"]
    if "memory_cgroup" in table:
        if table["memory_cgroup"] not in ("own", "pooled"):
            raise InvalidArgument(f"{cfg_path}: density.memory_cgroup must be 'own' or 'pooled', "
                                  f"got {table['memory_cgroup']!r}")
        out["memory_cgroup"] = table["memory_cgroup"]
    if "memory_pool_size" in table:
        v = table["memory_pool_size"]
        if isinstance(v, bool) or not isinstance(v, int) or not 2 <= v <= MAX_MEMORY_POOL_SIZE:
            raise InvalidArgument(f"{cfg_path}: density.memory_pool_size must be an integer from 2 to "
                                  f"{MAX_MEMORY_POOL_SIZE} (sandboxes per pooled memory cgroup), got {v!r}")
        out["memory_pool_size"] = v
    if "cpu_quota" in table:
        if not isinstance(table["cpu_quota"], bool):
            raise InvalidArgument(f"{cfg_path}: density.cpu_quota must be true (cpu is a cap) or false (a weight), "
                                  f"got {table['cpu_quota']!r}")
        out["cpu_quota"] = table["cpu_quota"]
    if "system_cgroup" in table:
        v = table["system_cgroup"]
        if not isinstance(v, str) or "/" in v or v.startswith("."):
            raise InvalidArgument(f"{cfg_path}: density.system_cgroup must be a cgroup name (no '/'), got {v!r}")
        out["system_cgroup"] = v
    return out


def sandboxes_memory_limit_mb(settings: Settings, total_mb: int | None = None) -> int:
    """The memory all sandboxes of this root may use together (MiB): density.sandboxes_memory_mb if set,
    else RAM minus density.memory_reserve_mb (default max(1 GiB, 10% of RAM)), at least 64 MiB."""
    if settings.sandboxes_memory_mb:
        return settings.sandboxes_memory_mb
    if total_mb is None:
        total_mb = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") >> 20
    reserve = settings.memory_reserve_mb or max(1024, total_mb // 10)
    return max(64, total_mb - reserve)
# ---- end density-oom --------------------------------------------------------------------------


# ---- ksm: the [ksm] section (the container backend runs ksmd by it; shoald's create route reads `tenants`)
@dataclass(frozen=True)
class KsmConfig:
    """The [ksm] section of the config file (docs/ksm-and-scheduling.md)."""

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
