"""Layer store: content addressing, dedup, overlay order, whiteouts, tar and image-archive import."""
from __future__ import annotations

import io
import json
import os
import tarfile

import pytest

from shoal import LayerInUse, Sandbox


def _tree(tmp_path, name, files):
    d = tmp_path / name
    for rel, content in files.items():
        p = d / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(content)
    return d


def test_same_content_is_stored_once(host, tmp_path):
    a = _tree(tmp_path, "a", {"x/y.txt": "hello", "z": "zz"})
    b = _tree(tmp_path, "b", {"x/y.txt": "hello", "z": "zz"})
    os.utime(b / "z", (1, 1))  # timestamps are not content
    before = len(list(host.settings.layers_dir.iterdir()))
    la = host.store.build_from_dir(a)
    lb = host.store.build_from_dir(b)
    assert la.digest == lb.digest
    assert len(list(host.settings.layers_dir.iterdir())) == before + 1
    (b / "z").write_text("changed")
    assert host.store.build_from_dir(b).digest != la.digest


def test_layer_is_mounted_once_and_shared(host, base_image, root):
    digest = host.store.get_image(base_image).layers[0]
    with Sandbox.create(base_image, root=root) as s1, Sandbox.create(base_image, root=root) as s2:
        mnt = str(host.store.mount_path(digest))
        mounts = [l.split()[4] for l in open("/proc/self/mountinfo")]
        assert mounts.count(mnt) == 1
        assert s1.commands.run("echo ok").stdout == "ok\n" and s2.commands.run("echo ok").stdout == "ok\n"
    # file-backed (new mount API): the source is the image file, no loop device
    line = next(l for l in open("/proc/self/mountinfo") if l.split()[4] == mnt)
    assert " erofs " in line and "/dev/loop" not in line


def test_top_layer_wins_and_whiteouts_hide(host, base_image, root, make_layer):
    lower = make_layer({"etc/app.conf": "lower", "etc/gone.txt": "bye", "data/old/a": "1", "data/old/b": "2"})
    upper = make_layer({"etc/app.conf": "upper", "etc/gone.txt": None, "data/old/c": "3"}, opaque=["data/old"])
    with Sandbox.create(base_image, layers=[lower, upper], root=root) as sb:
        assert sb.files.read("/etc/app.conf") == "upper"
        assert not sb.files.exists("/etc/gone.txt")
        assert [e.name for e in sb.files.list("/data/old")] == ["c"]  # opaque dir hides a and b
    with Sandbox.create(base_image, layers=[upper, lower], root=root) as sb:
        assert sb.files.read("/etc/app.conf") == "lower"  # order matters: top wins


def test_tar_layer_translates_oci_whiteouts(host, base_image, root, make_layer):
    lower = make_layer({"srv/keep": "k", "srv/drop": "d", "opq/x": "x"})
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in (("srv/.wh.drop", b""), ("opq/.wh..wh..opq", b""), ("opq/y", b"y"), ("srv/new", b"n")):
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    buf.seek(0)
    layer = host.store.build_from_tar(buf)
    with Sandbox.create(base_image, layers=[lower, layer.digest], root=root) as sb:
        assert sorted(e.name for e in sb.files.list("/srv")) == ["keep", "new"]
        assert [e.name for e in sb.files.list("/opq")] == ["y"]


def _layer_tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in files.items():
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def _add(tf, name, data: bytes):
    ti = tarfile.TarInfo(name)
    ti.size = len(data)
    tf.addfile(ti, io.BytesIO(data))


