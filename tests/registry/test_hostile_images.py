"""A registry (or a tenant who pushes to it) is hostile: container images whose layer tars attack the
host that pulls them, pushed to the session's real registry and pulled through `shoal pull`.

Each test asserts the protection: nothing outside the extraction directory changes, the host's disk
is not filled, and the pull fails with a typed error that leaves no image behind."""
from __future__ import annotations

import io
import json
import os
import stat
import tarfile

import pytest

from shoal.core.errors import CorruptArchive, QuotaExceeded
from shoal.layers import archive
from shoal.registry import pull
from shoal.registry.client import sha256_digest
from shoal.registry.media import OCI_CONFIG, OCI_MANIFEST

from .oci_build import _config, _desc, _gzip

REPO = "shoal/hostile"
GZ = "application/vnd.oci.image.layer.v1.tar+gzip"


def _tar(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _member(name: str, kind: bytes = tarfile.REGTYPE, **attrs) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    for k, v in attrs.items():
        setattr(info, k, v)
    return info


def _push(registry, tag: str, raw_tar: bytes, blob: bytes | None = None) -> str:
    """An ordinary one-layer OCI image of `raw_tar` (gzipped unless `blob` is given) at REPO:tag."""
    blob = _gzip(raw_tar) if blob is None else blob
    config = _config("amd64", [sha256_digest(raw_tar)])
    manifest = json.dumps({"schemaVersion": 2, "mediaType": OCI_MANIFEST, "config": _desc(OCI_CONFIG, config),
                           "layers": [_desc(GZ, blob)]}).encode()
    with registry.client() as cl:
        for b in (blob, config):
            cl.upload_blob(REPO, sha256_digest(b), data=b)
        cl.put_manifest(REPO, tag, manifest, OCI_MANIFEST)
    return f"{registry.addr}/{REPO}:{tag}"


def _pull(registry, host, src: str):
    with registry.client() as cl:
        return pull(host.store, src, platform="linux/amd64", client=cl)


def test_a_directory_member_over_a_symlink_changes_nothing_outside(registry, fresh_host, tmp_path):
    """`x -> HOSTDIR`, then a directory member `x` (mode 0777, uid 4242): tarfile found "a directory
    already there" through the link and chmod/chown/utime'd the host directory (before the fix: any
    host directory, `/` or `/etc` included, became world-writable and owned by the image's uid)."""
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o755)
    before = os.stat(victim)
    src = _push(registry, "symdir", _tar([
        (_member("x", tarfile.SYMTYPE, linkname=str(victim)), None),
        (_member("x", tarfile.DIRTYPE, mode=0o777, uid=4242, gid=4242, mtime=12345), None),
        (_member("x/inside", mode=0o644), b"in the layer\n"),
    ]))
    res = _pull(registry, fresh_host, src)
    after = os.stat(victim)
    assert (stat.S_IMODE(after.st_mode), after.st_uid, after.st_gid, after.st_mtime) == \
        (stat.S_IMODE(before.st_mode), before.st_uid, before.st_gid, before.st_mtime)
    assert os.listdir(victim) == []
    # the layer holds a real directory x with the file (the later member wins, as in Docker)
    mnt = fresh_host.store.ensure_mounted(res.image.layers)[0]
    assert (mnt / "x").is_dir() and not (mnt / "x").is_symlink() and (mnt / "x/inside").read_text() == "in the layer\n"


@pytest.mark.parametrize("name", [".wh...", "d/.wh..", "d/.wh."])
def test_a_whiteout_of_dot_dot_is_refused(registry, fresh_host, name):
    """`.wh...` whites out `..`: the extraction removed the directory above the layer's (shutil.rmtree
    of `<scratch>/root/..`) and then failed with a bare OSError."""
    tag = "wh-" + name.replace("/", "_").replace(".", "d")
    src = _push(registry, tag, _tar([(_member("d", tarfile.DIRTYPE, mode=0o755), None),
                                     (_member("d/keep", mode=0o644), b"keep\n"), (_member(name), b"")]))
    tmp_before = set(os.listdir(fresh_host.store.settings.tmp_dir))
    with pytest.raises(CorruptArchive, match="whites out"):
        _pull(registry, fresh_host, src)
    assert fresh_host.store.list_images() == []
    assert set(os.listdir(fresh_host.store.settings.tmp_dir)) <= tmp_before  # scratch cleaned, nothing else


def test_a_gzip_bomb_stops_at_the_layer_bound(registry, fresh_host, monkeypatch):
    """256 MiB of zeros gzip to ~250 KiB (a 1000:1 bomb); with the bound at 64 MiB the pull stops there
    with QuotaExceeded, having written at most the bound, and stores nothing."""
    monkeypatch.setattr(archive, "MAX_LAYER_BYTES", 64 << 20)
    zeros = _member("zeros", mode=0o644, size=256 << 20)
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tf:
        tf.addfile(zeros, io.BytesIO(bytes(256 << 20)))
    src = _push(registry, "bomb", raw.getvalue())
    with pytest.raises(QuotaExceeded, match="SHOAL_MAX_LAYER_BYTES"):
        _pull(registry, fresh_host, src)
    assert fresh_host.store.list_images() == []
    assert not any(p.name.startswith("build-") for p in fresh_host.store.settings.tmp_dir.iterdir())


