"""`shoal pull`: an image from an OCI registry into the layer store, fetching only what is missing.

Shoal images (config media type `SHOAL_CONFIG_MEDIA_TYPE`): each layer descriptor names its Shoal
layer digest, so layers the store has are skipped without a byte fetched. A missing layer's blob
is streamed to the root's tmp dir, hashed against its descriptor digest and checked chunk by chunk
against its chunk index; only when every blob of the image is good are they installed
(`LayerStore.add_erofs`, which also re-derives the tree digest) and the image created.

Lazy pulls (`lazy=True`, `shoal pull --lazy`) from a registry the operator trusts (`trusted_registries`,
shoal.lazy.trust; from any other, the layers are downloaded and checked as above, and `note` says so):
a Shoal layer the store lacks is not downloaded; its
chunk index (verified against its digest and checked to describe that very blob) is fetched and the
layer registered with `LayerStore.add_lazy_layer` and an origin spec of kind "registry"
(origin.layer_spec: registry, repository, blob and index keys, CA path, insecure / plain-HTTP flags;
never a credential). The image is usable at once; sandboxes read its chunks on demand through
RegistryOrigin. Layers already here, local or lazy, are kept as they are.

Ordinary container images (Docker v2 / OCI manifests, or an index of them: the host's platform is
chosen) are converted layer by layer (convert.py), each once per diff_id. Their tar+gzip layers
cannot be read by offset, so with `lazy=True` they are converted eagerly all the same
(`PullResult.lazy` stays empty and `note` says so)."""
from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.errors import CorruptChunk, LayerInUse, QuotaExceeded, RegistryError
from ..layers.store import ImageInfo, LayerStore
from ..lazy.chunks import CHUNK_INDEX_MEDIA_TYPE, LAYER_MEDIA_TYPE, ChunkIndex
from ..lazy.origin import DEFAULT_TIMEOUT_S
from ..lazy.trust import is_trusted
from .client import Manifest, Progress, RegistryClient
from .convert import cache_key, convert_layer
from .media import (
    ANN_CHUNKS,
    ANN_LAYER,
    ANN_LAYER_ENTRIES,
    ANN_LAYER_SIZE,
    ANN_STARTUP_BYTES,
    INDEX_TYPES,
    SHOAL_CONFIG_MEDIA_TYPE,
)
from .push import host_platform
from .reference import Reference, parse_reference

PullProgress = Callable[[str, int, int], None]  # (what, bytes done, bytes total)
MIN_CHUNK_SIZE, MAX_CHUNK_SIZE = 4 << 10, 16 << 20  # what a pulled chunk index may use (push: 128 KiB)
DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")  # an index entry names its manifest by this only


@dataclass
class PullResult:
    image: ImageInfo
    source: str  # REGISTRY/REPO@sha256:... of the manifest pulled
    kind: str  # "shoal" or "container"
    fetched: list[str] = field(default_factory=list)  # blob digests downloaded
    present: list[str] = field(default_factory=list)  # layers already here (nothing fetched)
    bytes_fetched: int = 0
    lazy: list[str] = field(default_factory=list)  # layers registered lazily (only their chunk index fetched)
    note: str = ""


@dataclass
class _Tally:
    fetched: list[str] = field(default_factory=list)
    present: list[str] = field(default_factory=list)
    bytes_fetched: int = 0


def _platform_match(p: dict, os_name: str, arch: str, variant: str | None) -> bool:
    if p.get("os") != os_name or p.get("architecture") != arch:
        return False
    return variant is None or p.get("variant") in (None, variant)


def choose_manifest(index: dict, platform: str | None = None) -> dict:
    """The index entry for `platform` ("os/arch[/variant]", default this host's)."""
    if platform:
        parts = platform.split("/")
        os_name, arch, variant = parts[0], parts[1] if len(parts) > 1 else "", parts[2] if len(parts) > 2 else None
    else:
        (os_name, arch), variant = host_platform(), None
    entries = [m for m in index.get("manifests") or [] if isinstance(m, dict)]
    for m in entries:
        if _platform_match(m.get("platform") or {}, os_name, arch, variant):
            return m
    have = ", ".join(f"{(m.get('platform') or {}).get('os')}/{(m.get('platform') or {}).get('architecture')}"
                     for m in entries)
    raise RegistryError(f"no {os_name}/{arch} image in this index (it has: {have or 'nothing'})")