def test_docker_save_archive_becomes_layers_and_image(host, base_image, root, tmp_path):
    l1 = _layer_tar({"app/main.txt": b"v1", "app/old.txt": b"old"})
    l2 = _layer_tar({"app/main.txt": b"v2", "app/.wh.old.txt": b""})
    path = tmp_path / "img.tar"
    with tarfile.open(path, "w") as tf:
        _add(tf, "aaa/layer.tar", l1)
        _add(tf, "bbb/layer.tar", l2)
        _add(tf, "cfg.json", json.dumps({"config": {"Env": ["A=1"]}}).encode())
        _add(tf, "manifest.json", json.dumps([{"Config": "cfg.json", "RepoTags": ["myapp:v2"],
                                                "Layers": ["aaa/layer.tar", "bbb/layer.tar"]}]).encode())
    img = host.store.import_archive(path)
    assert img.ref == "myapp:v2" and len(img.layers) == 2
    with Sandbox.create(base_image, layers=list(img.layers), root=root) as sb:
        assert sb.files.read("/app/main.txt") == "v2"
        assert not sb.files.exists("/app/old.txt")


def test_oci_layout_archive(host, tmp_path):
    import gzip
    import hashlib

    blobs = {}

    def blob(data: bytes) -> str:
        d = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[d] = data
        return d

    layer = gzip.compress(_layer_tar({"oci/file": b"from-oci"}))
    ld = blob(layer)
    cd = blob(json.dumps({"architecture": "amd64"}).encode())
    md = blob(json.dumps({"schemaVersion": 2, "config": {"digest": cd}, "layers": [
        {"digest": ld, "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip"}]}).encode())
    path = tmp_path / "oci.tar"
    with tarfile.open(path, "w") as tf:
        _add(tf, "oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
        _add(tf, "index.json", json.dumps({"manifests": [{"digest": md, "annotations": {
            "org.opencontainers.image.ref.name": "ocitest:1"}}]}).encode())
        for d, data in blobs.items():
            _add(tf, "blobs/" + d.replace(":", "/"), data)
    img = host.store.import_archive(path)
    assert img.ref == "ocitest:1"
    mnt = host.store.ensure_mounted(img.layers)[0]
    assert (mnt / "oci/file").read_text() == "from-oci"


def test_image_spec_file(host, tmp_path, make_layer):
    top = make_layer({"tk/tool": "t"}, name="toolkit-a")
    spec = tmp_path / "img.toml"
    spec.write_text(f'[image]\nname = "composed"\ntag = "v1"\nlayers = ["busybox", "{top}"]\n')
    img = host.store.create_image_from_spec(spec)
    assert img.ref == "composed:v1"
    assert img.layers == (host.store.resolve("busybox"), top)


def test_rm_refuses_layers_in_use_and_gc_collects(host, base_image, root, make_layer):
    d = make_layer({"only/here": "1"})
    host.store.create_image("holder:1", [d])
    with pytest.raises(LayerInUse, match="holder:1"):
        host.remove_layer(d)
    host.store.remove_image("holder:1")
    with Sandbox.create(base_image, layers=[d], root=root) as sb:
        with pytest.raises(LayerInUse, match="live sandbox"):
            host.remove_layer(d)
        assert d not in host.gc()["removed"]
        sb.kill()
    assert d in host.gc()["removed"]
    assert not host.store.image_path(d).exists()
    assert not os.path.ismount(host.store.mount_path(d))


def test_loop_mount_fallback_serves_the_same_tree(host, make_layer, tmp_path):
    """Kernels before 6.12 cannot mount EROFS from a file; the loop-device path must work too."""
    import shutil as _sh

    from shoal.layers import erofs

    if not os.path.exists("/dev/loop-control"):
        pytest.skip("no loop devices on this host")
    digest = make_layer({"a/b.txt": "loop-ok"})
    target = tmp_path / "loopmnt"
    target.mkdir()
    erofs.mount_loop(host.store.image_path(digest), target)
    try:
        assert (target / "a/b.txt").read_text() == "loop-ok"
        line = next(l for l in open("/proc/self/mountinfo") if l.split()[4] == str(target))
        assert "/dev/loop" in line
    finally:
        erofs.unmount(target)
    assert _sh.which("mkfs.erofs")