def test_a_member_declaring_a_huge_size_is_refused_before_a_byte_is_written(registry, fresh_host, monkeypatch):
    """A sparse member is a few bytes in the tar and any length on disk (mkfs.erofs and the tree digest
    then read every byte of it): a member's declared size is what counts against the bound."""
    monkeypatch.setattr(archive, "MAX_LAYER_BYTES", 64 << 20)
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.GNU_FORMAT) as tf:
        info = _member("hole", mode=0o644, size=1 << 40)  # declared 1 TiB, no data follows: the size alone is refused
        tf.fileobj.write(info.tobuf(tarfile.GNU_FORMAT))
    src = _push(registry, "sparse", raw.getvalue())
    with pytest.raises(QuotaExceeded):
        _pull(registry, fresh_host, src)
    assert fresh_host.store.list_images() == []


def test_millions_of_tiny_entries_stop_at_the_entry_bound(registry, fresh_host, monkeypatch):
    monkeypatch.setattr(archive, "MAX_LAYER_ENTRIES", 1000)
    src = _push(registry, "many", _tar([(_member(f"f{i}", mode=0o644), b"") for i in range(1500)]))
    with pytest.raises(QuotaExceeded, match="entries"):
        _pull(registry, fresh_host, src)
    assert fresh_host.store.list_images() == []


@pytest.mark.parametrize("case", ["longname", "hardlink-abs", "file-under-file", "dotdot", "hardlink-out"])
def test_malformed_members_are_a_typed_corrupt_archive(registry, fresh_host, case):
    members = {
        "longname": [(_member("a" * 300, mode=0o644), b"x")],
        "hardlink-abs": [(_member("h", tarfile.LNKTYPE, linkname="/etc/passwd"), None)],
        "file-under-file": [(_member("a", mode=0o644), b"1"), (_member("a/b", mode=0o644), b"2")],
        "dotdot": [(_member("../../escaped", mode=0o644), b"x")],
        "hardlink-out": [(_member("h", tarfile.LNKTYPE, linkname="../../../etc/passwd"), None)],
    }[case]
    src = _push(registry, f"bad-{case}", _tar(members))
    with pytest.raises(CorruptArchive):
        _pull(registry, fresh_host, src)
    assert fresh_host.store.list_images() == []


# ---------------------------------------------------------------- Shoal-native EROFS layers

def _push_shoal(registry, tag: str, blob: bytes, tmp_path, chunk_size: int = 128 << 10) -> str:
    """A Shoal image of one layer whose "EROFS" blob is `blob`, with a chunk index that truly
    describes it (so only the blob's content is hostile, not its bookkeeping)."""
    from shoal.lazy.chunks import CHUNK_INDEX_MEDIA_TYPE, LAYER_MEDIA_TYPE, build_index
    from shoal.registry.media import ANN_CHUNKS, ANN_LAYER, SHOAL_CONFIG_MEDIA_TYPE

    layer = "sha256:" + "ab" * 32
    (tmp_path / "blob").write_bytes(blob)
    index = build_index(layer, tmp_path / "blob", chunk_size=chunk_size).model_dump_json().encode()
    config = json.dumps({"shoal": 1, "os": "linux", "architecture": "amd64", "image": tag,
                         "layers": [layer], "config": {}}).encode()
    manifest = json.dumps({"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                           "config": _desc(SHOAL_CONFIG_MEDIA_TYPE, config),
                           "layers": [_desc(LAYER_MEDIA_TYPE, blob, annotations={
                               ANN_LAYER: layer, ANN_CHUNKS: sha256_digest(index)}),
                               _desc(CHUNK_INDEX_MEDIA_TYPE, index, annotations={ANN_LAYER: layer})]}).encode()
    with registry.client() as cl:
        for b in (blob, index, config):
            cl.upload_blob(REPO, sha256_digest(b), data=b)
        cl.put_manifest(REPO, tag, manifest, OCI_MANIFEST)
    return f"{registry.addr}/{REPO}:{tag}"


def test_a_foreign_blob_presented_as_an_erofs_layer_is_checked_before_the_kernel_parses_it(
        registry, fresh_host, tmp_path):
    """Media-type confusion: a tar blob (any attacker bytes) under the EROFS layer media type, with a
    matching digest and chunk index. The pull mounts a layer to re-derive its tree digest, so the
    host kernel's EROFS parser would read the attacker's image: `fsck.erofs` checks it in userspace
    first and the pull fails there, before any mount."""
    from shoal.core.errors import BadDigest

    blob = _gzip(_tar([(_member("etc/passwd", mode=0o644), b"root::0:0::/:/bin/sh\n")]))
    src = _push_shoal(registry, "foreign", blob + bytes(8192), tmp_path)
    with pytest.raises(BadDigest, match="fsck.erofs"):
        _pull(registry, fresh_host, src)
    assert fresh_host.store.list_images() == []


