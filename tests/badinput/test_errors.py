"""Bad input gets a typed error that names what is wrong, and nothing is lost or half-created."""
from __future__ import annotations

import io
import os
import tarfile

import pytest

from shoal import (BadDigest, CorruptArchive, ImageNotFound, InvalidArgument, LayerNotFound, Sandbox,
                   SandboxNotFound)


def test_unknown_image(root, host):
    with pytest.raises(ImageNotFound, match="nope:latest"):
        Sandbox.create("nope", root=root)


@pytest.mark.parametrize("ref", ["sha256:zzzz", "sha256:" + "0" * 64, "abc", "deadbeefdead"])
def test_bad_or_unknown_digest(root, base_image, ref):
    with pytest.raises((BadDigest, LayerNotFound)) as e:
        Sandbox.create(base_image, layers=[ref], root=root)
    assert ref.split(":")[-1][:4] in str(e.value) or "not found" in str(e.value)


def test_corrupt_archives(host, tmp_path):
    junk = tmp_path / "junk.tar"
    junk.write_bytes(os.urandom(4096))
    with pytest.raises(CorruptArchive):
        host.store.build_from_tar(path=junk)
    with pytest.raises(CorruptArchive):
        host.store.import_archive(junk)
    truncated = tmp_path / "trunc.tar.gz"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        ti = tarfile.TarInfo("big")
        data = os.urandom(100_000)
        ti.size = len(data)
        tf.addfile(ti, io.BytesIO(data))
    truncated.write_bytes(buf.getvalue()[:5000])
    with pytest.raises(CorruptArchive):
        host.store.build_from_tar(path=truncated)
    no_manifest = tmp_path / "nomani.tar"
    with tarfile.open(no_manifest, "w") as tf:
        ti = tarfile.TarInfo("hello.txt")
        tf.addfile(ti, io.BytesIO(b""))
    with pytest.raises(CorruptArchive, match="manifest.json"):
        host.store.import_archive(no_manifest)
    assert list(host.settings.tmp_dir.iterdir()) == []  # no half-built leftovers


def test_tar_escapes_are_refused(host, tmp_path):
    for name, kind in (("../evil", tarfile.REGTYPE), ("a/../../evil", tarfile.REGTYPE)):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tf:
            ti = tarfile.TarInfo(name)
            ti.type = kind
            tf.addfile(ti, io.BytesIO(b""))
        buf.seek(0)
        with pytest.raises(CorruptArchive, match="\\.\\."):
            host.store.build_from_tar(buf)
    # a member written through a symlink the archive itself planted
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        link = tarfile.TarInfo("etc")
        link.type = tarfile.SYMTYPE
        link.linkname = str(tmp_path)
        tf.addfile(link)
        f = tarfile.TarInfo("etc/pwned")
        tf.addfile(f, io.BytesIO(b""))
    buf.seek(0)
    with pytest.raises(CorruptArchive, match="symlink"):
        host.store.build_from_tar(buf)
    assert not (tmp_path / "pwned").exists()


def test_unknown_sandbox(root, host):
    with pytest.raises(SandboxNotFound, match="sb-000000000000"):
        Sandbox.connect("sb-000000000000", root=root)
    with pytest.raises(SandboxNotFound):
        host.backend("container").kill("sb-000000000000")
    with pytest.raises(SandboxNotFound):
        host.backend("container").info("../../etc")


@pytest.mark.parametrize("kw", [{"memory_mb": -1}, {"cpu": 0}, {"disk_mb": -5}, {"pids": 0}, {"ttl": -1},
                                {"idle_ttl": 0}])
def test_negative_limits(root, base_image, host, kw):
    before = set(os.listdir(host.settings.sandboxes_dir))
    with pytest.raises(InvalidArgument) as e:
        Sandbox.create(base_image, root=root, **kw)
    assert next(iter(kw)) in str(e.value)
    assert set(os.listdir(host.settings.sandboxes_dir)) == before


def test_bad_backend(root, base_image):
    with pytest.raises(InvalidArgument, match="unknown backend 'lambda'.*container"):
        Sandbox.create(base_image, root=root, backend="lambda")
    with pytest.raises(InvalidArgument, match="upper"):
        Sandbox.create(base_image, root=root, upper="nfs")  # type: ignore[arg-type]  # the bad value is the test
    with pytest.raises(SandboxNotFound, match="zz-host-000000000000"):
        Sandbox.connect("zz-host-000000000000", root=root)  # no backend owns this id prefix


def test_bad_commands_and_paths(sandbox):
    with pytest.raises(InvalidArgument):
        sandbox.commands.run("   ")
    with pytest.raises(InvalidArgument, match="NUL"):
        sandbox.commands.run(["echo", "a\0b"])
    with pytest.raises(InvalidArgument, match="timeout"):
        sandbox.commands.run("true", timeout=-1)
    with pytest.raises(InvalidArgument):
        sandbox.files.read("bad\0path")
    with pytest.raises(InvalidArgument, match="too large"):
        sandbox.commands.run(["echo", "x" * 300_000])
    assert sandbox.commands.run("echo fine").stdout == "fine\n"


def test_bad_image_spec(host, tmp_path):
    p = tmp_path / "s.toml"
    p.write_text("[image]\nname = 'x'\n")
    with pytest.raises(InvalidArgument, match="layers"):
        host.store.create_image_from_spec(p)
    p.write_text("not = [toml")
    with pytest.raises(InvalidArgument, match="TOML"):
        host.store.create_image_from_spec(p)
    with pytest.raises(InvalidArgument, match="invalid image reference"):
        host.store.create_image("Bad Name", ["busybox"])
    with pytest.raises(LayerNotFound):
        host.store.create_image("ok:1", ["no-such-layer"])


def test_host_sandbox_limit_is_a_retryable_quota_error(root, base_image, host):
    from shoal import QuotaExceeded

    rt = host.backend("container")
    saved = rt.max_sandboxes
    with Sandbox.create(base_image, root=root):
        rt.max_sandboxes = len(os.listdir(host.settings.sandboxes_dir))
        try:
            with pytest.raises(QuotaExceeded, match="limit") as e:
                Sandbox.create(base_image, root=root)
            assert e.value.retryable
        finally:
            rt.max_sandboxes = saved