def resolve_manifest(client: RegistryClient, ref: Reference, platform: str | None = None) -> Manifest:
    """The image manifest `ref` names, through an index if it is one."""
    m = client.get_manifest(ref.repository, ref.reference)
    if m.media_type in INDEX_TYPES or "manifests" in m.json():
        entry = choose_manifest(m.json(), platform)
        digest = entry.get("digest")
        if not isinstance(digest, str) or not DIGEST_RE.fullmatch(digest):
            # by tag, the registry could swap the image under an index pulled by its digest
            raise RegistryError(f"{ref}: the index names its manifest by {str(digest)[:80]!r}, not a sha256 digest: "
                                "refused")
        m = client.get_manifest(ref.repository, digest)
    return m


def pull(store: LayerStore, source: str, ref: str | None = None, *, client: RegistryClient | None = None,
         platform: str | None = None, progress: PullProgress | None = None, ca: str | None = None,
         insecure: bool = False, plain_http: bool = False, lazy: bool = False,
         timeout_s: float | None = None) -> PullResult:
    """Pull `source` ("REGISTRY/REPO:TAG" or "...@sha256:...") into `store` as image `ref`
    (default: the repository path and tag, e.g. library/python:3.11). `lazy`: register the Shoal
    layers this host lacks to be read on demand from the registry instead of downloading them;
    `timeout_s` is then the deadline of each of those reads (default 10 s)."""
    r = parse_reference(source)
    own = client is None
    cl = client or RegistryClient(r.registry, ca=ca, insecure=insecure, plain_http=plain_http)
    try:
        m = resolve_manifest(cl, r, platform)
        manifest = m.json()
        config_desc = manifest.get("config") or {}
        if not isinstance(manifest.get("layers"), list) or not config_desc.get("digest"):
            raise RegistryError(f"{r}: manifest {m.digest} has no config or layers (media type {m.media_type!r})")
        config = _json(cl.get_blob(r.repository, config_desc["digest"]), f"{r}: config")
        where = f"{r.registry}/{r.repository}@{m.digest}"
        local = ref or r.local_ref()
        if config_desc.get("mediaType") == SHOAL_CONFIG_MEDIA_TYPE:
            if lazy and is_trusted(r.registry, r.repository, store.settings.trusted_registries):
                conn = {"ca": ca or cl.ca, "insecure": insecure or cl.insecure, "plain_http": cl.plain_http,
                        "timeout_s": timeout_s if timeout_s is not None else DEFAULT_TIMEOUT_S}
                return _pull_shoal_lazy(store, cl, r, manifest, config, local, where, progress, conn)
            res = _pull_shoal(store, cl, r, manifest, config, local, where, progress)
            if lazy:  # its EROFS layers would reach the host kernel unchecked: fetched and fsck'd instead
                res.note = (f"{r.registry}/{r.repository} is not in trusted_registries: its layers were downloaded "
                            "and checked with fsck.erofs instead of loading lazily (lazy layers reach the host "
                            "kernel unchecked; docs/registry.md, \"Lazy pull\")")
            return res
        res = _pull_container(store, cl, r, manifest, config, local, where, progress)
        if lazy:
            res.note = ("an ordinary container image: its tar layers cannot be read by offset, so they were "
                        "converted eagerly (only Shoal images, pushed with `shoal push`, load lazily)")
        return res
    finally:
        if own:
            cl.close()


def _json(data: bytes, what: str) -> dict:
    try:
        out = json.loads(data)
    except ValueError as e:
        raise RegistryError(f"{what} is not JSON ({e})") from None
    if not isinstance(out, dict):
        raise RegistryError(f"{what} is not a JSON object")
    return out


def _tmp(store: LayerStore, suffix: str) -> Path:
    fd, name = tempfile.mkstemp(dir=store.settings.tmp_dir, prefix="pull-", suffix=suffix)
    os.close(fd)
    return Path(name)


def _labelled(progress: PullProgress | None, label: str) -> Progress | None:
    if progress is None:
        return None
    return lambda done, total: progress(label, done, total)


