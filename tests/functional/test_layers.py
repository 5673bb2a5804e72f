"""Layer store: content addressing, dedup, overlay order, whiteouts, tar and image-archive import."""
from __future__ import annotations

import io
import json
import os
import subprocess
import tarfile
import time

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


def _kernel_has_file_backed_erofs() -> bool:
    """File-backed EROFS mounts arrived in Linux 6.12 (CONFIG_EROFS_FS_BACKED_BY_FILE); older kernels,
    Debian 12's 6.1 among them, only mount EROFS from a block device, i.e. a loop device."""
    release = os.uname().release
    major, minor = (int(x) for x in release.split(".")[:2])
    if (major, minor) < (6, 12):
        return False
    config = f"/boot/config-{release}"
    if os.path.exists(config):
        return "CONFIG_EROFS_FS_BACKED_BY_FILE=y" in open(config).read()
    return True


# "auto" is what every host does (file-backed where the kernel has it, else loop); "loop" forces the
# pre-6.12 path (SHOAL_EROFS_MOUNT=loop) so it runs on every host, this one included
@pytest.mark.parametrize("mode", ["auto", "loop"])
def test_layer_is_mounted_once_and_shared(host, base_image, root, make_layer, monkeypatch, mode):
    from shoal.layers import erofs

    monkeypatch.setenv("SHOAL_EROFS_MOUNT", mode)
    expected = "file-backed" if mode == "auto" and _kernel_has_file_backed_erofs() else "loop"
    d = make_layer({"mode.txt": f"mounted {mode}"})  # a fresh layer: mounted by this test, by `mode`
    mnt = str(host.store.mount_path(d))
    with Sandbox.create(base_image, layers=[d], root=root) as s1, \
            Sandbox.create(base_image, layers=[d], root=root) as s2:
        assert _mountpoints().count(mnt) == 1
        assert s1.files.read("/mode.txt") == s2.files.read("/mode.txt") == f"mounted {mode}"
        assert s1.commands.run("echo ok").stdout == "ok\n" and s2.commands.run("echo ok").stdout == "ok\n"
    line = next(l for l in _mountinfo() if l.split()[4] == mnt)
    assert " erofs " in line
    assert erofs.mount_method(host.store.mount_path(d)) == expected
    image = host.store.image_path(d)
    loops = erofs.loop_devices_for(image)
    if expected == "loop":
        assert "/dev/loop" in line and len(loops) == 1
        assert _losetup_files(loops) == [str(image)]
    else:  # file-backed (new mount API): the source is the image file, no loop device
        assert "/dev/loop" not in line and loops == []
    # gc unmounts the unused layer; its loop device goes with the mount (autoclear): no leak
    host.remove_layer(d)
    assert not os.path.ismount(mnt)
    _wait_no_loop(image)


def _mountinfo() -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return f.readlines()


def _mountpoints() -> list[str]:
    return [l.split()[4] for l in _mountinfo()]


def _losetup_files(devices: list[str]) -> list[str]:
    """The backing files `losetup` reports for `devices` (util-linux's view, not just sysfs)."""
    out = subprocess.run(["losetup", "--list", "--noheadings", "--output", "BACK-FILE", *devices],
                         capture_output=True, text=True, check=True).stdout
    return [l.strip() for l in out.splitlines() if l.strip()]


def _wait_no_loop(image) -> None:
    """The kernel releases an autoclear loop device when its last user goes; that is asynchronous."""
    from shoal.layers import erofs

    deadline = time.monotonic() + 5
    while erofs.loop_devices_for(image) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert erofs.loop_devices_for(image) == []
    out = subprocess.run(["losetup", "--associated", str(image)], check=True, capture_output=True,
                         text=True).stdout
    assert out.strip() == "", f"loop device left attached to {image}: {out}"


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


def test_loop_mount_fallback_serves_the_same_tree(host, make_layer, tmp_path, monkeypatch):
    """Kernels before 6.12 cannot mount EROFS from a file; the loop-device path must serve the same tree,
    and unmounting must detach the loop device."""
    from shoal.layers import erofs

    if not os.path.exists("/dev/loop-control"):
        pytest.fail("no /dev/loop-control: the loop path (every pre-6.12 kernel's) cannot be tested")
    digest = make_layer({"a/b.txt": "loop-ok", "c/d": "x"})
    image = host.store.image_path(digest)
    targets = {m: tmp_path / m for m in ("loop", "auto")}
    for mode, target in targets.items():
        target.mkdir()
        monkeypatch.setenv("SHOAL_EROFS_MOUNT", mode)
        used = erofs.mount_image(image, target)
        assert used == erofs.mount_method(target)
        assert used == ("loop" if mode == "loop" or not _kernel_has_file_backed_erofs() else "file-backed")
    try:
        trees = {m: sorted((str(p.relative_to(t)), p.read_text() if p.is_file() else None)
                           for p in t.rglob("*")) for m, t in targets.items()}
        assert trees["loop"] == trees["auto"] and ("a/b.txt", "loop-ok") in trees["loop"]
        assert erofs.loop_devices_for(image)
    finally:
        for target in targets.values():
            erofs.unmount(target)
    _wait_no_loop(image)


def test_forced_mount_mode_is_checked(host, make_layer, tmp_path, monkeypatch):
    from shoal.core.errors import InvalidArgument
    from shoal.layers import erofs

    digest = make_layer({"x": "1"})
    (tmp_path / "m").mkdir()
    monkeypatch.setenv("SHOAL_EROFS_MOUNT", "blockdev")
    with pytest.raises(InvalidArgument, match="SHOAL_EROFS_MOUNT"):
        erofs.mount_image(host.store.image_path(digest), tmp_path / "m")
    monkeypatch.setenv("SHOAL_EROFS_MOUNT", "file-backed")
    if _kernel_has_file_backed_erofs():
        assert erofs.mount_image(host.store.image_path(digest), tmp_path / "m") == "file-backed"
        erofs.unmount(tmp_path / "m")
    else:  # no silent fallback when file-backed is demanded
        with pytest.raises(OSError, match="file-backed EROFS mount"):
            erofs.mount_image(host.store.image_path(digest), tmp_path / "m")
