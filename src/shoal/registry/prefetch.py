"""Prefetch lists in a registry: published beside the layer, found by the layer's blob digest.

A root that runs a lazily pulled image records, per layer, the chunks its first run read, in order
(`shoal.lazy.prefetch`). `publish_prefetch` puts each recorded list in the image's repository as a
small OCI artifact: an image manifest with `artifactType` PREFETCH_MEDIA_TYPE, the empty config
(`{}`, OCI_EMPTY) and one blob, the list (`{"layer": <Shoal digest>, "chunks": [...]}`), tagged

    shoal-prefetch-<hex of the layer's EROFS blob digest>

A tag, not the OCI 1.1 referrers API: Debian's registry (distribution 2.8) has no referrers
endpoint, and a layer is shared by many images (every workspace image shares the Python base), so
the list belongs to the layer blob, not to one image manifest. Any registry stores it; a later lazy
pull's origin spec names it (`prefetch_key` = `<repo>:shoal-prefetch-<hex>`), and the lazy daemon of
another root fetches it when it first opens the layer (a missing tag: nothing to prefetch, record).
Chunk numbers refer to that very blob, and every prefetched chunk is verified like any other."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from ..layers.store import LayerStore
from ..lazy import prefetch as lazy_prefetch
from .client import RegistryClient, sha256_digest
from .media import ANN_LAYER, ANN_PREFETCH_BLOB, OCI_EMPTY, OCI_MANIFEST, PREFETCH_MEDIA_TYPE
from .reference import parse_reference

EMPTY = b"{}"


def prefetch_tag(blob: str) -> str:
    """The tag of a layer blob's prefetch list (sha256:<hex> -> shoal-prefetch-<hex>)."""
    return "shoal-prefetch-" + blob.split(":", 1)[1]


def layer_blob(store: LayerStore, digest: str) -> str:
    """The sha256 of a layer's EROFS image (what chunk numbers refer to), local or lazy."""
    rec = store.lazy_layer(digest)
    if rec is not None and not store.image_path(digest).exists():
        return rec[0].blob
    from .push import chunk_index

    return chunk_index(store, digest).blob


@dataclass
class PrefetchPublish:
    published: dict[str, int] = field(default_factory=dict)  # layer digest -> chunks in its list
    skipped: list[str] = field(default_factory=list)  # layers with no recorded list


def publish_prefetch(store: LayerStore, image_ref: str, target: str, *, client: RegistryClient | None = None,
                     ca: str | None = None, insecure: bool = False, plain_http: bool = False) -> PrefetchPublish:
    """Publish the prefetch lists this root recorded for the layers of `image_ref` in the
    repository of `target` ("REGISTRY/REPO[:TAG]"), one tagged artifact per layer blob."""
    info = store.get_image(image_ref)
    ref = parse_reference(target)
    own = client is None
    cl = client or RegistryClient(ref.registry, ca=ca, insecure=insecure, plain_http=plain_http)
    out = PrefetchPublish()
    try:
        for digest in info.layers:
            order = lazy_prefetch.load(store.settings.root, digest)
            if not order:
                out.skipped.append(digest)
                continue
            blob = layer_blob(store, digest)
            rec = lazy_prefetch.load_ranges(store.settings.root, digest)  # byte ranges: what --relayout uses
            ranges = [list(r) for r in rec[1]] if rec is not None and rec[0] == blob else None
            root = store.settings.root
            body = lazy_prefetch.dumps(digest, order, ranges, blob, lazy_prefetch.load_startup(root, digest),
                                       lazy_prefetch.load_startup_ranges(root, digest) if ranges else None)
            body_digest = sha256_digest(body)
            cl.upload_blob(ref.repository, body_digest, data=body)
            cl.upload_blob(ref.repository, sha256_digest(EMPTY), data=EMPTY)
            manifest = json.dumps({
                "schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": PREFETCH_MEDIA_TYPE,
                "config": {"mediaType": OCI_EMPTY, "digest": sha256_digest(EMPTY), "size": len(EMPTY)},
                "layers": [{"mediaType": PREFETCH_MEDIA_TYPE, "digest": body_digest, "size": len(body),
                            "annotations": {ANN_LAYER: digest, ANN_PREFETCH_BLOB: blob}}],
                "annotations": {ANN_LAYER: digest, ANN_PREFETCH_BLOB: blob},
            }, sort_keys=True, separators=(",", ":")).encode()
            cl.put_manifest(ref.repository, prefetch_tag(blob), manifest, OCI_MANIFEST)
            out.published[digest] = len(order)
        return out
    finally:
        if own:
            cl.close()
