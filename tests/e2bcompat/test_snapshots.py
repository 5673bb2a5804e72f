"""E2B's snapshots and fork through the unmodified SDK, sync and async, mapped onto Shoal's pack_diff
snapshots: create_snapshot, list_snapshots, Sandbox.create(snapshot_id), delete_snapshot, fork(count)."""
from __future__ import annotations

import asyncio

import pytest


def test_snapshot_restore_list_delete_and_fork(sbx, opts, e2b_server):
    from e2b import Sandbox
    from e2b.exceptions import NotFoundException, SandboxException

    sbx.files.write("state.txt", "before")
    snap = sbx.create_snapshot(name="ckpt")
    assert snap.snapshot_id == "ckpt:default" and snap.names == ["ckpt:default"]
    sbx.files.write("state.txt", "after")
    restored = Sandbox.create(snap.snapshot_id, timeout=60, **opts)
    try:
        assert restored.files.read("state.txt") == "before"
        assert restored.commands.run("cat state.txt").stdout == "before"
    finally:
        restored.kill()
    listed = sbx.list_snapshots().next_items()
    assert [s.snapshot_id for s in listed] == ["ckpt:default"]
    assert Sandbox.list_snapshots(name="ckpt", **opts).next_items()[0].names == ["ckpt:default"]
    # another tenant sees none of it, and cannot snapshot or fork this sandbox
    other = {**opts, "api_key": e2b_server["other_key"]}
    assert Sandbox.list_snapshots(**other).next_items() == []
    with pytest.raises((NotFoundException, SandboxException)):
        Sandbox.create(snap.snapshot_id, timeout=60, **other)
    with pytest.raises((NotFoundException, SandboxException)):
        Sandbox.fork(sbx.sandbox_id, count=1, **other)
    # fork: children start from the state now ("after"), the source runs on untouched
    forks = sbx.fork(count=2, timeout=60)
    try:
        assert len(forks) == 2 and all(isinstance(f, Sandbox) for f in forks), forks
        assert {f.sandbox_id for f in forks}.isdisjoint({sbx.sandbox_id})
        for f in forks:
            assert f.files.read("state.txt") == "after"
            assert f.commands.run("echo child").stdout == "child\n"
        forks[0].files.write("state.txt", "mine")
        assert forks[1].files.read("state.txt") == "after" and sbx.files.read("state.txt") == "after"
    finally:
        for f in forks:
            if isinstance(f, Sandbox):
                f.kill()
    assert Sandbox.delete_snapshot(snap.snapshot_id, **opts) is True
    assert Sandbox.delete_snapshot(snap.snapshot_id, **opts) is False
    with pytest.raises((NotFoundException, SandboxException)):
        Sandbox.create(snap.snapshot_id, timeout=60, **opts)
    with pytest.raises(Exception, match="count"):
        sbx.fork(count=21)


def test_snapshot_and_fork_async(opts):
    from e2b import AsyncSandbox

    async def main() -> None:
        s = await AsyncSandbox.create("base", timeout=60, **opts)
        try:
            await s.files.write("a.txt", "one")
            snap = await s.create_snapshot()
            assert snap.snapshot_id.startswith("snap-")
            r = await AsyncSandbox.create(snap.snapshot_id, timeout=60, **opts)
            forks = await s.fork(count=1)
            try:
                assert await r.files.read("a.txt") == "one"
                assert await forks[0].files.read("a.txt") == "one"
            finally:
                await r.kill()
                await forks[0].kill()
            assert await AsyncSandbox.delete_snapshot(snap.snapshot_id, **opts) is True
        finally:
            await s.kill()

    asyncio.run(main())


def test_the_cap_refuses_before_a_snapshot_is_taken_and_delete_frees_the_image(sbx, opts, host):
    """A tenant at its cap is refused before the backend takes the snapshot (no image left behind
    per refused call), and a deleted snapshot's image goes too: create+delete in a loop keeps nothing."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from shoal.e2b.snapshots import MAX_SNAPSHOTS

    hdr = {"x-api-key": opts["api_key"]}
    url = f"{opts['api_url']}/sandboxes/{sbx.sandbox_id}/snapshots"

    def images() -> set[str]:
        return {i.ref for i in host.images() if i.ref.startswith("snapshots/")}

    before = images()
    mine = httpx.get(f"{opts['api_url']}/snapshots", params={"limit": 1000}, headers=hdr).json()
    made = []
    for _ in range(MAX_SNAPSHOTS - len(mine)):
        r = httpx.post(url, json={}, headers=hdr, timeout=60)
        assert r.status_code == 201, r.text
        made.append(r.json()["snapshotID"])
    try:
        full = images()
        r = httpx.post(url, json={}, headers=hdr, timeout=60)
        assert r.status_code == 429, r.text
        assert images() == full  # nothing taken for the refused call
        # concurrent creates with room for one: the ones refused after their snapshot leave no image
        gone = made.pop()
        assert httpx.delete(f"{opts['api_url']}/templates/{gone}", headers=hdr).status_code == 204
        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda _: httpx.post(url, json={}, headers=hdr, timeout=60), range(4)))
        made += [r.json()["snapshotID"] for r in replies if r.status_code == 201]
        assert len(made) == MAX_SNAPSHOTS - len(mine) and len(images()) == len(full), [r.status_code for r in replies]
    finally:
        for ref in made:
            assert httpx.delete(f"{opts['api_url']}/templates/{ref}", headers=hdr).status_code == 204
    assert images() == before
