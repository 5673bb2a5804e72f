"""`pull_from` for rollout workers and fleets: a registry prefix instead of a shared root."""
from __future__ import annotations

import pytest

from shoal import Sandbox
from shoal.core.errors import ImageNotFound, InvalidArgument
from shoal.layers.store import LayerStore
from shoal.registry import push
from shoal.registry.source import RegistrySource, open_image_source

from .conftest import PASSWORD, USER


def test_open_image_source_tells_roots_from_registries(root, tmp_path):
    assert isinstance(open_image_source(root), LayerStore)
    assert isinstance(open_image_source("oci://127.0.0.1:5000/fleet"), RegistrySource)
    assert open_image_source("registry.example:5000/fleet").remote("ws/six:1.16") == \
        "registry.example:5000/fleet/ws/six:1.16"
    lazy = open_image_source("oci://127.0.0.1:5000/fleet?lazy")
    assert lazy.lazy and lazy.remote("a:1") == "127.0.0.1:5000/fleet/a:1"  # layers read on demand
    assert not open_image_source("oci://127.0.0.1:5000/fleet").lazy
    with pytest.raises(InvalidArgument):
        open_image_source(tmp_path / "no-such-root")


def test_a_worker_source_pulls_from_a_registry_prefix(host, base_image, registry, fresh_host, monkeypatch):
    with registry.client() as cl:
        push(host.store, base_image, f"{registry.addr}/fleet/{base_image}", client=cl)
    monkeypatch.setenv("SHOAL_REGISTRY_USER", USER)
    monkeypatch.setenv("SHOAL_REGISTRY_PASSWORD", PASSWORD)
    monkeypatch.setenv("SHOAL_REGISTRY_HOST", registry.addr)
    monkeypatch.setenv("SHOAL_REGISTRY_CA", str(registry.ca))
    source = open_image_source(f"oci://{registry.addr}/fleet")
    img = source.pull_into(fresh_host.store, base_image)  # what Task.prepare does for a missing image
    assert img.ref == base_image and img.layers == host.store.get_image(base_image).layers
    with Sandbox.create(base_image, root=fresh_host.settings.root) as sb:
        assert sb.commands.run("echo ok").stdout == "ok\n"
    with pytest.raises(ImageNotFound):
        source.pull_into(fresh_host.store, "nothing-here:1")
