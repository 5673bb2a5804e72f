"""`shoal pull --lazy`: a fresh root registers a Shoal image's layers to be read on demand from a real
registry (TLS + basic auth), starts a sandbox at once and fetches only the chunks it touches, by
Range GETs; the origin spec it keeps holds no credential; layers already here stay local; prefetch
lists recorded by one root are published beside the layers and prefetched by another root; an
ordinary container image is converted eagerly."""
from __future__ import annotations

import hashlib
import json
import time

from shoal import Sandbox
from shoal.lazy import prefetch
from shoal.lazy.layer import chunk_cache_for
from shoal.registry import pull, push
from shoal.registry.prefetch import prefetch_tag

from .conftest import BIG, PASSWORD, USER, MiB


def _md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


def test_lazy_pull_starts_a_sandbox_reading_only_what_it_touches(registry, lazy_pushed, make_root, creds):
    h = make_root()
    src = f"{registry.addr}/shoal/lazy:1"
    mark = registry.mark()
    with registry.client() as cl:
        res = pull(h.store, src, client=cl, lazy=True)
    assert res.kind == "shoal" and res.lazy == [lazy_pushed["busybox"], lazy_pushed["layer"]]
    assert res.bytes_fetched < 16384  # two chunk indexes (~70 bytes per 128 KiB chunk)
    # only the manifest, the config and the chunk indexes: no layer blob
    got = {p.rsplit("/", 1)[1] for m, p, _ in registry.requests(mark) if m == "GET" and "/blobs/" in p}
    assert not got & {x.blob for x in lazy_pushed["push"].layers}
    for d in res.lazy:
        assert h.store.location(d) == "remote" and not h.store.image_path(d).exists()
        index, spec = h.store.lazy_layer(d)
        text = json.dumps(spec)
        assert spec["kind"] == "registry" and spec["registry"] == registry.addr and spec["ca"] == str(registry.ca)
        assert PASSWORD not in text and USER not in text and "auth" not in text.lower()  # never a credential
        assert spec["key"] == f"shoal/lazy@{index.blob}"

    mark = registry.mark()
    t = time.perf_counter()
    with Sandbox.create("shoal/lazy:1", root=h.settings.root) as sb:
        r = sb.commands.run("cat hello.txt; echo $WHO")
        first = time.perf_counter() - t
        assert r.exit_code == 0 and r.stdout == "hello, lazily\nlazy\n", r
        fetched = registry.blob_bytes(mark)
        # the pull found no published list and noted it: the daemon did not ask again while mounting
        asked = [p for _m, p, _c in registry.requests(mark) if "/manifests/shoal-prefetch-" in p]
        assert not asked, asked
        reads = [e for e in registry.entries(mark) if e[0] == "GET" and "/blobs/" in e[1] and e[2] != 401]
        print(f"cold start -> first exec {first:.3f} s; {fetched} of {lazy_pushed['image_bytes']} bytes fetched "
              f"in {len(reads)} range GETs")
        assert reads and all(e[2] == 206 for e in reads)  # Range GETs
        assert fetched < 0.25 * lazy_pushed["image_bytes"]
        assert h.store.location(lazy_pushed["layer"]) == "partial"
        r = sb.commands.run("md5sum big.bin | cut -d' ' -f1")
        assert r.stdout.strip() == _md5(lazy_pushed["big"])
    cache = chunk_cache_for(h.settings.root)
    for sha in cache.chunks():
        assert hashlib.sha256(cache.path(sha).read_bytes()).hexdigest() == sha
    # the first run recorded what it read: publish it beside the layers, in the registry
    order = prefetch.load(h.settings.root, lazy_pushed["layer"])
    assert order and len(order) >= BIG // MiB
    startup = prefetch.load_startup(h.settings.root, lazy_pushed["layer"])  # chunks before `cat` ended
    want = prefetch.to_fetch(order, startup)
    assert startup and want == order[:startup] and len(want) < len(order)
    with registry.client() as cl:
        out = push(h.store, "shoal/lazy:1", src, client=cl, prefetch_only=True)
        assert out.manifest == "" and out.prefetch_lists[lazy_pushed["layer"]] == len(order)
        blob = h.store.lazy_layer(lazy_pushed["layer"])[0].blob
        art = cl.get_manifest("shoal/lazy", prefetch_tag(blob)).json()
    assert art["artifactType"].endswith("prefetch+json") and len(art["layers"]) == 1

    # another host that has never seen the image prefetches those chunks while its sandbox runs
    h2 = make_root()
    with registry.client() as cl:
        pull(h2.store, src, client=cl, lazy=True)
    index = h2.store.lazy_layer(lazy_pushed["layer"])[0]
    with Sandbox.create("shoal/lazy:1", root=h2.settings.root) as sb:
        assert sb.commands.run("cat hello.txt").exit_code == 0
        cache = chunk_cache_for(h2.settings.root)
        deadline = time.monotonic() + 20
        while not all(cache.has(index.chunks[i]) for i in want) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(cache.has(index.chunks[i]) for i in want)  # the list's start-up part: the prefetch did
    assert prefetch.load(h2.settings.root, lazy_pushed["layer"]) == order  # the list came from the registry
    assert prefetch.load_startup(h2.settings.root, lazy_pushed["layer"]) == startup


def test_layers_already_here_stay_local(registry, lazy_pushed, make_root, creds):
    h = make_root()
    with registry.client() as cl:
        pull(h.store, f"{registry.addr}/shoal/lazy:bb", client=cl)  # busybox, downloaded
        res = pull(h.store, f"{registry.addr}/shoal/lazy:1", client=cl, lazy=True)
    assert res.present == [lazy_pushed["busybox"]] and res.lazy == [lazy_pushed["layer"]]
    assert h.store.location(lazy_pushed["busybox"]) == "local"
    assert h.store.location(lazy_pushed["layer"]) == "remote"
    with Sandbox.create("shoal/lazy:1", root=h.settings.root) as sb:
        assert sb.commands.run("cat /data/hello.txt").stdout == "hello, lazily\n"
    # a lazy layer whose blob the target has can be pushed (under a new tag: nothing sent)
    with registry.client() as cl:
        again = push(h.store, "shoal/lazy:1", f"{registry.addr}/shoal/lazy:again", client=cl)
    assert again.bytes_sent == 0


def test_an_ordinary_container_image_is_converted_eagerly(registry, ctr_image, make_root):
    h = make_root()
    with registry.client() as cl:
        res = pull(h.store, f"{registry.addr}/shoal/ctr:multi", client=cl, lazy=True)
    assert res.kind == "container" and res.lazy == [] and "converted eagerly" in res.note
    assert all(h.store.location(d) == "local" for d in res.image.layers)
