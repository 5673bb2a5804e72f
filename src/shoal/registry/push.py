"""`shoal push`: a Shoal image to an OCI registry, layer by layer, each blob at most once.

Each layer goes up as its EROFS image, byte for byte (`LAYER_MEDIA_TYPE`; the descriptor digest is
the sha256 of those bytes), plus its chunk index (`CHUNK_INDEX_MEDIA_TYPE`), the index lazy loading
verifies every chunk against. Blobs the registry already has (HEAD) are not sent; uploads are
chunked and resume after an interruption (client.upload_blob).

A layer that is lazy on this host (pulled with `--lazy`, not downloaded) can be pushed when the
target repository already has its blob (the common case: pushing back where it came from, or a
new tag); otherwise the push says to pull it fully first. After the manifest, the prefetch lists
this root recorded for the image's layers are published (shoal.registry.prefetch);
`prefetch_only=True` publishes only those.

`relayout=True` pushes each layer that has a recorded access list (byte ranges of its blob, first
read order: this root's own, or one published in the `access_from` repository, by default the
target) laid out again so that what was read is adjacent (shoal.layers.relayout): the same tree,
so the same Shoal digest in the `io.shoal.layer.digest` annotation, in a new blob with its own
digest and chunk index. The new image is mounted and its tree digest checked before it is sent; a
pull checks blob digest, chunk index and tree digest as for any layer. When the list says which of
its reads came before the recorded run's first command finished, the layer descriptor says how many
bytes at the new blob's start hold them (`ANN_STARTUP_BYTES`, like eStargz's prefetch landmark): a
lazy reader with no prefetch list fetches that prefix at once (docs/lazy-loading.md, round 6)."""
from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..core.errors import InvalidArgument, RegistryError
from ..layers.store import ImageInfo, LayerStore
from ..lazy.chunks import (
    CHUNK_INDEX_MEDIA_TYPE,
    CHUNK_SIZE,
    LAYER_MEDIA_TYPE,
    REGISTRY_CHUNK_SIZE,
    ChunkIndex,
    build_index,
)
from .client import DEFAULT_CHUNK_SIZE, RegistryClient, UploadResult, sha256_digest
from .media import (
    ANN_CHUNKS,
    ANN_LAYER,
    ANN_LAYER_ENTRIES,
    ANN_LAYER_SIZE,
    ANN_STARTUP_BYTES,
    OCI_MANIFEST,
    SHOAL_CONFIG_MEDIA_TYPE,
)
from .reference import parse_reference
from .uploads import UploadSessions

# (what, bytes done, bytes total): e.g. ("layer 2/5 3f2a1b…", 1048576, 4194304)
PushProgress = Callable[[str, int, int], None]


@dataclass
class LayerPush:
    layer: str  # Shoal digest
    blob: str  # sha256 of the EROFS image
    size: int
    sent: int  # bytes sent by this push (0: the registry had it)
    resumed_from: int = 0


@dataclass
class PushResult:
    target: str
    manifest: str  # digest of the manifest pushed ("" with prefetch_only)
    layers: list[LayerPush] = field(default_factory=list)
    prefetch_lists: dict[str, int] = field(default_factory=dict)  # layer -> chunks in its published list
    relaid: dict[str, int] = field(default_factory=dict)  # layer -> bytes of the items its access list named

    @property
    def bytes_sent(self) -> int:
        return sum(x.sent for x in self.layers)

    @property
    def layers_sent(self) -> int:
        return sum(1 for x in self.layers if x.sent)


def host_platform() -> tuple[str, str]:
    """(os, architecture) in OCI terms for this host."""
    machine = platform.machine().lower()
    arch = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64", "armv7l": "arm",
            "ppc64le": "ppc64le", "s390x": "s390x", "riscv64": "riscv64", "i686": "386"}.get(machine, machine)
    return "linux", arch


def registry_dir(store: LayerStore) -> Path:
    """Per-root state of registry transfers: chunk-index cache, interrupted upload sessions."""
    return store.settings.root / "registry"


def chunk_index(store: LayerStore, digest: str, chunk_size: int = CHUNK_SIZE) -> ChunkIndex:
    """The chunk index of a local layer's EROFS image, cached beside the root (layers are immutable:
    the cache is keyed by the image file's size and mtime, so a replaced file is indexed again)."""
    return file_index(store, digest, store.image_path(digest), chunk_size)


def file_index(store: LayerStore, digest: str, path: Path, chunk_size: int = CHUNK_SIZE) -> ChunkIndex:
    """The chunk index of `path`, an EROFS image of layer `digest` (the store's, or one laid out
    again), cached like `chunk_index`."""
    st = path.stat()
    suffix = "" if chunk_size == CHUNK_SIZE else f".{chunk_size}"
    name = digest.split(":", 1)[1] if path == store.image_path(digest) else path.stem
    cache = registry_dir(store) / "chunks" / f"{name}{suffix}.json"
    stamp = f"{st.st_size}:{st.st_mtime_ns}"
    try:
        data = json.loads(cache.read_text())
        if data.get("stamp") == stamp:
            return ChunkIndex.model_validate(data["index"])
    except (OSError, ValueError, KeyError):
        pass
    idx = build_index(digest, path, chunk_size)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"stamp": stamp, "index": idx.model_dump()}))
    os.replace(tmp, cache)
    return idx


