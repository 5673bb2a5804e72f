"""Lazily pulled Shoal (native EROFS) layers reach the host kernel's EROFS parser unchecked (no whole
image exists to fsck before the mount), so they are taken only from registries the operator trusts
(shoal.lazy.trust): from any other registry `--lazy` downloads the layers and checks them with
fsck.erofs like an eager pull, and a lazy layer whose registry is not trusted (any more) is not
mounted. The session registry is trusted by tests/registry/conftest.py; these tests take that back."""
from __future__ import annotations

import os
import shutil

import pytest

from shoal.config import load_settings
from shoal.core.errors import BadDigest, InvalidArgument, UntrustedRegistry
from shoal.lazy.trust import check_lazy_layer, is_trusted
from shoal.registry import pull

from .test_hostile_images import _gzip, _member, _push_shoal, _tar

ENV = "SHOAL_TRUSTED_REGISTRIES"


def test_a_crafted_layer_from_an_untrusted_registry_is_fscked_not_lazily_mounted(
        registry, fresh_host, tmp_path, monkeypatch):
    """An attacker's blob under the EROFS layer media type, with a true digest and chunk index. Lazily
    pulled (before the fix) it was registered at once, to be mounted by the host kernel on the first
    sandbox. From a registry not in the trust list, it is downloaded and fsck.erofs refuses it: no
    lazy layer, no image, nothing for the kernel to mount."""
    monkeypatch.setenv(ENV, "registry.example:5000 127.0.0.1:1/other")  # other registries, other repos
    blob = _gzip(_tar([(_member("etc/passwd", mode=0o644), b"root::0:0::/:/bin/sh\n")]))
    src = _push_shoal(registry, "lazy-foreign", blob + bytes(8192), tmp_path)
    with registry.client() as cl, pytest.raises(BadDigest, match="fsck.erofs"):
        pull(fresh_host.store, src, client=cl, lazy=True)
    assert fresh_host.store.lazy_digests() == []
    assert fresh_host.store.list_images() == []


def test_an_honest_image_from_an_untrusted_registry_is_downloaded_and_says_so(
        registry, lazy_pushed, fresh_host, monkeypatch):
    monkeypatch.delenv(ENV)
    with registry.client() as cl:
        res = pull(fresh_host.store, f"{registry.addr}/shoal/lazy:1", client=cl, lazy=True)
    assert res.lazy == [] and "trusted_registries" in res.note and "fsck.erofs" in res.note
    assert res.fetched and fresh_host.store.lazy_digests() == []
    for d in res.image.layers:
        assert fresh_host.store.location(d) == "local"


def test_a_lazy_layer_whose_registry_is_no_longer_trusted_is_not_mounted(
        registry, lazy_pushed, make_root, creds, monkeypatch):
    """Pulled lazily while trusted; then the operator drops the registry from the list (or the layer
    came with a root copied from elsewhere): the store refuses to mount it, typed, before any mount."""
    h = make_root()
    with registry.client() as cl:
        res = pull(h.store, f"{registry.addr}/shoal/lazy:1", client=cl, lazy=True)
    assert res.lazy == [lazy_pushed["busybox"], lazy_pushed["layer"]]
    monkeypatch.setenv(ENV, f"{registry.addr}/shoal/other")  # the registry, but another repository
    with pytest.raises(UntrustedRegistry, match="not in trusted_registries"):
        h.store.ensure_mounted(res.image.layers)
    assert not any(os.path.ismount(h.store.mount_path(d)) for d in res.image.layers)
    monkeypatch.setenv(ENV, f"{registry.addr}/shoal")  # its repository prefix: trusted again
    for p in h.store.ensure_mounted(res.image.layers):
        assert os.path.ismount(p)
    assert (h.store.mount_path(lazy_pushed["layer"]) / "data/hello.txt").read_text() == "hello, lazily\n"