def test_a_chunk_index_of_one_huge_chunk_is_refused(registry, fresh_host, tmp_path):
    """An index whose chunk is the whole layer makes the lazy daemon read, hold and hash the whole
    blob on each fault: pulled indexes must use chunks the daemon is built for (<= 16 MiB)."""
    from shoal.core.errors import CorruptChunk

    blob = os.urandom(64 << 10)
    src = _push_shoal(registry, "onechunk", blob, tmp_path, chunk_size=1 << 30)
    with pytest.raises(CorruptChunk, match="chunks of"):
        with registry.client() as cl:
            pull(fresh_host.store, src, client=cl, lazy=True)
    assert fresh_host.store.list_images() == []


def test_a_huge_manifest_is_not_read_past_the_manifest_bound(registry, fresh_host, monkeypatch):
    """A registry answering a "manifest" of any size: the client reads no more than MAX_MANIFEST_BYTES
    (4 MiB, distribution's own bound; lowered here so the registry needs to hold only 64 KiB)."""
    from shoal.core.errors import RegistryError
    from shoal.registry import client as client_mod

    monkeypatch.setattr(client_mod, "MAX_MANIFEST_BYTES", 16 << 10)
    config = _config("amd64", [])
    manifest = json.dumps({"schemaVersion": 2, "mediaType": OCI_MANIFEST, "config": _desc(OCI_CONFIG, config),
                           "layers": [], "annotations": {"pad": "x" * (64 << 10)}}).encode()
    with registry.client() as cl:
        cl.upload_blob(REPO, sha256_digest(config), data=config)
        cl.put_manifest(REPO, "huge", manifest, OCI_MANIFEST)
    with pytest.raises(RegistryError, match="larger than"):
        _pull(registry, fresh_host, f"{registry.addr}/{REPO}:huge")


def test_a_corrupt_zstd_layer_is_a_typed_error(registry, fresh_host):
    """A zstd frame that breaks mid-stream raised zstandard's bare ZstdError out of the pull."""
    import zstandard

    from shoal.core.errors import CorruptChunk

    raw = _tar([(_member("f", mode=0o644), os.urandom(256 << 10))])
    blob = bytearray(zstandard.ZstdCompressor().compress(raw))
    blob[len(blob) // 2] ^= 0xFF
    config = _config("amd64", [sha256_digest(raw)])
    manifest = json.dumps({"schemaVersion": 2, "mediaType": OCI_MANIFEST, "config": _desc(OCI_CONFIG, config),
                           "layers": [_desc("application/vnd.oci.image.layer.v1.tar+zstd", bytes(blob))]}).encode()
    with registry.client() as cl:
        for b in (bytes(blob), config):
            cl.upload_blob(REPO, sha256_digest(b), data=b)
        cl.put_manifest(REPO, "badzstd", manifest, OCI_MANIFEST)
    with pytest.raises((CorruptChunk, CorruptArchive)):
        _pull(registry, fresh_host, f"{registry.addr}/{REPO}:badzstd")
    assert fresh_host.store.list_images() == []


def test_a_shoal_layer_larger_than_the_bound_is_not_downloaded(registry, fresh_host, tmp_path, monkeypatch):
    """A Shoal layer's size is the registry's word: past SHOAL_MAX_LAYER_BYTES (or the free disk) the
    pull stops before fetching a byte of it."""
    monkeypatch.setattr(archive, "MAX_LAYER_BYTES", 256 << 10)
    src = _push_shoal(registry, "toobig", os.urandom(1 << 20), tmp_path)
    mark = registry.mark()
    with pytest.raises(QuotaExceeded, match="SHOAL_MAX_LAYER_BYTES"):
        _pull(registry, fresh_host, src)
    assert registry.blob_bytes(mark) < (1 << 20)  # the index and config only, never the layer blob
    assert fresh_host.store.list_images() == []


def test_a_container_layer_without_a_size_is_refused_before_download(registry, fresh_host):
    """The descriptor's size is what bounds a layer download: a manifest that leaves it out would have
    the host stream whatever the registry sends."""
    from shoal.core.errors import RegistryError

    raw = _tar([(_member("f", mode=0o644), b"x")])
    blob, config = _gzip(raw), _config("amd64", [sha256_digest(raw)])
    layer = _desc(GZ, blob)
    del layer["size"]
    manifest = json.dumps({"schemaVersion": 2, "mediaType": OCI_MANIFEST, "config": _desc(OCI_CONFIG, config),
                           "layers": [layer]}).encode()
    with registry.client() as cl:
        for b in (blob, config):
            cl.upload_blob(REPO, sha256_digest(b), data=b)
        cl.put_manifest(REPO, "nosize", manifest, OCI_MANIFEST)
    with pytest.raises(RegistryError, match="no valid size"):
        _pull(registry, fresh_host, f"{registry.addr}/{REPO}:nosize")