def _verify_chunks(path: Path, idx: ChunkIndex) -> None:
    with open(path, "rb") as f:
        for i in range(len(idx.chunks)):
            off, length = idx.span(i)
            f.seek(off)
            idx.verify(i, f.read(length))


def _pull_shoal(store: LayerStore, cl: RegistryClient, r: Reference, manifest: dict, config: dict, local: str,
                where: str, progress: PullProgress | None) -> PullResult:
    layers = [d for d in manifest["layers"] if isinstance(d, dict) and d.get("mediaType") == LAYER_MEDIA_TYPE]
    indexes = {d.get("digest"): d for d in manifest["layers"]
               if isinstance(d, dict) and d.get("mediaType") == CHUNK_INDEX_MEDIA_TYPE}
    if not layers:
        raise RegistryError(f"{where}: a Shoal image without layers")
    result = _Tally()
    digests: list[str] = []
    staged: list[tuple[Path, str, str]] = []  # (blob file, Shoal digest, blob digest), verified
    try:
        for i, desc in enumerate(layers):
            layer = (desc.get("annotations") or {}).get(ANN_LAYER)
            if not isinstance(layer, str):
                raise RegistryError(f"{where}: layer {desc.get('digest')} lacks its {ANN_LAYER} annotation")
            digests.append(layer)
            if store.has_layer(layer) or any(s[1] == layer for s in staged):
                result.present.append(layer)
                continue
            idx, _ = _index_for(cl, r, desc, indexes, where)
            _check_room(store, idx.size + sum(s[0].stat().st_size for s in staged), where, layer)
            label = f"layer {i + 1}/{len(layers)} {layer.split(':')[1][:12]}"
            tmp = _tmp(store, ".erofs")
            staged.append((tmp, layer, desc["digest"]))
            cl.download_blob(r.repository, desc["digest"], tmp, size=idx.size, progress=_labelled(progress, label))
            _verify_chunks(tmp, idx)
            result.fetched.append(desc["digest"])
            result.bytes_fetched += idx.size
        installed: list[str] = []
        try:
            for tmp, layer, blob in staged:
                if progress:
                    progress(f"installing {layer.split(':')[1][:12]}", 0, 0)
                store.add_erofs(tmp, layer, source=f"registry:{r.registry}/{r.repository}@{blob}")
                installed.append(layer)
        except BaseException:
            for layer in installed:  # the image is not created: take back what this pull added
                try:
                    store.remove_layer(layer)
                except LayerInUse:
                    pass
            raise
    finally:
        for tmp, _, _ in staged:
            tmp.unlink(missing_ok=True)
    cfg = config.get("config") if isinstance(config.get("config"), dict) else {}
    image = store.create_image(local, digests, config=cfg)
    return PullResult(image, where, "shoal", result.fetched, result.present, result.bytes_fetched)


def _check_room(store: LayerStore, need: int, where: str, layer: str) -> None:
    """The blob sizes come from the registry: a download must not fill the host's disk."""
    from ..layers import archive

    room = min(archive.MAX_LAYER_BYTES, archive._free_bytes(str(store.settings.tmp_dir)) - archive.FREE_RESERVE_BYTES)
    if need > room:
        raise QuotaExceeded(f"{where}: layer {layer} needs {need} bytes here, more than {max(room, 0)} (the bound is "
                            "SHOAL_MAX_LAYER_BYTES or the free disk less 1 GiB, whichever is smaller): refused")


def _index_for(cl: RegistryClient, r: Reference, desc: dict, indexes: dict, where: str) -> tuple[ChunkIndex, str]:
    """A layer descriptor's chunk index (verified against its digest, and describing this very blob)."""
    ann = desc.get("annotations") or {}
    layer, idx_digest = ann.get(ANN_LAYER), ann.get(ANN_CHUNKS)
    if not isinstance(idx_digest, str) or idx_digest not in indexes:
        raise RegistryError(f"{where}: layer {layer} has no chunk index in the manifest")
    try:
        idx = ChunkIndex.model_validate_json(cl.get_blob(r.repository, idx_digest))
    except ValueError as e:  # pydantic's ValidationError: not an index at all
        raise CorruptChunk(f"{where}: the chunk index of layer {layer} is malformed ({e})") from None
    if (idx.blob, idx.size, idx.layer) != (desc["digest"], desc.get("size"), layer):
        raise CorruptChunk(f"{where}: the chunk index of layer {layer} describes another blob")
    # a chunk is read, held and hashed whole by the lazy daemon: a registry's index must not make
    # one chunk the whole layer (a multi-GiB read into memory per fault)
    if not MIN_CHUNK_SIZE <= idx.chunk_size <= MAX_CHUNK_SIZE:
        raise CorruptChunk(f"{where}: the chunk index of layer {layer} has chunks of {idx.chunk_size} bytes "
                           f"(Shoal reads chunks of {MIN_CHUNK_SIZE} to {MAX_CHUNK_SIZE} bytes)")
    return idx, idx_digest


