"""Resumable pushes: a push killed mid-upload resumes from the offset the registry reports; a
connection cut mid-chunk is retried within the same push."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading

from shoal.registry import pull, push

from .conftest import PASSWORD, USER

MiB = 1 << 20


def _random_image(host, tmp_path, name: str, size: int) -> str:
    d = tmp_path / name
    d.mkdir()
    (d / "payload.bin").write_bytes(os.urandom(size))
    layer = host.store.build_from_dir(d, source=f"test:{name}").digest
    host.store.create_image(f"{name}:1", [layer])
    return layer


KILLER = textwrap.dedent("""
    import os, signal, sys
    from shoal.config import load_settings
    from shoal.layers.store import LayerStore
    from shoal.registry import RegistryClient, push

    root, addr, ca, target = sys.argv[1:5]
    store = LayerStore(load_settings(root))

    def progress(what, done, total):
        if done >= 2 * (1 << 20) and done < total:  # two chunks of the layer are in: die, as a crash would
            os.kill(os.getpid(), signal.SIGKILL)

    with RegistryClient(addr, ca=ca, username=os.environ["U"], password=os.environ["P"]) as cl:
        push(store, "resume:1", target, client=cl, chunk_size=1 << 20, progress=progress)
""")


def test_a_killed_push_resumes_from_the_registrys_offset(host, registry, fresh_host, tmp_path):
    size = 5 * MiB + 77
    layer = _random_image(host, tmp_path, "resume", size)
    target = f"{registry.addr}/shoal/resume:1"
    proc = subprocess.run([sys.executable, "-c", KILLER, str(host.settings.root), registry.addr, str(registry.ca),
                           target], env=dict(os.environ, U=USER, P=PASSWORD), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == -9, proc.stderr[-2000:]
    mark = registry.mark()
    with registry.client() as cl:
        res = push(host.store, "resume:1", target, client=cl, chunk_size=MiB)
    reqs = registry.requests(mark)
    up = res.layers[0]
    assert up.resumed_from == 2 * MiB and up.sent == size_of(host, layer) - 2 * MiB
    assert ("GET", 204) in {(m, s) for m, p, s in reqs if "/blobs/uploads/" in p}  # asked the registry where it was
    with registry.client() as cl:
        pull(fresh_host.store, target, client=cl)
    assert fresh_host.store.image_path(layer).read_bytes() == host.store.image_path(layer).read_bytes()


def size_of(host, layer: str) -> int:
    return host.store.image_path(layer).stat().st_size


class CuttingProxy:
    """A TCP proxy to the registry that, once armed, drops the connection after `cut_after` more
    bytes from the client: a network failure in the middle of an upload chunk."""

    def __init__(self, upstream: str):
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.addr = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.cut_after: int | None = None
        self.cuts = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, upward: bool) -> None:
        try:
            while data := src.recv(65536):
                if upward:
                    with self._lock:
                        if self.cut_after is not None:
                            self.cut_after -= len(data)
                            if self.cut_after <= 0:
                                self.cut_after = None
                                self.cuts += 1
                                raise OSError("cut")
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def close(self) -> None:
        self.sock.close()


def test_a_connection_cut_mid_chunk_is_retried_in_the_same_push(host, registry, fresh_host, tmp_path):
    """The push asks the registry where the upload stands and goes on. (distribution 2.8 keeps the
    half-written chunk and then calls the upload invalid, so against it this blob starts over; the
    bytes that arrive are still exactly the layer's.)"""
    layer = _random_image(host, tmp_path, "cut", 4 * MiB)
    proxy = CuttingProxy(registry.addr)
    try:
        from shoal.registry import RegistryClient

        with RegistryClient(proxy.addr, ca=registry.ca, username=USER, password=PASSWORD, timeout=5) as cl:
            proxy.cut_after = int(2.5 * MiB)  # in the third 1 MiB PATCH
            res = push(host.store, "cut:1", f"{proxy.addr}/shoal/cut:1", client=cl, chunk_size=MiB)
            assert proxy.cuts == 1 and cl.stats["GET upload"] >= 1  # it asked where the upload stood
        assert res.layers[0].sent >= size_of(host, layer)
    finally:
        proxy.close()
    with registry.client() as cl:
        pull(fresh_host.store, f"{registry.addr}/shoal/cut:1", client=cl)
    assert fresh_host.store.image_path(layer).read_bytes() == host.store.image_path(layer).read_bytes()
