"""A plain origin's layout, for a static HTTP server or an S3-compatible bucket:

    layers/<hex>.erofs            the layer's EROFS image (LAYER_MEDIA_TYPE)
    layers/<hex>.chunks.json      its ChunkIndex (CHUNK_INDEX_MEDIA_TYPE)
    layers/<hex>.prefetch.json    optional: the chunks a first run read, in order

`publish_to_dir` writes a local layer in that layout (to sync to a bucket or serve as it is);
`register_http_layer` makes a store use such a layer lazily, reading only its index now."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..layers.store import LayerInfo, LayerStore
from . import prefetch
from .chunks import ChunkIndex, build_index
from .layer import open_origin


def keys(digest: str) -> dict[str, str]:
    hx = digest.split(":", 1)[1]
    return {"layer": f"layers/{hx}.erofs", "index": f"layers/{hx}.chunks.json",
            "prefetch": f"layers/{hx}.prefetch.json"}


def publish_to_dir(store: LayerStore, ref: str, directory: str | os.PathLike) -> ChunkIndex:
    """Write a local layer (its image, chunk index and any prefetch list) under `directory`."""
    info = store.get(ref)
    out = Path(directory)
    k = keys(info.digest)
    (out / "layers").mkdir(parents=True, exist_ok=True)
    index = build_index(info.digest, store.image_path(info.digest))
    shutil.copyfile(store.image_path(info.digest), out / k["layer"])
    (out / k["index"]).write_text(index.model_dump_json())
    order = prefetch.load(store.settings.root, info.digest)
    if order:
        startup = prefetch.load_startup(store.settings.root, info.digest)
        (out / k["prefetch"]).write_bytes(prefetch.dumps(info.digest, order, startup=startup))
    return index


def register_http_layer(store: LayerStore, url: str, digest: str, timeout_s: float = 10.0,
                        token_env: str | None = None, name: str | None = None) -> LayerInfo:
    """Register `digest`, published at `url` in the layout above, as a lazy layer of `store`."""
    k = keys(digest)
    spec: dict = {"kind": "http", "url": url, "key": k["layer"], "timeout_s": timeout_s,
                  "prefetch_key": k["prefetch"]}
    if token_env:
        spec["token_env"] = token_env
    with open_origin(spec) as origin:
        size = origin.stat(k["index"]).size
        index = ChunkIndex.model_validate_json(origin.read(k["index"], 0, size))
    if index.layer != digest:
        from ..core.errors import BadDigest

        raise BadDigest(f"the chunk index at {k['index']} is for {index.layer}, not {digest}")
    return store.add_lazy_layer(index, spec, name=name)
