"""Host.kill_many ends sandboxes together (container backend: all signalled, then waited for at once;
killmany.py): each ends as with kill(), a paused one included, and nothing is left behind."""
from __future__ import annotations

from shoal.core.contract import CreateRequest, ExecRequest


def test_kill_many_ends_each_sandbox_like_kill(host, base_image):
    be = host.backend("container")
    ids = [host.create(CreateRequest(image=base_image, backend="container", memory_mb=64)).id for _ in range(6)]
    for sid in ids:
        host.exec(sid, ExecRequest(argv=["sh", "-c", "sleep 1000 </dev/null >/dev/null 2>&1 &"]))
    host.pause(ids[0])  # frozen: must be thawed to die
    host.kill(ids[1])  # already gone
    gone = host.kill_many([*ids, "sb-nosuch-000000000000"])
    assert set(gone) == {ids[1], "sb-nosuch-000000000000"}
    live = be.live_ids()
    cgroups = be.cgroups.list_ids()
    for sid in ids:
        assert sid not in live and sid not in cgroups, sid
        assert (host.settings.tombstones_dir / sid).read_text() == "killed", sid
    assert all(info.id not in ids for info in host.list())
