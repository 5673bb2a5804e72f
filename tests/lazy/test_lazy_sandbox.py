"""A second Shoal root starts a sandbox from a layer it has never downloaded: the EROFS image stays on
a real HTTP origin and only the chunks the sandbox touches are fetched."""
from __future__ import annotations

import time

from conftest import BIG_MB

from shoal import Sandbox
from shoal.lazy import mount as lazy_mount
from shoal.lazy import prefetch
from shoal.lazy.publish import register_http_layer


def _register(h, url, published, timeout_s=10.0):
    for d in (published["busybox"], published["layer"]):
        register_http_layer(h.store, url, d, timeout_s=timeout_s)
    h.store.create_image("lazy:test", [published["busybox"], published["layer"]])
    return "lazy:test"


def test_sandbox_starts_from_a_layer_never_downloaded(fresh_root, range_server, published):
    h = fresh_root
    img = _register(h, range_server.url, published)
    assert not h.store.image_path(published["layer"]).exists()
    assert h.store.location(published["layer"]) == "remote"
    range_server.reset()
    t = time.perf_counter()
    sb = Sandbox.create(img, root=h.settings.root)
    r = sb.commands.run("cat /data/hello.txt")
    first_exec = time.perf_counter() - t
    assert r.exit_code == 0 and r.stdout == "hello from a lazy layer\n"
    image_bytes = published["index"].size + published["busybox_index"].size
    fetched = range_server.bytes_sent
    print(f"cold start -> first exec {first_exec:.3f} s; fetched {fetched} of {image_bytes} bytes")
    assert fetched < image_bytes * 0.25, (fetched, image_bytes)
    assert h.store.location(published["layer"]) == "partial"
    # the whole big file reads back right (chunks fetched on demand, verified)
    r = sb.commands.run("md5sum /data/big.bin | cut -d' ' -f1")
    assert r.exit_code == 0 and len(r.stdout.strip()) == 32
    sb.kill()
    # the first run recorded its prefetch list
    order = prefetch.load(h.settings.root, published["layer"])
    assert order and len(order) >= BIG_MB
    assert lazy_mount.daemon_pid(h.settings.root) is not None
