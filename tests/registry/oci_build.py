"""An ordinary OCI image built byte by byte for the tests (tar+gzip and tar+zstd layers, a whiteout
and an opaque directory, a config with diff_ids, an arm64 + amd64 index, and a Docker v2 manifest
of the same layers), pushed with the client's raw blob and manifest calls."""
from __future__ import annotations

import gzip
import io
import json
import tarfile
from pathlib import Path

import zstandard

from shoal.layers.busybox import make_busybox_tree
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


def push_container_image(registry, scratch: Path) -> dict:
    """Push the test image to `registry`; returns what the tests check against."""
    bb = make_busybox_tree(scratch)
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
