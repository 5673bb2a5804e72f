"""Shoal images through a real registry: push, pull into a fresh root, run; nothing sent or fetched
twice; a corrupted blob refused with nothing installed."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from shoal import Sandbox
from shoal.core.errors import CorruptChunk
from shoal.lazy.chunks import CHUNK_INDEX_MEDIA_TYPE, LAYER_MEDIA_TYPE
from shoal.registry import RegistryOrigin, pull, push
from shoal.registry.media import ANN_LAYER, SHOAL_CONFIG_MEDIA_TYPE

MiB = 1 << 20


def _blob_requests(reqs, method="GET"):
    return [p for m, p, _ in reqs if m == method and "/blobs/" in p and "/uploads/" not in p]


def _uploads(reqs):
    return [(m, p) for m, p, _ in reqs if "/blobs/uploads/" in p and m in ("POST", "PATCH", "PUT")]


@pytest.fixture(scope="session")
def app_image(host, base_image, tmp_path_factory) -> str:
    """busybox + a layer with 3 MiB of random bytes (several upload chunks) and an image config."""
    d = tmp_path_factory.mktemp("app")
    (d / "srv").mkdir()
    (d / "srv/blob.bin").write_bytes(os.urandom(3 * MiB + 123))
    (d / "srv/hello.txt").write_text("hello from the registry\n")
    layer = host.store.build_from_dir(d, source="test:app").digest
    host.store.create_image("app:1", ["busybox", layer], config={"env": {"GREETING": "hi"}, "workdir": "/srv"})
    return "app:1"


@pytest.fixture(scope="session")
def pushed(host, app_image, registry):
    with registry.client() as cl:
        mark = registry.mark()
        res = push(host.store, app_image, f"{registry.addr}/shoal/app:1", client=cl, chunk_size=MiB)
        return res, registry.requests(mark)


def test_push_sends_each_layer_as_an_erofs_blob_with_its_chunk_index(host, registry, pushed, app_image):
    res, reqs = pushed
    img = host.store.get_image(app_image)
    assert [x.layer for x in res.layers] == list(img.layers)
    big = res.layers[1]
    assert big.sent == big.size == host.store.image_path(big.layer).stat().st_size
    patches = [p for m, p in _uploads(reqs) if m == "PATCH"]
    assert len(patches) >= 4  # the 3 MiB layer went up in 1 MiB chunks
    with registry.client() as cl:
        m = cl.get_manifest("shoal/app", "1").json()
    assert m["config"]["mediaType"] == SHOAL_CONFIG_MEDIA_TYPE and m["mediaType"].endswith("manifest.v1+json")
    kinds = [d["mediaType"] for d in m["layers"]]
    assert kinds == [LAYER_MEDIA_TYPE, CHUNK_INDEX_MEDIA_TYPE] * 2
    assert [d["annotations"][ANN_LAYER] for d in m["layers"][::2]] == list(img.layers)
    # the blob is the layer's EROFS image, byte for byte
    assert registry.blob_path(big.blob).read_bytes() == host.store.image_path(big.layer).read_bytes()


def test_round_trip_into_a_fresh_root_then_a_sandbox_runs(host, other_host, other_root, registry, pushed, app_image):
    with registry.client() as cl:
        res = pull(other_host.store, f"{registry.addr}/shoal/app:1", client=cl)
    src = host.store.get_image(app_image)
    assert res.kind == "shoal" and res.image.ref == "shoal/app:1"
    assert res.image.layers == src.layers and res.image.config == src.config
    for d in src.layers:  # every byte verified and installed as the same layer
        assert other_host.store.image_path(d).read_bytes() == host.store.image_path(d).read_bytes()
        assert other_host.store.get(d).size == host.store.get(d).size
    with Sandbox.create("shoal/app:1", root=other_root) as sb:
        r = sb.commands.run("cat hello.txt; echo $GREETING; pwd; wc -c < blob.bin")
    assert r.exit_code == 0, r.stderr
    assert r.stdout.split("\n")[:4] == ["hello from the registry", "hi", "/srv", str(3 * MiB + 123)]


def test_a_second_push_sends_no_layer_blob(host, registry, pushed, app_image):
    mark = registry.mark()
    with registry.client() as cl:
        res = push(host.store, app_image, f"{registry.addr}/shoal/app:1", client=cl, chunk_size=MiB)
    reqs = registry.requests(mark)
    assert res.bytes_sent == 0 and res.layers_sent == 0
    assert _uploads(reqs) == []  # config and chunk indexes were there too
    assert [m for m, p, _ in reqs if "/manifests/" in p] == ["PUT"]
    assert len(_blob_requests(reqs, "HEAD")) >= 4


def test_a_pull_of_present_layers_fetches_no_layer_blob(host, other_host, registry, pushed):
    with registry.client() as cl:
        pull(other_host.store, f"{registry.addr}/shoal/app:1", client=cl)  # idempotent if it ran already
        mark = registry.mark()
        res = pull(other_host.store, f"{registry.addr}/shoal/app:1", ref="app:again", client=cl)
        res_src = pull(host.store, f"{registry.addr}/shoal/app:1", ref="app:same-host", client=cl)
    gets = _blob_requests(registry.requests(mark))
    assert res.fetched == [] and res_src.fetched == [] and res.bytes_fetched == 0
    assert len(gets) == 2, gets  # the config blob, once per pull; no layer, no chunk index
    assert set(res.present) == set(host.store.get_image("app:1").layers)


def test_a_corrupted_blob_is_refused_and_nothing_is_installed(host, base_image, registry, fresh_host, tmp_path):
    d = tmp_path / "tree"
    d.mkdir()
    (d / "data.bin").write_bytes(os.urandom(2 * MiB))
    layer = host.store.build_from_dir(d, source="test:corrupt").digest
    host.store.create_image("corrupt:1", ["busybox", layer])
    with registry.client() as cl:
        res = push(host.store, "corrupt:1", f"{registry.addr}/shoal/corrupt:1", client=cl, chunk_size=MiB)
        blob = registry.blob_path(res.layers[1].blob)
        raw = bytearray(blob.read_bytes())
        raw[MiB + 17] ^= 0xFF  # one flipped bit in the second chunk, size unchanged
        blob.write_bytes(bytes(raw))
        with pytest.raises(CorruptChunk) as e:
            pull(fresh_host.store, f"{registry.addr}/shoal/corrupt:1", client=cl)
    assert res.layers[1].blob in str(e.value)
    assert fresh_host.store.list() == [] and fresh_host.store.list_images() == []
    assert list(Path(fresh_host.settings.layers_dir).iterdir()) == []
    assert [p for p in fresh_host.settings.tmp_dir.iterdir() if p.name.startswith("pull-")] == []


def test_registry_origin_stats_and_range_reads_layer_blobs(host, registry, pushed, app_image):
    with RegistryOrigin(registry.client()) as origin:
        layers = origin.layers("shoal/app:1")
        assert [x.layer for x in layers] == list(host.store.get_image(app_image).layers)
        big = layers[1]
        st = origin.stat(big.key)
        assert st.size == big.size and st.digest == big.key.split("@")[1]
        local = host.store.image_path(big.layer).read_bytes()
        assert origin.read(big.key, MiB + 5, 1000) == local[MiB + 5:MiB + 1005]
        assert origin.read(big.key, big.size - 10, 100) == local[-10:]  # short only at the end
        idx = origin.chunk_index(big)
        assert idx.layer == big.layer and idx.verify(1, origin.read(big.key, *idx.span(1)))
        keys = origin.list("shoal/app:1")
        assert big.key in keys and big.index_key in keys and len(keys) == 5
