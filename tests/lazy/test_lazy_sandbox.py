"""A second Shoal root starts sandboxes from layers it has never downloaded: the EROFS images stay on
a real HTTP origin and only the chunks the sandbox touches are fetched; faults reach the sandbox as
EIO (bounded by the origin timeout) and the SDK as typed errors, and the same sandbox continues once
the origin is back."""
from __future__ import annotations

import hashlib
import time

import pytest
from conftest import BIG_MB

from shoal import Sandbox
from shoal.core.errors import OriginUnavailable
from shoal.lazy import mount as lazy_mount
from shoal.lazy import prefetch
from shoal.lazy.layer import chunk_cache_for
from shoal.lazy.publish import keys, register_http_layer


def _register(h, url, published, timeout_s=10.0):
    for d in (published["busybox"], published["layer"]):
        register_http_layer(h.store, url, d, timeout_s=timeout_s)
    h.store.create_image("lazy:test", [published["busybox"], published["layer"]])
    return "lazy:test"


def _cache_is_clean(root) -> None:
    cache = chunk_cache_for(root)
    for sha in cache.chunks():
        assert hashlib.sha256(cache.path(sha).read_bytes()).hexdigest() == sha


def _md5_at(mib: int) -> str:
    return f"dd if=/data/big.bin bs=65536 skip={mib * 16} count=4 2>/dev/null | md5sum | cut -d' ' -f1"


