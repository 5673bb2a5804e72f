"""The layer store: immutable, content-addressed EROFS layers and named images (layer stacks).

On disk, under the Shoal root:
    layers/<hex>.erofs    one EROFS image per layer, named by its content digest
    mnt/<hex>/            where that image is mounted, once per host, shared by all sandboxes
    lazy layers           registered with a chunk index and an origin instead of an image file
                          (`add_lazy_layer`): mounted from `lazyfs/<hex>.erofs`, read on demand
                          through the chunk cache `chunks/` (shoal.lazy, docs/lazy-loading.md)
    shoal.db              SQLite (WAL): layer metadata, layer names, images and their layer lists
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import sqlite3
import tempfile
import threading
import time
import tomllib
from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Protocol

from ..config import Settings
from ..core.errors import (
    BadDigest,
    BuildError,
    CorruptArchive,
    ImageNotFound,
    InvalidArgument,
    LayerInUse,
    LayerNotFound,
)
from ..core.sqlite import transaction
from ..lazy.chunks import ChunkIndex
from . import archive, erofs
from .digest import tree_digest
from .fold import fold_trees

_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
_PREFIX_RE = re.compile(r"^(sha256:)?[0-9a-f]{6,64}$")
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._/-]{0,127}$")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS layers (
    digest TEXT PRIMARY KEY, size INTEGER NOT NULL, image_bytes INTEGER NOT NULL,
    entries INTEGER NOT NULL, created REAL NOT NULL, source TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS layer_names (
    name TEXT PRIMARY KEY, digest TEXT NOT NULL REFERENCES layers(digest));
CREATE TABLE IF NOT EXISTS images (
    name TEXT NOT NULL, tag TEXT NOT NULL, created REAL NOT NULL, config TEXT NOT NULL DEFAULT '{}',
    PRIMARY KEY (name, tag));
CREATE TABLE IF NOT EXISTS build_cache (
    key TEXT PRIMARY KEY, digest TEXT NOT NULL, step TEXT NOT NULL, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS lazy_layers (
    digest TEXT PRIMARY KEY, origin TEXT NOT NULL, chunk_index TEXT NOT NULL, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS image_layers (
    name TEXT NOT NULL, tag TEXT NOT NULL, position INTEGER NOT NULL, digest TEXT NOT NULL,
    PRIMARY KEY (name, tag, position));
"""


@dataclass(frozen=True)
class LayerInfo:
    digest: str
    size: int  # bytes of file content
    image_bytes: int  # bytes of the EROFS image on disk
    entries: int
    created: float
    source: str
    names: tuple[str, ...] = ()

    @property
    def hex(self) -> str:
        return self.digest.split(":", 1)[1]

    @property
    def short(self) -> str:
        return self.hex[:12]


@dataclass(frozen=True)
class ImageInfo:
    name: str
    tag: str
    layers: tuple[str, ...]  # digests, bottom -> top
    created: float
    config: dict = field(default_factory=dict)  # {"env": {...}, "workdir": "/..."} from a recipe

    @property
    def ref(self) -> str:
        return f"{self.name}:{self.tag}"


def split_ref(ref: str) -> tuple[str, str]:
    name, _, tag = ref.partition(":")
    tag = tag or "latest"
    if not _NAME_RE.match(name) or not re.match(r"^[A-Za-z0-9_.-]{1,128}$", tag):
        raise InvalidArgument(f"invalid image reference {ref!r}: expected NAME[:TAG] with lowercase name")
    return name, tag


class ImageSource(Protocol):
    """Where a host gets images it lacks: another host's store (a shared filesystem) or a registry
    (shoal.registry.source.RegistrySource). ImageNotFound when the source has no such image."""

    def pull_into(self, store: LayerStore, ref: str) -> ImageInfo:
        ...


