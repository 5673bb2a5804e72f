"""`shoal push --relayout`: a layer goes up laid out in the order a first run read it (the byte ranges
of the prefetch list that run published). The blob is new, the tree and its Shoal digest are the
same; a lazy reader of the same files fetches far fewer bytes; a full pull verifies it like any
layer (blob digest, chunk index, tree digest)."""
from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from shoal import Sandbox
from shoal.registry import pull, push
from shoal.registry.media import ANN_LAYER, ANN_STARTUP_BYTES

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


START = "cat /app/s*-start.bin | md5sum"
LATER = "cat /app/l*-later.bin | md5sum"


def _prefix_cached(h, layer: str, timeout: float = 15.0) -> tuple[int, int]:
    """(chunks of the layer's start-up prefix, how many of them are cached) once all are, or at the timeout."""
    from shoal.lazy.daemon import layout_prefix

    index, spec = h.store.lazy_layer(layer)
    want = [index.chunks[i] for i in layout_prefix(index.size, index.chunk_size, spec)]
    chunks = Path(h.settings.root) / "chunks"
    deadline = time.monotonic() + timeout
    while True:
        have = sum(1 for sha in want if (chunks / sha[:2] / sha).exists())
        if have == len(want) or time.monotonic() > deadline:
            return len(want), have
        time.sleep(0.05)


def test_a_relaid_layer_marks_its_start_up_prefix_and_a_cold_start_fetches_it_first(
        registry, host, base_image, make_root, creds, tmp_path, monkeypatch):
    """The recorded run's first command read the start files, its second the later ones: the relaid
    layer's descriptor says how many bytes at its start hold what came before the first command
    ended; a never-seen root with no prefetch list fetches that prefix on its own (no read of those
    files needed), so the first command then fetches nothing, and the later files are not in it."""
    tree = tmp_path / "tree"
    (tree / "app").mkdir(parents=True)
    for i in range(12):  # name order on disk: the cold files, then the later ones, then the start ones
        (tree / f"app/c{i:02d}-cold.bin").write_bytes(os.urandom(120 * KiB))
        (tree / f"app/l{i:02d}-later.bin").write_bytes(os.urandom(24 * KiB))
        (tree / f"app/s{i:02d}-start.bin").write_bytes(os.urandom(24 * KiB))
    layer = host.store.build_from_dir(tree, source="test:relayout-startup").digest
    host.store.create_image("rls:1", ["busybox", layer])
    src = f"{registry.addr}/shoal/rls:1"
    with registry.client() as cl:
        push(host.store, "rls:1", src, client=cl)
    h = make_root()  # the recorded first run: START is its first command, LATER comes after it
    # no kernel read-ahead on the daemons' files: a command's reads (recorded, then fetched) are what it read
    monkeypatch.setenv("SHOAL_LAZY_READAHEAD_KB", "0")
    with registry.client() as cl:
        pull(h.store, src, client=cl, lazy=True)
    with Sandbox.create("shoal/rls:1", root=h.settings.root) as sb:
        start_md5 = sb.commands.run(START).stdout
        later_md5 = sb.commands.run(LATER).stdout
    time.sleep(1)  # the recorder's last ranges reach its file
    with registry.client() as cl:
        push(h.store, "shoal/rls:1", src, client=cl, prefetch_only=True)
        res = push(host.store, "rls:1", src, client=cl, relayout=True)
        manifest = cl.get_manifest("shoal/rls", "1").json()
    blob = {x.layer: x.blob for x in res.layers}[layer]
    desc = next(x for x in manifest["layers"] if x["digest"] == blob)
    startup = int(desc["annotations"][ANN_STARTUP_BYTES])
    # the 12 start files (288 KiB) and the metadata read with them, not the 12 later ones
    assert 12 * 24 * KiB <= startup < 24 * 24 * KiB < res.relaid[layer]

    h2 = make_root()  # never saw the image; no list is published for the new blob
    with registry.client() as cl:
        pull(h2.store, src, client=cl, lazy=True)
    assert h2.store.lazy_layer(layer)[1]["startup_bytes"] == startup
    def layer_bytes(since: int) -> int:  # GETs of this layer's blob (busybox's are cat's and md5sum's)
        return sum(e[3] for e in registry.entries(since) if e[0] == "GET" and e[1].endswith(blob))

    with Sandbox.create("shoal/rls:1", root=h2.settings.root) as sb:
        n, have = _prefix_cached(h2, layer)
        assert n >= 3 and have == n, f"{have} of the {n} prefix chunks fetched without a read"
        mark = registry.mark()
        assert sb.commands.run(START).stdout == start_md5
        assert layer_bytes(mark) == 0  # all of it came with the prefix
        assert sb.commands.run(LATER).stdout == later_md5
        assert layer_bytes(mark) > 0  # these were not in it


def test_a_layer_without_the_annotation_gets_no_prefix(monkeypatch):
    from shoal.lazy.daemon import layout_prefix

    chunk = 128 * KiB
    assert layout_prefix(100 << 20, chunk, {}) == []
    assert layout_prefix(100 << 20, chunk, {"startup_bytes": "5"}) == []  # not an int: ignored
    assert layout_prefix(100 << 20, chunk, {"startup_bytes": True}) == []
    assert layout_prefix(100 << 20, chunk, {"startup_bytes": 300 * KiB}) == [0, 1, 2]
    # a hint never costs more than 10 % of the layer (at least 1 MiB)
    assert len(layout_prefix(100 << 20, chunk, {"startup_bytes": 90 << 20})) == 80
    assert len(layout_prefix(2 << 20, chunk, {"startup_bytes": 2 << 20})) == 8
    monkeypatch.setenv("SHOAL_LAZY_LAYOUT_PREFETCH", "0")
    assert layout_prefix(100 << 20, chunk, {"startup_bytes": 300 * KiB}) == []
