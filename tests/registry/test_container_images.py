"""Ordinary container images from a registry: an OCI image built here byte by byte (tar+gzip and
tar+zstd layers, a whiteout and an opaque directory, a config with diff_ids, an arm64 + amd64
index), pushed with the client's raw blob and manifest calls, then pulled, converted and run."""
from __future__ import annotations

import gzip
import io
import json
import tarfile
from pathlib import Path

import pytest
import zstandard

from shoal import Sandbox
from shoal.layers.busybox import make_busybox_tree
from shoal.registry import pull
from shoal.registry.client import sha256_digest
from shoal.registry.media import DOCKER_CONFIG, DOCKER_MANIFEST, OCI_CONFIG, OCI_INDEX, OCI_MANIFEST

REPO = "shoal/ctr"


def _tar(entries: list[tuple[str, bytes | None]], base: Path | None = None) -> bytes:
    """A layer tar: the tree under `base` (if any), then (name, bytes) files; an empty-bytes name
    starting with .wh. is a whiteout as Docker writes it."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        if base is not None:
            for p in sorted(base.rglob("*")):
                tf.add(p, arcname=str(p.relative_to(base)), recursive=False)
        for name, data in entries:
            if data is None:
                info = tarfile.TarInfo(name)
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tf.addfile(info)
                continue
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _gzip(raw: bytes) -> bytes:
    return gzip.compress(raw, mtime=0)


def _zstd(raw: bytes) -> bytes:
    return zstandard.ZstdCompressor().compress(raw)


def _desc(media: str, blob: bytes, **extra) -> dict:
    return {"mediaType": media, "digest": sha256_digest(blob), "size": len(blob), **extra}


def _config(arch: str, diff_ids: list[str]) -> bytes:
    return json.dumps({"architecture": arch, "os": "linux",
                       "config": {"Env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin", "FOO=bar=baz"], "WorkingDir": "/data",
                                  "Cmd": ["/bin/sh"]},
                       "rootfs": {"type": "layers", "diff_ids": diff_ids}}).encode()


@pytest.fixture(scope="session")
def ctr_image(registry, tmp_path_factory):
    """Push the test image; returns what the tests check against."""
    bb = make_busybox_tree(tmp_path_factory.mktemp("ctr-bb"))
    base_tar = _tar([("data", None), ("data/old.txt", b"old\n"), ("data/keep.txt", b"keep\n"), ("keep", None),
                     ("keep/a", b"a\n"), ("etc/marker", b"base\n")], base=bb)
    top = {arch: _tar([("data/.wh.old.txt", b""), ("keep/.wh..wh..opq", b""), ("keep/b", b"b\n"),
                       ("arch", arch.encode() + b"\n")]) for arch in ("amd64", "arm64")}
    base_gz, top_zst, top_arm_gz, top_gz = _gzip(base_tar), _zstd(top["amd64"]), _gzip(top["arm64"]), \
        _gzip(top["amd64"])
    diff = {k: sha256_digest(v) for k, v in (("base", base_tar), ("amd64", top["amd64"]), ("arm64", top["arm64"]))}
    blobs = {"amd64": _config("amd64", [diff["base"], diff["amd64"]]),
             "arm64": _config("arm64", [diff["base"], diff["arm64"]])}
    manifests = {}
    for arch, top_blob, top_type in (("amd64", top_zst, "application/vnd.oci.image.layer.v1.tar+zstd"),
                                     ("arm64", top_arm_gz, "application/vnd.oci.image.layer.v1.tar+gzip")):
        manifests[arch] = json.dumps({
            "schemaVersion": 2, "mediaType": OCI_MANIFEST, "config": _desc(OCI_CONFIG, blobs[arch]),
            "layers": [_desc("application/vnd.oci.image.layer.v1.tar+gzip", base_gz), _desc(top_type, top_blob)],
        }).encode()
    index = json.dumps({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [
        _desc(OCI_MANIFEST, manifests["arm64"], platform={"architecture": "arm64", "os": "linux", "variant": "v8"}),
        _desc(OCI_MANIFEST, manifests["amd64"], platform={"architecture": "amd64", "os": "linux"}),
    ]}).encode()
    docker_cfg = _config("amd64", [diff["base"], diff["amd64"]]) + b" "  # another config blob, same layers
    docker = json.dumps({"schemaVersion": 2, "mediaType": DOCKER_MANIFEST, "config": _desc(DOCKER_CONFIG, docker_cfg),
                         "layers": [_desc("application/vnd.docker.image.rootfs.diff.tar.gzip", base_gz),
                                    _desc("application/vnd.docker.image.rootfs.diff.tar.gzip", top_gz)]}).encode()
    with registry.client() as cl:
        for blob in (base_gz, top_zst, top_arm_gz, top_gz, blobs["amd64"], blobs["arm64"], docker_cfg):
            cl.upload_blob(REPO, sha256_digest(blob), data=blob)
        for arch in ("amd64", "arm64"):
            cl.put_manifest(REPO, sha256_digest(manifests[arch]), manifests[arch], OCI_MANIFEST)
        cl.put_manifest(REPO, "multi", index, OCI_INDEX)
        cl.put_manifest(REPO, "docker-v2", docker, DOCKER_MANIFEST)
    return {"base_tar": base_tar, "top_tar": top["amd64"], "arm_manifest": sha256_digest(manifests["arm64"]),
            "arm_blob": sha256_digest(top_arm_gz), "zst_blob": sha256_digest(top_zst)}


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