def test_trust_entries_match_host_port_and_repository_prefix(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV, raising=False)
    assert not is_trusted("reg.corp:5000", "team/app")  # nothing by default
    cases = {  # entry -> (registry, repository) pairs it trusts, and pairs it does not
        "reg.corp": ([("reg.corp:5000", "a"), ("REG.corp", "x/y")], [("reg.corp.evil", "a"), ("evil.reg.corp", "a")]),
        "reg.corp:5000": ([("reg.corp:5000", "a")], [("reg.corp:5001", "a"), ("reg.corp", "a")]),
        "reg.corp:5000/team": ([("reg.corp:5000", "team"), ("reg.corp:5000", "team/app")],
                               [("reg.corp:5000", "teamx/app"), ("reg.corp:5000", "other/team")]),
        "docker.io/library": ([("registry-1.docker.io", "library/python")], [("registry-1.docker.io", "evil/x")]),
        "[::1]:5000": ([("[::1]:5000", "a")], [("[::1]:5001", "a")]),
    }
    for entry, (yes, no) in cases.items():
        for reg, repo in yes:
            assert is_trusted(reg, repo, [entry]), (entry, reg, repo)
        for reg, repo in no:
            assert not is_trusted(reg, repo, [entry]), (entry, reg, repo)
    monkeypatch.setenv(ENV, "a.example, reg.corp:5000/team")
    assert is_trusted("reg.corp:5000", "team/app") and is_trusted("a.example:443", "x")
    # origins other than a registry are named by the operator one layer at a time: not gated
    check_lazy_layer("sha256:" + "0" * 64, {"kind": "http", "url": "http://x/", "key": "layers/x.erofs"})
    with pytest.raises(UntrustedRegistry):
        check_lazy_layer("sha256:" + "0" * 64, {"kind": "registry", "registry": "evil:1", "key": "r@sha256:" + "1" * 9})
    # the config file's list, checked
    cfg = tmp_path / "config.toml"
    cfg.write_text('trusted_registries = ["reg.corp:5000/team", "mirror.corp"]\n')
    monkeypatch.setenv("SHOAL_CONFIG", str(cfg))
    monkeypatch.delenv(ENV)
    s = load_settings(tmp_path / "root")
    assert s.trusted_registries == ("reg.corp:5000/team", "mirror.corp")
    assert is_trusted("mirror.corp", "x", s.trusted_registries)
    for bad in ('trusted_registries = "reg.corp"\n', 'trusted_registries = ["https://reg.corp"]\n',
                'trusted_registries = ["user:pw@reg.corp"]\n'):
        cfg.write_text(bad)
        with pytest.raises(InvalidArgument, match="trusted_registries"):
            load_settings(tmp_path / "root")


def test_a_promoted_lazy_layer_copied_from_another_root_is_still_checked(
        registry, lazy_pushed, make_root, creds, monkeypatch):
    """A root that pulled lazily has, once every chunk arrived, the layer's image file assembled from
    them (shoal.lazy.layer.promote: never fsck'd). Another host copying the image from that root
    (`pull_from=/shared/root`, LayerStore.pull_image) took the file without its origin (before the
    fix), so its ensure_mounted mounted it whether or not it trusts that registry."""
    src = make_root()
    with registry.client() as cl:
        res = pull(src.store, f"{registry.addr}/shoal/lazy:1", client=cl, lazy=True)
    layer = lazy_pushed["layer"]
    assert layer in res.lazy
    blob = lazy_pushed["push"].layers[-1].blob
    shutil.copyfile(registry.blob_path(blob), src.store.image_path(layer))  # what promote writes
    dst = make_root()
    dst.store.pull_image(src.store, res.image.ref)
    monkeypatch.setenv(ENV, f"{registry.addr}/shoal/other")  # this host does not trust shoal/lazy
    with pytest.raises(UntrustedRegistry, match="not in trusted_registries"):
        dst.store.ensure_mounted([layer])
    assert not os.path.ismount(dst.store.mount_path(layer))
    monkeypatch.setenv(ENV, registry.addr)
    (p,) = dst.store.ensure_mounted([layer])
    assert (p / "data/hello.txt").read_text() == "hello, lazily\n"
    assert dst.store.lazy_layer(layer) is not None and dst.store.location(layer) == "local"


def test_a_mounted_lazy_layer_serves_no_new_sandbox_once_its_registry_is_not_trusted(
        registry, lazy_pushed, make_root, creds, monkeypatch):
    """Mounted while trusted, then the operator takes the registry off the list: the mount stays for
    the sandboxes holding it, but a new sandbox's ensure_mounted refuses it (before the fix only a
    layer not mounted yet was checked, and new sandboxes kept reading the unchecked image)."""
    h = make_root()
    with registry.client() as cl:
        res = pull(h.store, f"{registry.addr}/shoal/lazy:1", client=cl, lazy=True)
    paths = h.store.ensure_mounted(res.image.layers)
    assert all(os.path.ismount(p) for p in paths)
    monkeypatch.setenv(ENV, f"{registry.addr}/shoal/other")
    with pytest.raises(UntrustedRegistry, match="not in trusted_registries"):
        h.store.ensure_mounted(res.image.layers)
    monkeypatch.setenv(ENV, registry.addr)
    assert h.store.ensure_mounted(res.image.layers) == paths