def index_blob(idx: ChunkIndex) -> bytes:
    """The chunk index as pushed: canonical JSON, so the same layer gives the same blob everywhere."""
    return json.dumps(idx.model_dump(), sort_keys=True, separators=(",", ":")).encode()


def push(store: LayerStore, image_ref: str, target: str, *, client: RegistryClient | None = None,
         chunk_size: int = DEFAULT_CHUNK_SIZE, progress: PushProgress | None = None,
         ca: str | None = None, insecure: bool = False, plain_http: bool = False,
         prefetch_only: bool = False, lazy_chunk_size: int = REGISTRY_CHUNK_SIZE, relayout: bool = False,
         access_from: str | None = None) -> PushResult:
    """Push image `image_ref` of `store` to `target` ("REGISTRY/REPO:TAG"), then the prefetch lists
    recorded for its layers; `prefetch_only`: only those lists. `lazy_chunk_size`: the chunk of the
    layers' chunk indexes, what a lazy reader fetches at a time (default 128 KiB). `relayout`: each
    layer with a recorded access list goes up laid out in first-read order (module docstring);
    `access_from` ("REPO" on the same registry) is where published lists are looked up (default:
    the target's repository)."""
    from .prefetch import publish_prefetch

    info = store.get_image(image_ref)
    ref = parse_reference(target)
    if ref.digest:
        raise InvalidArgument(f"push target {target!r} names a digest: push to a tag")
    own = client is None
    cl = client or RegistryClient(ref.registry, ca=ca, insecure=insecure, plain_http=plain_http)
    try:
        result = PushResult(str(ref), "")
        if not prefetch_only:
            layouts = _relayouts(store, info, cl, access_from or ref.repository) if relayout else {}
            _push_image(store, info, ref.repository, ref.reference, cl, chunk_size, progress, result,
                        lazy_chunk_size, layouts)
        result.prefetch_lists = publish_prefetch(store, image_ref, target, client=cl).published
        return result
    finally:
        if own:
            cl.close()


def _lazy_index(store: LayerStore, digest: str, cl: RegistryClient, repo: str) -> ChunkIndex | None:
    """The chunk index of a layer that is lazy here; RegistryError if `repo` lacks its blob."""
    rec = store.lazy_layer(digest)
    if rec is None or store.image_path(digest).exists():
        return None
    if not cl.has_blob(repo, rec[0].blob):
        raise RegistryError(f"layer {digest} is lazy on this host (read on demand, not downloaded) and "
                            f"{cl.registry}/{repo} lacks its blob: pull the image without --lazy first")
    return rec[0]


def access_list(store: LayerStore, digest: str, blob: str, cl: RegistryClient | None = None,
                repo: str | None = None) -> tuple[list[tuple[int, int]], int | None] | None:
    """Byte ranges of `blob` (layer `digest`'s EROFS image) in first-read order and how many of them
    are the recorded run's start-up part (None: not known): this root's own recorded list, else the
    one published beside the blob in `repo`; None if neither refers to it."""
    from ..core.errors import ShoalError
    from ..lazy import prefetch as lazy_prefetch
    from .origin import RegistryOrigin
    from .prefetch import prefetch_tag

    own = lazy_prefetch.load_ranges(store.settings.root, digest)
    if own is not None and own[0] == blob:
        return own[1], lazy_prefetch.load_startup_ranges(store.settings.root, digest)
    if cl is None or repo is None:
        return None
    key = f"{repo}:{prefetch_tag(blob)}"
    try:
        origin = RegistryOrigin(cl)
        body = origin.read(key, 0, origin.stat(key).size)
    except ShoalError:
        return None
    got = lazy_prefetch.parse_ranges(body)
    return (got[1], lazy_prefetch.parse_startup_ranges(body)) if got is not None and got[0] == blob else None


