"""`shoal push --relayout`: a layer goes up laid out in the order a first run read it (the byte ranges
of the prefetch list that run published). The blob is new, the tree and its Shoal digest are the
same; a lazy reader of the same files fetches far fewer bytes; a full pull verifies it like any
layer (blob digest, chunk index, tree digest)."""
from __future__ import annotations

import hashlib
import os
import time

from shoal import Sandbox
from shoal.registry import pull, push
from shoal.registry.media import ANN_LAYER

KiB = 1 << 10
HOT = "cat /app/*-hot.txt | md5sum"


def _lazy_read(registry, make_root, src: str) -> tuple[int, str]:
    """A fresh root: lazy pull, then read the hot files; (registry blob bytes, md5 of what was read)."""
    h = make_root()
    with registry.client() as cl:
        mark = registry.mark()
        pull(h.store, src, client=cl, lazy=True)
    with Sandbox.create("shoal/rl:1", root=h.settings.root) as sb:
        r = sb.commands.run(HOT)
        assert r.exit_code == 0, r
    return registry.blob_bytes(mark), r.stdout


def test_a_relaid_layer_is_the_same_tree_and_fetches_less(registry, host, base_image, make_root, creds,
                                                          tmp_path):
    tree = tmp_path / "tree"
    (tree / "app").mkdir(parents=True)
    hot = b""
    for i in range(40):  # in name order each small hot file sits between two 120 KiB cold ones
        (tree / f"app/f{i:02d}-cold.bin").write_bytes(os.urandom(120 * KiB))
        data = os.urandom(6 * KiB)
        (tree / f"app/f{i:02d}-hot.txt").write_bytes(data)
        hot += data
    layer = host.store.build_from_dir(tree, source="test:relayout").digest
    host.store.create_image("rl:1", ["busybox", layer])
    src = f"{registry.addr}/shoal/rl:1"
    with registry.client() as cl:
        plain = push(host.store, "rl:1", src, client=cl)
    original = {x.layer: x.blob for x in plain.layers}

    # a first run somewhere else, recorded and published beside the blobs
    h = make_root()
    with registry.client() as cl:
        pull(h.store, src, client=cl, lazy=True)
    with Sandbox.create("shoal/rl:1", root=h.settings.root) as sb:
        assert sb.commands.run(HOT).stdout.split()[0] == hashlib.md5(hot).hexdigest()
    time.sleep(1)  # the recorder's last ranges reach its file
    with registry.client() as cl:
        push(h.store, "shoal/rl:1", src, client=cl, prefetch_only=True)
    before, md5 = _lazy_read(registry, make_root, src)

    with registry.client() as cl:
        res = push(host.store, "rl:1", src, client=cl, relayout=True)
        manifest = cl.get_manifest("shoal/rl", "1").json()
    assert layer in res.relaid and res.relaid[layer] < 0.5 * host.store.get(layer).size
    relaid = {x.layer: x.blob for x in res.layers}
    assert relaid[layer] != original[layer] and res.layers_sent >= 1
    # the annotation still names the tree: content addresses hold
    descs = [x for x in manifest["layers"] if x["digest"] == relaid[layer]]
    assert descs and descs[0]["annotations"][ANN_LAYER] == layer
    with registry.client() as cl:  # the same list gives the same blob: nothing sent again
        again = push(host.store, "rl:1", f"{src}-again", client=cl, relayout=True, access_from="shoal/rl")
    assert {x.layer: x.blob for x in again.layers} == relaid and again.bytes_sent == 0

    after, md5_after = _lazy_read(registry, make_root, src)
    assert md5_after == md5
    print(f"hot files read lazily: {before} bytes fetched as built, {after} relaid")
    assert after < 0.5 * before

    # a full pull checks the new blob like any layer (digest, chunk index, tree) and keeps it
    h3 = make_root()
    with registry.client() as cl:
        out = pull(h3.store, src, client=cl)
    assert relaid[layer] in out.fetched and h3.store.location(layer) == "local"
    path = h3.store.image_path(layer)
    assert "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest() == relaid[layer]
    with Sandbox.create("shoal/rl:1", root=h3.settings.root) as sb:
        assert sb.commands.run(HOT).stdout == md5


def test_relayout_without_an_access_list_pushes_the_layer_as_built(registry, host, base_image, tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "t/f.txt").write_text("nobody read me\n")
    layer = host.store.build_from_dir(tmp_path / "t", source="test:relayout-none").digest
    host.store.create_image("rl-none:1", [layer])
    with registry.client() as cl:
        res = push(host.store, "rl-none:1", f"{registry.addr}/shoal/rl-none:1", client=cl, relayout=True)
    assert res.relaid == {}
    assert res.layers[0].blob == "sha256:" + hashlib.sha256(host.store.image_path(layer).read_bytes()).hexdigest()
