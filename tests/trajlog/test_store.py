"""The log stores' own transactions (no sandbox): streams, entries, journal folding, rollback."""
from __future__ import annotations

import pytest

from shoal.trajlog.store import DONE, PENDING, UNKNOWN, Entry, JournaledLogStore, SQLiteLogStore


@pytest.fixture(params=[SQLiteLogStore, JournaledLogStore], ids=["sqlite", "journaled"])
def store(request, tmp_path):
    s = request.param(tmp_path / "log.db")
    yield s
    s.close()


def _entry(seq: int, writer: str = "w1") -> Entry:
    return Entry(stream="ep/sandbox", seq=seq, kind="exec", req_hash="h", request={"argv": ["true"]}, writer=writer)


def test_stream_takeover_marks_the_old_writers_pending_entries_unknown(store):
    assert store.open_stream("ep/sandbox", episode="ep", image="img", layers=["a"], writer="w1") == 0
    store.append(_entry(1))
    store.complete("ep/sandbox", 1, {"exit_code": 0})
    store.append(_entry(2))
    if isinstance(store, JournaledLogStore):
        store.flush()
    # w2 takes the stream over: w1's in-flight entry 2 can no longer finish
    assert store.open_stream("ep/sandbox", episode="ep", image="img", layers=["a"], writer="w2") == 2
    assert [(e.seq, e.status) for e in store.entries("ep/sandbox")] == [(1, DONE), (2, UNKNOWN)]
    store.update_stream("ep/sandbox", layers=["a", "b"], meta={"sandbox": "sb-1"})
    store.update_stream("ep/sandbox", meta={"node": "n1"})
    info = store.stream_info("ep/sandbox")
    assert (info.writer, info.layers, info.meta) == ("w2", ["a", "b"], {"sandbox": "sb-1", "node": "n1"})


def test_a_failed_transaction_leaves_nothing_behind(store):
    store.open_stream("ep/sandbox", episode="ep", image=None, layers=[], writer="w1")
    with pytest.raises(RuntimeError):
        with store._conn.transaction() as db:
            db.execute("UPDATE streams SET writer='x'")
            raise RuntimeError("boom")
    assert store.stream_info("ep/sandbox").writer == "w1"
    # and the connection is usable again (no transaction left open)
    store.update_stream("ep/sandbox", image="img2")
    assert store.stream_info("ep/sandbox").image == "img2"
    store.append(_entry(1))
    if isinstance(store, JournaledLogStore):
        store.flush()
    assert store.get("ep/sandbox", 1).status == PENDING