def _pull_shoal_lazy(store: LayerStore, cl: RegistryClient, r: Reference, manifest: dict, config: dict,
                     local: str, where: str, progress: PullProgress | None, conn: dict) -> PullResult:
    from .origin import layer_spec

    layers = [d for d in manifest["layers"] if isinstance(d, dict) and d.get("mediaType") == LAYER_MEDIA_TYPE]
    indexes = {d.get("digest"): d for d in manifest["layers"]
               if isinstance(d, dict) and d.get("mediaType") == CHUNK_INDEX_MEDIA_TYPE}
    if not layers:
        raise RegistryError(f"{where}: a Shoal image without layers")
    result = PullResult(None, where, "shoal")  # type: ignore[arg-type]  # the image is set below
    if not all(store.has_layer(str((d.get("annotations") or {}).get(ANN_LAYER))) for d in layers):
        from ..lazy.mount import start_daemon

        start_daemon(store.settings.root)  # its start overlaps the rest of the pull and the sandbox's setup
    digests: list[str] = []
    todo: list[tuple[int, dict, str]] = []
    for i, desc in enumerate(layers):
        ann = desc.get("annotations") or {}
        layer = ann.get(ANN_LAYER)
        if not isinstance(layer, str):
            raise RegistryError(f"{where}: layer {desc.get('digest')} lacks its {ANN_LAYER} annotation")
        digests.append(layer)
        if store.has_layer(layer):
            result.present.append(layer)
        else:
            todo.append((i, desc, layer))
    # every chunk index and published prefetch list at once: over a link with latency, 7 layers'
    # indexes one after another were 7 serial round trips before the first sandbox could start
    specs = [layer_spec(r.registry, r.repository, desc["digest"], str((desc.get("annotations") or {}).get(ANN_CHUNKS)),
                        ca=conn["ca"], insecure=conn["insecure"], plain_http=conn["plain_http"],
                        timeout_s=conn["timeout_s"]) for _, desc, _ in todo]
    for (_, desc, _), spec in zip(todo, specs):
        startup = _startup_bytes(desc)
        if startup:  # the relaid layer's start-up prefix: the daemon fetches it when there is no list
            spec["startup_bytes"] = startup
    if progress and todo:
        progress(f"{len(todo)} of {len(layers)} layers lazy: chunk indexes", 0, 0)
    got = _lazy_layer_meta(store, cl, r, [(d, layer, spec) for (_, d, layer), spec in zip(todo, specs)],
                           indexes, where)
    for (_, desc, layer), spec, (idx, idx_digest) in zip(todo, specs, got):
        ann = desc.get("annotations") or {}
        store.add_lazy_layer(idx, spec, size=int(ann.get(ANN_LAYER_SIZE, 0) or 0),
                             entries=int(ann.get(ANN_LAYER_ENTRIES, 0) or 0),
                             source=f"registry:{r.registry}/{r.repository}@{desc['digest']} (lazy)")
        result.lazy.append(layer)
        result.fetched.append(idx_digest)
        result.bytes_fetched += int(indexes[idx_digest].get("size", 0))
    cfg = config.get("config") if isinstance(config.get("config"), dict) else {}
    result.image = store.create_image(local, digests, config=cfg)
    return result


def _startup_bytes(desc: dict) -> int:
    """The layer descriptor's start-up prefix (`ANN_STARTUP_BYTES`, set by `push --relayout`), at most
    the blob's size; 0 when absent or not a positive integer."""
    raw = (desc.get("annotations") or {}).get(ANN_STARTUP_BYTES)
    try:
        n = int(raw) if isinstance(raw, str) and raw.isdigit() else 0
    except ValueError:
        return 0
    return max(0, min(n, int(desc.get("size") or 0)))