class LayerStore:
    def __init__(self, settings: Settings):
        self.settings = settings
        for d in (settings.root, settings.layers_dir, settings.mounts_dir, settings.tmp_dir):
            d.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(settings.db_path, timeout=30, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA busy_timeout=30000")
        self._db.execute("PRAGMA synchronous=NORMAL")  # WAL: durable on commit order, no fsync each
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        self._db.close()

    # ---------------------------------------------------------------- internals
    @contextmanager
    def _tx(self):
        with self._lock, transaction(self._db) as db:  # one connection shared by threads: the lock orders them
            yield db

    def _query(self, sql: str, args: Iterable = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, tuple(args)).fetchall()

    @contextmanager
    def _host_lock(self, name: str):
        """A cross-process lock (flock) under the root, e.g. around mounting a layer."""
        path = self.settings.root / f".{name}.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def image_path(self, digest: str) -> Path:
        return self.settings.layers_dir / f"{digest.split(':', 1)[1]}.erofs"

    def mount_path(self, digest: str) -> Path:
        return self.settings.mounts_dir / digest.split(":", 1)[1]

    def _info(self, row: tuple) -> LayerInfo:
        names = tuple(r[0] for r in self._query("SELECT name FROM layer_names WHERE digest=? ORDER BY name", [row[0]]))
        digest, size, image_bytes, entries, created, source = row[:6]
        return LayerInfo(digest, size, image_bytes, entries, created, source, names=names)

    # ---------------------------------------------------------------- building
    def build_from_dir(self, src: str | os.PathLike, source: str | None = None, name: str | None = None,
                       exclude: Iterable[str] = ()) -> LayerInfo:
        """Build (or find) the layer holding exactly the tree under `src`, minus `exclude`d paths."""
        src_path = Path(src)
        if not src_path.is_dir():
            raise InvalidArgument(f"layer source {src_path} is not a directory")
        excluded = sorted({p.strip("/") for p in exclude if p.strip("/")})
        digest, size, entries = tree_digest(src_path, frozenset(excluded))
        existing = self._query("SELECT * FROM layers WHERE digest=?", [digest])
        if existing and self.image_path(digest).exists():
            if name:
                self.tag_layer(name, digest)
            return self.get(digest)
        tmp = Path(tempfile.mkstemp(dir=self.settings.tmp_dir, suffix=".erofs")[1])
        try:
            erofs.build_image(src_path, tmp, self.settings.compression, excluded)
            image_bytes = tmp.stat().st_size
            os.chmod(tmp, 0o444)
            os.replace(tmp, self.image_path(digest))  # atomic: readers never see half an image
        finally:
            tmp.unlink(missing_ok=True)
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO layers VALUES (?,?,?,?,?,?)",
                       (digest, size, image_bytes, entries, time.time(), source or f"dir:{src_path.absolute()}"))
        if name:
            self.tag_layer(name, digest)
        return self.get(digest)

    @contextmanager
    def _scratch(self):
        d = Path(tempfile.mkdtemp(dir=self.settings.tmp_dir, prefix="build-"))
        try:
            yield d
        finally:
            shutil.rmtree(d, ignore_errors=True)

    def build_from_tar(self, stream: IO[bytes] | None = None, path: str | os.PathLike | None = None,
                       source: str | None = None, name: str | None = None,
                       check: Callable[[], None] | None = None) -> LayerInfo:
        """Build a layer from a tar stream or file (gzip/bz2/xz accepted; OCI whiteouts translated).

        `check` runs after extraction and before anything is stored: a caller that hashes the stream
        as it is read (a registry pull checking a diff_id) raises there, and no layer is created."""
        if stream is None and path is None:
            raise InvalidArgument("build_from_tar needs a stream or a path")
        if path is not None and not Path(path).is_file():
            raise InvalidArgument(f"tar file {path} does not exist")
        with self._scratch() as d:
            root = d / "root"
            root.mkdir()
            archive.extract_layer_tar(stream, root, Path(path) if path else None)
            if check is not None:
                check()
            return self.build_from_dir(root, source=source or (f"tar:{path}" if path else "tar:stream"), name=name)

    def has_layer(self, digest: str) -> bool:
        """Whether the layer's row and its EROFS image are both here (a pull skips such layers)."""
        return bool(self._query("SELECT 1 FROM layers WHERE digest=?", [digest])) and self.image_path(digest).exists()

    def add_erofs(self, path: str | os.PathLike, digest: str, source: str, verify: bool = True,
                  size: int | None = None, entries: int | None = None) -> LayerInfo:
        """Install a ready EROFS image (e.g. a blob pulled from a registry) as layer `digest`.

        The file is moved in when it lives under the root's tmp dir, copied otherwise. With `verify`
        (the default) the image is mounted once and its tree digest recomputed: a blob whose
        annotation names another tree is refused with BadDigest and nothing is stored. Without it,
        the caller vouches for `digest` and must give `size` and `entries` (the layer's metadata)."""
        if not _DIGEST_RE.match(digest):
            raise BadDigest(f"bad layer digest {digest!r}: expected sha256:<64 hex>")
        if self.has_layer(digest):
            return self.get(digest)
        src = Path(path)
        if not src.is_file():
            raise InvalidArgument(f"EROFS image {src} does not exist")
        tmp = Path(tempfile.mkstemp(dir=self.settings.tmp_dir, suffix=".erofs")[1])
        try:
            if src.parent.resolve() == self.settings.tmp_dir.resolve():
                os.replace(src, tmp)
            else:
                shutil.copyfile(src, tmp)
            if verify:
                size, entries = self._verify_erofs(tmp, digest)
            elif size is None or entries is None:
                raise InvalidArgument("add_erofs without verify needs the layer's size and entries")
            os.chmod(tmp, 0o444)
            image_bytes = tmp.stat().st_size
            os.replace(tmp, self.image_path(digest))
        finally:
            tmp.unlink(missing_ok=True)
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO layers VALUES (?,?,?,?,?,?)",
                       (digest, size, image_bytes, entries, time.time(), source))
        return self.get(digest)

    def verify_image(self, image: str | os.PathLike, digest: str) -> tuple[int, int]:
        """(size, entries) if the EROFS image `image` holds tree `digest`; BadDigest otherwise (a
        private mount: root)."""
        return self._verify_erofs(Path(image), digest)

    def _verify_erofs(self, image: Path, digest: str) -> tuple[int, int]:
        """Mount `image` privately, recompute its tree digest; (size, entries) if it is `digest`."""
        try:  # the image came from elsewhere: userspace checks it before the kernel parses it
            erofs.fsck_image(image)
        except BuildError as e:
            raise BadDigest(f"layer {digest}: {e}") from None
        with self._scratch() as d:
            mnt = d / "mnt"
            mnt.mkdir()
            try:
                erofs.mount_image(image, mnt)
            except PermissionError:
                raise InvalidArgument(f"installing layer {digest} mounts it to check its tree: that needs root "
                                      "(pulling into a host's store is the operator's step)") from None
            except OSError as e:
                raise BadDigest(f"layer {digest}: the image is not a mountable EROFS image ({e})") from e
            try:
                got, size, entries = tree_digest(mnt)
            finally:
                erofs.unmount(mnt)
        if got != digest:
            raise BadDigest(f"layer image holds tree {got}, not {digest}: refused")
        return size, entries

    def pull_image(self, source: LayerStore, ref: str) -> ImageInfo:
        """Copy an image and the layers it lacks from another store (another host's root: a shared
        filesystem, or a registry mirror). Layer files are hard-linked when both stores share a
        filesystem. Content addressing makes it safe to pull the same image twice."""
        info = source.get_image(ref)
        for digest in info.layers:
            if self._query("SELECT 1 FROM layers WHERE digest=?", [digest]) and self.image_path(digest).exists():
                continue
            row = source._query("SELECT * FROM layers WHERE digest=?", [digest])
            if not row:
                raise LayerNotFound(f"layer {digest} of {ref} is missing from {source.settings.root}")
            lazy = source.lazy_layer(digest)
            if lazy is not None:  # its origin stays recorded even once promoted: ensure_mounted checks its trust
                self.add_lazy_layer(lazy[0], lazy[1], size=row[0][1], entries=row[0][3], source=row[0][5])
                if not source.image_path(digest).exists():
                    continue
            tmp = self.settings.tmp_dir / f"pull-{digest.split(':', 1)[1]}-{os.getpid()}"
            try:
                os.link(source.image_path(digest), tmp)
            except OSError:
                shutil.copyfile(source.image_path(digest), tmp)
            os.replace(tmp, self.image_path(digest))
            with self._tx() as db:
                db.execute("INSERT OR REPLACE INTO layers VALUES (?,?,?,?,?,?)", row[0])
        return self.create_image(ref, list(info.layers), config=info.config)

    def pull_into(self, store: LayerStore, ref: str) -> ImageInfo:
        """This store as an ImageSource: copy image `ref` into `store` (see pull_image)."""
        return store.pull_image(self, ref)

    def add_lazy_layer(self, index: ChunkIndex, origin: dict, size: int = 0, entries: int = 0,
                       source: str | None = None, name: str | None = None) -> LayerInfo:
        """Register layer `index.layer` whose EROFS image stays at `origin` (an origin spec, see
        shoal.lazy.layer): it is usable in images at once and read on demand when mounted. `size` and
        `entries` describe its tree when known. A layer already here (local or lazy) is kept."""
        from ..lazy.layer import describe_spec, spec_key

        digest = index.layer
        if not _DIGEST_RE.match(digest):
            raise BadDigest(f"bad layer digest {digest!r} in the chunk index")
        spec_key(origin)
        if "token" in origin or "password" in origin:
            raise InvalidArgument("an origin spec names credentials (token_env), it never holds them")
        url = origin.get("url")
        if isinstance(url, str) and "@" in url.partition("//")[2].partition("/")[0]:  # user:password@host
            raise InvalidArgument("an origin URL with user:password would keep them in the layer store: "
                                  "give a token through token_env (an environment variable's name) instead")
        with self._tx() as db:
            db.execute("INSERT OR IGNORE INTO layers VALUES (?,?,?,?,?,?)",
                       (digest, size, index.size, entries, time.time(), source or f"lazy:{describe_spec(origin)}"))
            db.execute("INSERT OR REPLACE INTO lazy_layers VALUES (?,?,?,?)",
                       (digest, json.dumps(origin), index.model_dump_json(), time.time()))
        if name:
            self.tag_layer(name, digest)
        return self.get(digest)

    def lazy_layer(self, digest: str) -> tuple[ChunkIndex, dict] | None:
        """(chunk index, origin spec) of a lazy layer, None for a layer that is not lazy."""
        rows = self._query("SELECT chunk_index, origin FROM lazy_layers WHERE digest=?", [digest])
        if not rows:
            return None
        return ChunkIndex.model_validate_json(rows[0][0]), json.loads(rows[0][1])

    def lazy_digests(self) -> list[str]:
        return [r[0] for r in self._query("SELECT digest FROM lazy_layers ORDER BY created")]

    def location(self, digest: str) -> str:
        """Where a layer's bytes are: "local" (its image file), "cached" (lazy, every chunk in the
        chunk cache), "partial" (lazy, some chunks cached) or "remote" (lazy, none cached)."""
        if self.image_path(digest).exists():
            return "local"
        rec = self.lazy_layer(digest)
        if rec is None:
            return "missing"
        cache_dir = self.settings.root / "chunks"
        have = sum(1 for c in set(rec[0].chunks) if (cache_dir / c[:2] / c).exists())
        return "cached" if have == len(set(rec[0].chunks)) else "partial" if have else "remote"

    def import_archive(self, path: str | os.PathLike, ref: str | None = None,
                       progress: Callable[[int, int], None] | None = None) -> ImageInfo:
        """Import a `docker save` / OCI archive: each image layer becomes a layer; returns the image."""
        p = Path(path)
        if not p.is_file():
            raise InvalidArgument(f"image archive {p} does not exist")
        img = archive.read_image_archive(p)
        digests = []
        for i, layer in enumerate(img.layers):
            if progress:
                progress(i, len(img.layers))
            stream = layer.open()
            if stream is None:
                raise CorruptArchive(f"{p}: layer {layer.name} is not a regular file")
            digests.append(self.build_from_tar(stream, source=f"archive:{p.name}:{layer.name}").digest)
        if progress:
            progress(len(img.layers), len(img.layers))
        chosen = ref or (img.tags[0] if img.tags else p.stem.lower())
        name, tag = split_ref(chosen.split("/")[-1] if "/" in chosen and ":" in chosen.split("/")[-1] else chosen)
        return self.create_image(f"{name}:{tag}", digests)

    # ---------------------------------------------------------------- lookup
    def resolve(self, ref: str) -> str:
        """A full digest, a unique digest prefix (>= 6 hex chars) or a layer name -> full digest."""
        if not isinstance(ref, str) or not ref:
            raise BadDigest(f"bad layer reference {ref!r}")
        if _DIGEST_RE.match(ref):
            if not self._query("SELECT 1 FROM layers WHERE digest=?", [ref]):
                raise LayerNotFound(f"layer {ref} not found")
            return ref
        rows = self._query("SELECT digest FROM layer_names WHERE name=?", [ref])
        if rows:
            return rows[0][0]
        if ref.startswith("sha256:") and not _PREFIX_RE.match(ref):
            raise BadDigest(f"bad digest {ref!r}: expected sha256: followed by hex characters")
        if _PREFIX_RE.match(ref):
            hexpart = ref.split(":", 1)[-1]
            rows = self._query("SELECT digest FROM layers WHERE digest LIKE ?", [f"sha256:{hexpart}%"])
            if len(rows) == 1:
                return rows[0][0]
            if len(rows) > 1:
                raise BadDigest(f"digest prefix {ref!r} is ambiguous ({len(rows)} layers match)")
        raise LayerNotFound(f"layer {ref!r} not found (no such digest or layer name)")

    def get(self, ref: str) -> LayerInfo:
        digest = self.resolve(ref)
        return self._info(self._query("SELECT * FROM layers WHERE digest=?", [digest])[0])

    def tag_layer(self, name: str, ref: str) -> None:
        if not _NAME_RE.match(name):
            raise InvalidArgument(f"invalid layer name {name!r}: lowercase letters, digits, . _ / - only")
        digest = self.resolve(ref)
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO layer_names VALUES (?,?)", (name, digest))

    # ---------------------------------------------------------------- images
    def create_image(self, ref: str, layers: list[str], config: dict | None = None) -> ImageInfo:
        """Name an ordered stack of layers (bottom -> top). Replaces an existing name:tag.

        `config` may hold "env" (dict) and "workdir" (str): defaults for sandboxes of this image."""
        name, tag = split_ref(ref)
        if not layers:
            raise InvalidArgument(f"image {ref} needs at least one layer")
        digests = [self.resolve(l) for l in layers]
        cfg = dict(config or {})
        if not isinstance(cfg.get("env", {}), dict) or not isinstance(cfg.get("workdir", "/"), str):
            raise InvalidArgument(f"image {ref}: config env must be a table and workdir a string")
        with self._tx() as db:
            db.execute("DELETE FROM image_layers WHERE name=? AND tag=?", (name, tag))
            db.execute("INSERT OR REPLACE INTO images VALUES (?,?,?,?)", (name, tag, time.time(), json.dumps(cfg)))
            db.executemany("INSERT INTO image_layers VALUES (?,?,?,?)",
                           [(name, tag, i, d) for i, d in enumerate(digests)])
        return self.get_image(f"{name}:{tag}")

    def create_image_from_spec(self, spec_path: str | os.PathLike) -> ImageInfo:
        """Create an image from a TOML spec: [image] name=..., tag=..., layers=[bottom, ..., top]."""
        p = Path(spec_path)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise InvalidArgument(f"image spec {p} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise InvalidArgument(f"image spec {p} is not valid TOML: {e}") from e
        img = data.get("image")
        if not isinstance(img, dict) or not isinstance(img.get("name"), str) or not isinstance(img.get("layers"), list):
            raise InvalidArgument(f"image spec {p} needs an [image] table with name = \"...\" and layers = [...]")
        return self.create_image(f"{img['name']}:{img.get('tag', 'latest')}", [str(x) for x in img["layers"]])

    def get_image(self, ref: str) -> ImageInfo:
        name, tag = split_ref(ref)
        row = self._query("SELECT created, config FROM images WHERE name=? AND tag=?", [name, tag])
        if not row:
            raise ImageNotFound(f"image {name}:{tag} not found (see `shoal image ls`)")
        layers = tuple(r[0] for r in self._query(
            "SELECT digest FROM image_layers WHERE name=? AND tag=? ORDER BY position", [name, tag]))
        return ImageInfo(name, tag, layers, row[0][0], json.loads(row[0][1] or "{}"))

    def list_images(self) -> list[ImageInfo]:
        return [self.get_image(f"{n}:{t}") for n, t in self._query("SELECT name, tag FROM images ORDER BY name, tag")]

    def remove_image(self, ref: str) -> None:
        info = self.get_image(ref)
        with self._tx() as db:
            db.execute("DELETE FROM image_layers WHERE name=? AND tag=?", (info.name, info.tag))
            db.execute("DELETE FROM images WHERE name=? AND tag=?", (info.name, info.tag))

    # ---------------------------------------------------------------- removal
    def image_refs(self, digest: str) -> list[str]:
        return [f"{n}:{t}" for n, t in self._query(
            "SELECT DISTINCT name, tag FROM image_layers WHERE digest=?", [digest])]

    def remove_layer(self, ref: str, live: AbstractSet[str] = frozenset()) -> LayerInfo:
        """Remove a layer unless an image or a live sandbox (digests in `live`) still uses it."""
        info = self.get(ref)
        users = self.image_refs(info.digest)
        if users:
            raise LayerInUse(f"layer {info.short} is used by image(s) {', '.join(users)}; remove those first")
        if info.digest in live:
            raise LayerInUse(f"layer {info.short} is used by a live sandbox")
        with self._host_lock("mount"):
            self._unmount(info.digest)
            with self._tx() as db:
                db.execute("DELETE FROM layer_names WHERE digest=?", (info.digest,))
                db.execute("DELETE FROM layers WHERE digest=?", (info.digest,))
                db.execute("DELETE FROM lazy_layers WHERE digest=?", (info.digest,))
            self.image_path(info.digest).unlink(missing_ok=True)
        return info

    def gc(self, live: AbstractSet[str] = frozenset(), keep_named: bool = True) -> dict:
        """Unmount layers no live sandbox uses; delete layers no image, name or sandbox references."""
        removed, unmounted = [], []
        named = {r[0] for r in self._query("SELECT digest FROM layer_names")} if keep_named else set()
        in_images = {r[0] for r in self._query("SELECT DISTINCT digest FROM image_layers")}
        for info in self.list():
            if info.digest in live:
                continue
            with self._host_lock("mount"):
                if self._unmount(info.digest):
                    unmounted.append(info.digest)
            if info.digest not in in_images and info.digest not in named:
                self.remove_layer(info.digest, live)
                removed.append(info.digest)
        with self._tx() as db:  # build-cache entries whose layer is gone
            db.execute("DELETE FROM build_cache WHERE digest NOT IN (SELECT digest FROM layers)")
        result = self._gc_lazy()
        for leftover in self.settings.tmp_dir.iterdir():
            if time.time() - leftover.stat().st_mtime > 3600:
                shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink(missing_ok=True)
        return {"removed": removed, "unmounted": unmounted, **result}

    def _gc_lazy(self) -> dict:
        """Chunks no mounted lazy layer uses leave the cache (a mounted layer is one a live sandbox
        may read: gc unmounted the others above); with no lazy layer mounted the daemon stops."""
        from ..lazy import mount as lazy_mount

        if not (self.settings.root / "chunks").exists() and not self.lazy_digests():
            if (self.settings.root / "lazy").is_dir():  # a daemon started by a lazy pull that then failed
                lazy_mount.stop_daemon(self.settings.root)
            return {}
        from ..lazy.layer import chunk_cache_for

        keep: set[str] = set()
        mounted = [d for d in self.lazy_digests() if os.path.ismount(self.mount_path(d))]
        for d in mounted:
            rec = self.lazy_layer(d)
            if rec is not None:
                keep.update(rec[0].chunks)
        out = chunk_cache_for(self.settings.root).gc(keep)
        if not mounted:
            lazy_mount.stop_daemon(self.settings.root)
        return out

    # ---------------------------------------------------------------- folding
    def fold(self, layers: list[str], name: str | None = None) -> LayerInfo:
        """One layer equivalent to `layers` (bottom -> top) stacked, whiteouts preserved."""
        digests = [self.resolve(l) for l in layers]
        if not digests:
            raise InvalidArgument("fold needs at least one layer")
        if len(digests) == 1:
            return self.get(digests[0])
        mounts = self.ensure_mounted(digests)
        with self._scratch() as d:
            staging = d / "root"
            staging.mkdir()
            fold_trees(mounts, staging)
            return self.build_from_dir(staging, name=name,
                                       source="fold:" + "+".join(x.split(":")[1][:12] for x in digests))

    def fold_small(self, layers: list[str], threshold_bytes: int) -> list[str]:
        """Fold every run of >= 2 consecutive layers whose content is below `threshold_bytes`."""
        out: list[str] = []
        run: list[str] = []
        for d in [*(self.resolve(l) for l in layers), None]:
            if d is not None and self.get(d).size < threshold_bytes:
                run.append(d)
                continue
            if len(run) >= 2:
                out.append(self.fold(run).digest)
            else:
                out.extend(run)
            run = []
            if d is not None:
                out.append(d)
        return out

    def fold_to_depth(self, layers: list[str], max_depth: int) -> list[str]:
        """Keep the bottom layers as they are (they are shared) and fold the top so len <= max_depth."""
        digests = [self.resolve(l) for l in layers]
        if max_depth < 2:
            raise InvalidArgument(f"max_depth must be >= 2, got {max_depth}")
        if len(digests) <= max_depth:
            return digests
        keep = max_depth - 1
        return digests[:keep] + [self.fold(digests[keep:]).digest]

    # ---------------------------------------------------------------- build cache
    def cache_get(self, key: str) -> str | None:
        rows = self._query("SELECT digest FROM build_cache WHERE key=?", [key])
        if rows and self._query("SELECT 1 FROM layers WHERE digest=?", [rows[0][0]]) and \
                self.image_path(rows[0][0]).exists():
            return rows[0][0]
        return None

    def cache_put(self, key: str, digest: str, step: str) -> None:
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO build_cache VALUES (?,?,?,?)", (key, digest, step, time.time()))

    # ---------------------------------------------------------------- mounting
    def ensure_mounted(self, digests: Iterable[str]) -> list[Path]:
        """Mount each layer once per host (idempotent, safe across processes)."""
        digests = list(digests)
        paths = [self.mount_path(d) for d in digests]
        # every lazy layer, mounted or not: a mount made while its registry was trusted must not serve
        # new sandboxes (its reads keep reaching the kernel's EROFS parser) once it is not
        self._check_lazy_trust(digests)
        missing = [(d, p) for d, p in zip(digests, paths)
                   if not os.path.ismount(p) or self._stale(d) or self._promoted(d)]
        if missing:
            lazy = [d for d, _ in missing if not self.image_path(d).exists() and self.lazy_layer(d) is not None]
            if len(lazy) > 1:
                from ..lazy.mount import warm

                warm(self.settings.root, lazy)  # their first chunks at once, before the mounts one by one
            with self._host_lock("mount"):
                for d, p in missing:
                    img = self.image_path(d)
                    if self._promoted(d):
                        # every chunk of the lazy layer arrived and its daemon assembled the image file:
                        # mount that on top, atomically for new sandboxes; the running ones keep the
                        # lazy mount below (their overlays hold it) until they end
                        from ..lazy.mount import forget

                        p.mkdir(parents=True, exist_ok=True)
                        erofs.mount_image(img, p)
                        forget(self.settings.root, d)
                        continue
                    if os.path.ismount(p) and not self._stale(d):
                        continue
                    if not img.exists() and self.lazy_layer(d) is not None:
                        from ..lazy.mount import mount_lazy

                        self._unmount(d)  # a stale lazy mount (its daemon died): new sandboxes get a fresh one
                        mount_lazy(self.settings.root, d, p)
                        continue
                    if not img.exists():
                        raise LayerNotFound(f"layer {d} has no image file at {img}")
                    p.mkdir(parents=True, exist_ok=True)
                    erofs.mount_image(img, p)
        return paths

    def _check_lazy_trust(self, digests: list[str]) -> None:
        """A layer that came lazily from a registry no longer (or never) trusted is not mounted: its
        image (on demand, or assembled from its chunks) was never checked before the kernel parses it.
        Once per ensure_mounted (a sandbox's start), never per read."""
        from ..lazy.trust import check_lazy_layer

        if not digests:
            return
        rows = self._query(f"SELECT digest, origin FROM lazy_layers WHERE digest IN ({','.join('?' * len(digests))})",
                           digests)
        for d, origin in rows:  # one query per ensure_mounted: a root without lazy layers pays that only
            check_lazy_layer(d, json.loads(origin), self.settings.trusted_registries)

    def _stale(self, digest: str) -> bool:
        """A lazy layer mounted through a lazy daemon that has died since."""
        if self.image_path(digest).exists() or not (self.settings.root / "lazy").exists():
            return False
        from ..lazy.mount import is_stale

        return self.lazy_layer(digest) is not None and is_stale(self.settings.root, digest)

    def _promoted(self, digest: str) -> bool:
        """A layer mounted lazily whose image file has since been assembled (shoal.lazy.layer.promote)."""
        marker = self.settings.root / "lazy" / f"{digest.split(':', 1)[1]}.mounted"
        return marker.exists() and self.image_path(digest).exists()

    def _unmount(self, digest: str) -> bool:
        p = self.mount_path(digest)
        if os.path.ismount(p):
            for _ in range(4):  # a promoted layer: the local mount over the lazy one
                erofs.unmount(p)
                if not os.path.ismount(p):
                    break
            try:
                p.rmdir()
            except OSError:
                pass
            return True
        return False

    # last in the class body: a method named `list` shadows the builtin in the annotations after it
    def list(self) -> list[LayerInfo]:
        return [self._info(r) for r in self._query("SELECT * FROM layers ORDER BY created")]
