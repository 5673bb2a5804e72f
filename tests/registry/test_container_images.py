"""Ordinary container images from a registry: an OCI image built here byte by byte (tar+gzip and
tar+zstd layers, a whiteout and an opaque directory, a config with diff_ids, an arm64 + amd64
index), pushed with the client's raw blob and manifest calls, then pulled, converted and run."""
from __future__ import annotations

from shoal import Sandbox
from shoal.registry import pull

from .oci_build import REPO


def test_pull_picks_the_host_platform_and_converts_each_layer_like_layer_import(
        registry, other_host, ctr_image, tmp_path):
    mark = registry.mark()
    with registry.client() as cl:
        res = pull(other_host.store, f"{registry.addr}/{REPO}:multi", client=cl)
    paths = [p for m, p, _ in registry.requests(mark) if m == "GET"]
    assert res.kind == "container" and res.image.ref == f"{REPO}:multi" and len(res.image.layers) == 2
    assert f"/v2/{REPO}/manifests/{ctr_image['arm_manifest']}" not in paths  # amd64 chosen, arm64 never read
    assert f"/v2/{REPO}/blobs/{ctr_image['arm_blob']}" not in paths
    assert f"/v2/{REPO}/blobs/{ctr_image['zst_blob']}" in paths  # the zstd layer was fetched and converted
    # exactly what `shoal layer import` makes of the same tars: same whiteouts, same opaque dir, same digest
    for raw, got in zip((ctr_image["base_tar"], ctr_image["top_tar"]), res.image.layers):
        (tmp_path / "l.tar").write_bytes(raw)
        assert other_host.store.build_from_tar(path=tmp_path / "l.tar").digest == got
    assert res.image.config["env"]["FOO"] == "bar=baz" and res.image.config["workdir"] == "/data"


def test_the_converted_image_runs_with_whiteouts_applied(registry, other_host, other_root, ctr_image):
    with registry.client() as cl:
        pull(other_host.store, f"{registry.addr}/{REPO}:multi", client=cl)
    with Sandbox.create(f"{REPO}:multi", root=other_root) as sb:
        r = sb.commands.run("cat /arch; ls /data; ls /keep; cat /etc/marker; echo $FOO; pwd")
    assert r.exit_code == 0, r.stderr
    assert r.stdout.split() == ["amd64", "keep.txt", "b", "base", "bar=baz", "/data"]


def test_layers_are_converted_once_per_diff_id(registry, other_host, ctr_image):
    with registry.client() as cl:
        first = pull(other_host.store, f"{registry.addr}/{REPO}:multi", client=cl)
        mark = registry.mark()
        again = pull(other_host.store, f"{registry.addr}/{REPO}:multi", ref="ctr:again", client=cl)
        # a Docker v2 manifest whose top layer is gzip, not zstd: other blob, same diff_id -> no fetch
        docker = pull(other_host.store, f"{registry.addr}/{REPO}:docker-v2", client=cl)
    layer_gets = [p for m, p, _ in registry.requests(mark) if m == "GET" and "/blobs/" in p]
    assert again.fetched == [] and docker.fetched == []
    assert len(layer_gets) == 2  # one config blob per pull, no layer
    assert again.image.layers == first.image.layers == docker.image.layers