def test_sandbox_starts_from_a_layer_never_downloaded(make_root, range_server, published, origin_dir, monkeypatch):
    h = make_root()
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
    r = sb.commands.run("md5sum /data/big.bin | cut -d' ' -f1")  # the whole file, chunk by chunk, verified
    assert r.exit_code == 0 and r.stdout.strip() == hashlib.md5(published["big"]).hexdigest()
    # every chunk cached: the daemon promotes the layer to a local image file (new sandboxes mount it)
    assert h.store.location(published["layer"]) in ("cached", "local")
    sb.kill()
    _cache_is_clean(h.settings.root)

    # the first run recorded its prefetch list; published beside the layer, a never-seen root fetches
    # those chunks in the background, in order, while its sandbox already runs
    order = prefetch.load(h.settings.root, published["layer"])
    assert order and len(order) >= BIG_MB
    # the first command (cat) ended the start-up; md5sum's chunks of big.bin came after it
    startup = prefetch.load_startup(h.settings.root, published["layer"])
    index = published["index"]
    big = {i for i in order[startup or 0:]}
    assert startup is not None and 0 < startup < len(order) - BIG_MB // 2, (startup, len(order))
    (origin_dir / keys(published["layer"])["prefetch"]).write_bytes(
        prefetch.dumps(published["layer"], order, startup=startup))
    try:
        # a never-seen root prefetches only the start-up part
        h3 = make_root()
        img = _register(h3, range_server.url, published)
        range_server.reset()
        sb3 = Sandbox.create(img, root=h3.settings.root)
        assert sb3.commands.run("cat /data/hello.txt").exit_code == 0
        cache = chunk_cache_for(h3.settings.root)
        deadline = time.monotonic() + 20
        while not all(cache.has(index.chunks[i]) for i in order[:startup]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(cache.has(index.chunks[i]) for i in order[:startup])
        time.sleep(0.5)  # nothing more comes
        assert not any(cache.has(index.chunks[i]) for i in big - set(order[:startup]))
        sb3.kill()

        # SHOAL_LAZY_PREFETCH_STARTUP=0: the whole list
        monkeypatch.setenv("SHOAL_LAZY_PREFETCH_STARTUP", "0")
        h2 = make_root()
        img = _register(h2, range_server.url, published)
        range_server.reset()
        sb2 = Sandbox.create(img, root=h2.settings.root)
        assert sb2.commands.run("cat /data/hello.txt").exit_code == 0
        cache = chunk_cache_for(h2.settings.root)
        deadline = time.monotonic() + 20
        while not all(cache.has(index.chunks[i]) for i in order) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(cache.has(index.chunks[i]) for i in order)  # no command read them: the prefetch did
        got = [r[2] for r in range_server.gets(keys(published["layer"])["layer"])]
        # coalesced: consecutive listed chunks come in one Range GET; no chunk twice
        fetched: list[int] = []
        for g in got:
            lo, hi = (int(x) for x in g.removeprefix("bytes=").split("-"))
            assert lo % index.chunk_size == 0
            fetched += list(index.chunks_for(lo, hi + 1 - lo))
        assert set(order) <= set(fetched) and len(fetched) == len(set(fetched))
        assert len(got) < len(set(order))  # fewer requests than chunks
    finally:
        (origin_dir / keys(published["layer"])["prefetch"]).unlink()


def test_origin_down_slow_corrupt(make_root, proxy, published):
    h = make_root()
    img = _register(h, proxy.url, published, timeout_s=1.5)
    proxy.stop()
    with pytest.raises(OriginUnavailable):  # nothing can be mounted: the SDK gets the typed error
        Sandbox.create(img, root=h.settings.root)
    proxy.start()
    sb = Sandbox.create(img, root=h.settings.root)
    assert sb.commands.run("cat /data/hello.txt").stdout == "hello from a lazy layer\n"
    big = published["big"]

    def expect(mib: int) -> str:
        return hashlib.md5(big[mib << 20:(mib << 20) + (256 << 10)]).hexdigest()

    # down: the reading process gets EIO, bounded by the timeout, not a hang
    proxy.stop()
    t = time.monotonic()
    r = sb.commands.run("dd if=/data/big.bin of=/dev/null bs=65536 skip=320 count=4", timeout=30)
    took = time.monotonic() - t
    assert r.exit_code != 0 and "Input/output error" in r.stderr, r
    assert took < 10, took
    proxy.start()  # back: the same sandbox continues, same file
    r = sb.commands.run(_md5_at(20))
    assert r.exit_code == 0 and r.stdout.strip() == expect(20)

    # slow (past the timeout): EIO again, bounded
    proxy.delay = 4.0
    t = time.monotonic()
    r = sb.commands.run(_md5_at(15).replace(" | md5sum | cut -d' ' -f1", " >/dev/null"), timeout=30)
    assert r.exit_code != 0 and time.monotonic() - t < 12
    proxy.delay = 0.0
    assert sb.commands.run(_md5_at(15)).stdout.strip() == expect(15)

    # wrong bytes: EIO, and the cache never keeps them
    proxy.corrupt = True
    r = sb.commands.run(_md5_at(10).replace(" | md5sum | cut -d' ' -f1", " >/dev/null"))
    assert r.exit_code != 0
    _cache_is_clean(h.settings.root)
    proxy.corrupt = False
    assert sb.commands.run(_md5_at(10)).stdout.strip() == expect(10)
    _cache_is_clean(h.settings.root)


def test_gc_keeps_what_a_live_sandbox_uses(make_root, proxy, published):
    h = make_root()
    img = _register(h, proxy.url, published, timeout_s=1.5)
    sb = Sandbox.create(img, root=h.settings.root)
    assert sb.commands.run(_md5_at(5)).exit_code == 0
    cache = chunk_cache_for(h.settings.root)
    before = cache.chunks()
    for _ in range(50):  # the kernel's (and the daemon's) read-ahead of the next chunks may be in flight
        time.sleep(0.2)
        now = cache.chunks()
        if now == before:
            break
        before = now
    out = h.gc()
    # nothing evicted (a read-ahead landing meanwhile may only add chunks)
    assert out["chunks_evicted"] == 0 and before <= cache.chunks()
    proxy.stop()  # what the sandbox read is still here: it reads again from the cache, not the origin
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")
    r = sb.commands.run(_md5_at(5))
    assert r.exit_code == 0 and r.stdout.strip() == hashlib.md5(
        published["big"][5 << 20:(5 << 20) + (256 << 10)]).hexdigest()
    sb.kill()
    held = cache.chunks()
    out = h.gc()
    assert out["chunks_evicted"] == len(held) and cache.chunks() == set()
    assert lazy_mount.daemon_pid(h.settings.root) is None
    assert h.store.location(published["layer"]) == "remote"


def _mount_source(path) -> str:
    """The source of the topmost mount at `path` (a file-backed EROFS names its image file)."""
    src = ""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            if left.split(" ")[4] == str(path):
                src = right.split(" ")[1]
    return src


def test_a_completed_layer_is_promoted_to_a_local_image(make_root, range_server, published, monkeypatch):
    """SHOAL_LAZY_COMPLETE=1: the daemon fetches the rest of the layer in the background; once every
    chunk is cached the layer becomes a local image file (verified against its blob digest), new
    sandboxes mount that, and the sandbox already running keeps its lazy mount."""
    monkeypatch.setenv("SHOAL_LAZY_COMPLETE", "1")
    h = make_root()
    img = _register(h, range_server.url, published)
    sb = Sandbox.create(img, root=h.settings.root)
    assert sb.commands.run("cat /data/hello.txt").exit_code == 0
    layer, mnt = published["layer"], h.store.mount_path(published["layer"])
    assert "lazyfs" in _mount_source(mnt)
    deadline = time.monotonic() + 30
    while not h.store.image_path(layer).exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert h.store.location(layer) == "local"
    assert h.store.image_path(layer).read_bytes() == (range_server.dir / keys(layer)["layer"]).read_bytes()
    sb2 = Sandbox.create(img, root=h.settings.root)
    assert _mount_source(mnt) == str(h.store.image_path(layer))  # new sandboxes: the local image
    want = hashlib.md5(published["big"][7 << 20:(7 << 20) + (256 << 10)]).hexdigest()
    assert sb2.commands.run(_md5_at(7)).stdout.strip() == want
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")
    assert sb.commands.run(_md5_at(7)).stdout.strip() == want  # the first one, still through the daemon
    sb.kill()
    sb2.kill()