def relaid_image(store: LayerStore, digest: str, accesses: list[tuple[int, int]],
                 startup: int | None = None) -> tuple[Path, int, int] | None:
    """Layer `digest`'s image laid out for `accesses` (cached under `<root>/registry/relayout/`, keyed
    by the list), its tree checked against `digest` (a mount: root); (path, hot bytes, start-up
    bytes: the prefix holding the first `startup` accesses' items, 0 if not known), or None when the
    image cannot be rewritten (compressed, chunk-based: it goes up as it is)."""
    import hashlib

    from ..layers.relayout import Unsupported, relayout_image

    key = hashlib.sha256(json.dumps([accesses, startup]).encode()).hexdigest()[:16]
    out = registry_dir(store) / "relayout" / f"{digest.split(':', 1)[1]}.{key}.erofs"
    meta = out.with_suffix(".json")
    try:
        if out.exists():
            m = json.loads(meta.read_text())
            return out, int(m["hot_bytes"]), int(m["startup_bytes"])
    except (OSError, ValueError, KeyError):
        pass
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    try:
        try:
            r = relayout_image(store.image_path(digest), tmp, accesses, startup)
        except Unsupported:
            return None
        store.verify_image(tmp, digest)  # BadDigest: never pushed
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    meta.write_text(json.dumps({"layer": digest, "hot_bytes": r.hot_bytes, "hot_items": r.hot_items,
                                "startup_bytes": r.startup_bytes}))
    return out, r.hot_bytes, r.startup_bytes


def _relayouts(store: LayerStore, info: ImageInfo, cl: RegistryClient,
               repo: str) -> dict[str, tuple[Path, int, int]]:
    """layer -> (relaid image, hot bytes, start-up bytes) for each local layer of `info` with an
    access list."""
    out = {}
    for digest in info.layers:
        if not store.image_path(digest).exists():
            continue  # lazy here: pushed by reference, as it is
        blob = chunk_index(store, digest).blob
        listed = access_list(store, digest, blob, cl, repo)
        if listed and listed[0]:
            got = relaid_image(store, digest, listed[0], listed[1])
            if got is not None:
                out[digest] = got
    return out


def _push_image(store: LayerStore, info: ImageInfo, repo: str, tag: str, cl: RegistryClient, chunk_size: int,
                progress: PushProgress | None, result: PushResult, lazy_chunk_size: int = REGISTRY_CHUNK_SIZE,
                layouts: dict[str, tuple[Path, int, int]] | None = None) -> None:
    sessions = UploadSessions(registry_dir(store) / "uploads")
    descriptors: list[dict] = []
    n = len(info.layers)
    for i, digest in enumerate(info.layers):
        layer = store.get(digest)
        lazy_idx = _lazy_index(store, digest, cl, repo)
        relaid = (layouts or {}).get(digest)
        path = store.image_path(digest) if relaid is None else relaid[0]
        if lazy_idx is not None:
            idx = lazy_idx
        elif relaid is not None:
            idx = file_index(store, digest, relaid[0], lazy_chunk_size)
            result.relaid[digest] = relaid[1]
        else:
            idx = chunk_index(store, digest, lazy_chunk_size)
        label = f"layer {i + 1}/{n} {layer.short}"

        def on_bytes(done: int, total: int, label: str = label) -> None:
            if progress:
                progress(label, done, total)

        if lazy_idx is not None:  # the registry has it (checked): nothing to send
            up = UploadResult(idx.blob, idx.size, 0, 0, existed=True)
        else:
            up = cl.upload_blob(repo, idx.blob, path=path, chunk_size=chunk_size,
                                sessions=sessions, progress=on_bytes)
        on_bytes(idx.size, idx.size)
        body = index_blob(idx)
        idx_digest = sha256_digest(body)
        cl.upload_blob(repo, idx_digest, data=body, sessions=sessions)
        ann = {ANN_LAYER: digest, ANN_LAYER_SIZE: str(layer.size), ANN_LAYER_ENTRIES: str(layer.entries)}
        if relaid is not None and relaid[2] and lazy_idx is None:  # where its start-up part ends
            ann[ANN_STARTUP_BYTES] = str(relaid[2])
        descriptors.append({"mediaType": LAYER_MEDIA_TYPE, "digest": idx.blob, "size": idx.size,
                            "annotations": {**ann, ANN_CHUNKS: idx_digest}})
        descriptors.append({"mediaType": CHUNK_INDEX_MEDIA_TYPE, "digest": idx_digest, "size": len(body),
                            "annotations": {ANN_LAYER: digest}})
        result.layers.append(LayerPush(digest, idx.blob, idx.size, up.sent, up.resumed_from))
    os_name, arch = host_platform()
    config = json.dumps({"shoal": 1, "os": os_name, "architecture": arch, "image": info.ref,
                         "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(info.created)),
                         "layers": list(info.layers), "config": info.config},
                        sort_keys=True, separators=(",", ":")).encode()
    config_digest = sha256_digest(config)
    cl.upload_blob(repo, config_digest, data=config)
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": OCI_MANIFEST,
        "config": {"mediaType": SHOAL_CONFIG_MEDIA_TYPE, "digest": config_digest, "size": len(config)},
        "layers": descriptors,
        "annotations": {"org.opencontainers.image.ref.name": tag, "io.shoal.image": info.ref},
    }, sort_keys=True, separators=(",", ":")).encode()
    result.manifest = cl.put_manifest(repo, tag, manifest, OCI_MANIFEST)