def _lazy_layer_meta(store: LayerStore, cl: RegistryClient, r: Reference, items: list[tuple[dict, str, dict]],
                     indexes: dict, where: str) -> list[tuple[ChunkIndex, str]]:
    """The chunk index of each layer (in order), all fetched at once; beside each, its published
    prefetch list, kept in `<root>/lazy/` so the root's daemon (starting meanwhile) prefetches the
    moment it opens the layer. No layer byte is fetched here. A missing list (none published) is
    noted (`prefetch.mark_absent`: the daemon does not ask again for a while); a failed lookup is
    left to the daemon, which asks again; a bad index fails the pull."""
    from concurrent.futures import ThreadPoolExecutor

    from ..core.errors import ImageNotFound, ShoalError
    from ..lazy import prefetch
    from .origin import RegistryOrigin

    origin = RegistryOrigin(cl)

    def index(item: tuple[dict, str, dict]) -> tuple[ChunkIndex, str]:
        return _index_for(cl, r, item[0], indexes, where)

    def plist(item: tuple[dict, str, dict]) -> None:
        _, digest, spec = item
        try:
            key = spec["prefetch_key"]
            body = origin.read(key, 0, origin.stat(key).size)
            order = prefetch.parse(body)
            if order:
                prefetch.save(store.settings.root, digest, order, startup=prefetch.parse_startup(body))
        except ImageNotFound:  # none published (not a failure): the daemon need not ask again soon
            prefetch.mark_absent(store.settings.root, digest)
        except (ShoalError, OSError):
            pass

    if not items:
        return []
    with ThreadPoolExecutor(min(16, 2 * len(items))) as ex:
        lists = [ex.submit(plist, item) for item in items]
        out = list(ex.map(index, items))
        for f in lists:
            f.result()
    return out


def _env(lines: Any) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in lines or []:
        if isinstance(line, str) and "=" in line:
            k, _, v = line.partition("=")
            out[k] = v
    return out


def _pull_container(store: LayerStore, cl: RegistryClient, r: Reference, manifest: dict, config: dict, local: str,
                    where: str, progress: PullProgress | None) -> PullResult:
    descs = [d for d in manifest["layers"] if isinstance(d, dict)]
    diff_ids = (config.get("rootfs") or {}).get("diff_ids") or []
    if len(diff_ids) != len(descs):
        raise RegistryError(f"{where}: {len(descs)} layers but {len(diff_ids)} diff_ids in the image config")
    if not descs:
        raise RegistryError(f"{where}: an image without layers")
    result = _Tally()
    digests: list[str] = []
    for i, (desc, diff_id) in enumerate(zip(descs, diff_ids)):
        cached = store.cache_get(cache_key(diff_id))
        if cached:
            digests.append(cached)
            result.present.append(cached)
            continue
        label = f"layer {i + 1}/{len(descs)} {desc['digest'].split(':')[1][:12]}"
        size = desc.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:  # OCI requires it; it bounds the download
            raise RegistryError(f"{where}: layer {desc.get('digest')} has no valid size in the manifest")
        _check_room(store, size, where, str(desc.get("digest")))
        tmp = _tmp(store, ".blob")
        try:
            cl.download_blob(r.repository, desc["digest"], tmp, size=size, progress=_labelled(progress, label))
            result.fetched.append(desc["digest"])
            result.bytes_fetched += tmp.stat().st_size
            if progress:
                progress(f"converting {label}", 0, 0)
            digests.append(convert_layer(store, tmp, str(desc.get("mediaType")), diff_id,
                                         f"oci:{r.registry}/{r.repository}@{desc['digest']}"))
        finally:
            tmp.unlink(missing_ok=True)
    c = config.get("config") or {}
    image_cfg: dict[str, Any] = {"env": _env(c.get("Env"))}
    if c.get("WorkingDir"):
        image_cfg["workdir"] = c["WorkingDir"]
    for key, name in (("Entrypoint", "entrypoint"), ("Cmd", "cmd"), ("User", "user")):
        if c.get(key):
            image_cfg[name] = c[key]
    image = store.create_image(local, digests, config=image_cfg)
    return PullResult(image, where, "container", result.fetched, result.present, result.bytes_fetched)
