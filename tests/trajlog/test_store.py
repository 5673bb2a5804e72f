"""The log stores' own transactions (no sandbox): streams, entries, journal folding, rollback."""
from __future__ import annotations

import json

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


def test_journal_lines_fold_to_what_the_writer_itself_stored(tmp_path):
    """The journal lines `begin` / `append` / `complete` write by hand are what `recover` folds after a
    crash: parsed back, they must give the same rows as the writer's own in-memory records."""
    from shoal.core.contract import ExecResult
    from shoal.trajlog.store import ModelResult

    a = JournaledLogStore(tmp_path / "a.db", flush_s=3600)
    a.open_stream("ep/é", episode="ep", image=None, layers=[], writer="w1")
    r = ExecResult(exit_code=0, stdout="42\n\u00e9\x00", stderr="", stdout_bytes=5, stderr_bytes=0, duration_s=0.25)
    a.begin("ep/é", 0, "exec", "h0", {"cmd": "é"}, '{"cmd":"é"}', "ep", "sb-1", "host", "w1")
    a.complete("ep/é", 0, ModelResult(r))
    a.begin("ep/é", 1, "write", "h1", {"path": "/x", "data": '"q"'}, None, None, None, None, "w1")
    a.complete("ep/é", 1, {"bytes": 3, "nested": {"k": [1.5, None]}})
    a.append(Entry(stream="ep/é", seq=2, kind="exec", req_hash="h2", request={"cmd": "sleep 9"}, writer="w1"))
    a.complete("ep/é", 2, {"note": "interrupted"}, status=UNKNOWN)
    a.begin("ep/é", 3, "exec", "h3", {"cmd": "x"}, '{"cmd":"x"}', "ep", "sb-1", "host", "w1")  # in flight
    lines = [json.loads(x) for x in a._journal_path.read_bytes().splitlines()]
    b = JournaledLogStore(tmp_path / "b.db", flush_s=3600)
    b._apply(lines)  # what recover() does with a dead process's journal
    a.flush()
    rows = lambda s: [(e.seq, e.kind, e.req_hash, e.request, e.status, e.result, e.episode, e.sandbox, e.host,  # noqa: E731
                       e.writer, e.started, e.finished) for e in s.entries("ep/é")]
    assert rows(a) == rows(b)
    assert [x[4] for x in rows(a)] == [DONE, DONE, UNKNOWN, PENDING]
    assert rows(a)[0][5] == r.model_dump() and rows(a)[1][5] == {"bytes": 3, "nested": {"k": [1.5, None]}}
    a.close()
    b.close()


# ------------------------------------------------------------------------------------------ branches
@pytest.fixture(params=["sqlite", "journaled", "postgres"])
def any_store(request, tmp_path):
    if request.param == "postgres":
        from shoal.trajlog.store_pg import PgLogStore

        s = PgLogStore(request.getfixturevalue("pg_dsn"))
    else:
        s = (SQLiteLogStore if request.param == "sqlite" else JournaledLogStore)(tmp_path / "log.db")
    yield s
    s.close()


def test_branch_stream_copies_a_prefix_with_a_parent_link(any_store):
    s = any_store
    s.open_stream("ep/sandbox", episode="ep", image="img", layers=["a"], writer="w1", meta={"node": "n1"})
    for seq in range(5):
        s.append(Entry(stream="ep/sandbox", seq=seq, kind="exec", req_hash=f"h{seq}", request={"n": seq},
                       episode="ep", writer="w1"))
        s.complete("ep/sandbox", seq, {"exit_code": seq})
    assert s.branch_stream("ep/sandbox", "br/sandbox", 3, episode="br", step=2, meta={"sandbox": "sb-2"}) == 3
    got = s.entries("br/sandbox")
    assert [(e.seq, e.req_hash, e.result, e.episode, e.status) for e in got] == \
        [(i, f"h{i}", {"exit_code": i}, "br", DONE) for i in range(3)]
    info = s.stream_info("br/sandbox")
    assert (info.parent, info.parent_step, info.layers, info.image) == ("ep/sandbox", 2, ["a"], "img")
    assert info.meta == {"node": "n1", "sandbox": "sb-2"}
    assert s.stream_info("ep/sandbox").parent is None
    assert [c.stream for c in s.children("ep/sandbox")] == ["br/sandbox"]
    assert len(s.entries("ep/sandbox")) == 5  # the parent is untouched
    # a branch of the branch, and a name that exists already or a missing source: refused, nothing written
    assert s.branch_stream("br/sandbox", "br2/sandbox", 1, episode="br2", step=1) == 1
    assert s.stream_info("br2/sandbox").parent == "br/sandbox"
    from shoal.core.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="exists"):
        s.branch_stream("ep/sandbox", "br/sandbox", 1, episode="br", step=1)
    with pytest.raises(InvalidArgument, match="no trajectory stream"):
        s.branch_stream("nope/sandbox", "x/sandbox", 1, episode="x", step=1)
    assert s.stream_info("x/sandbox") is None and len(s.entries("br/sandbox")) == 3
    # several streams in one transaction: the second one's refusal leaves the first one unwritten
    with pytest.raises(InvalidArgument, match="exists"):
        s.branch_streams([("ep/sandbox", "br3/sandbox", 2, None), ("ep/sandbox", "br/sandbox", 2, None)],
                         episode="br3", step=1)
    assert s.stream_info("br3/sandbox") is None and s.entries("br3/sandbox") == []


def test_a_log_from_before_branches_gets_the_parent_columns_on_open(tmp_path):
    """Schema migration: a log written by the first release (no parent columns) opens, keeps its
    streams and entries, and can be branched from."""
    import sqlite3

    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    db.executescript("""
CREATE TABLE streams(stream TEXT PRIMARY KEY, episode TEXT, image TEXT, layers TEXT NOT NULL, writer TEXT,
  created REAL NOT NULL, meta TEXT NOT NULL DEFAULT '{}');
CREATE TABLE entries(stream TEXT NOT NULL, seq INTEGER NOT NULL, kind TEXT NOT NULL, req_hash TEXT NOT NULL,
  request TEXT NOT NULL, status TEXT NOT NULL, result TEXT, episode TEXT, sandbox TEXT, host TEXT,
  writer TEXT, started REAL NOT NULL, finished REAL, PRIMARY KEY(stream, seq)) WITHOUT ROWID;
INSERT INTO streams VALUES('old/sandbox', 'old', NULL, '["l1"]', 'w', 1.0, '{"sandbox": "sb-x"}');
INSERT INTO entries VALUES('old/sandbox', 0, 'exec', 'h', '{}', 'DONE', '{"exit_code": 0}', 'old', 'sb-x', 'h1',
  'w', 1.0, 2.0);
""")
    db.commit()
    db.close()
    for _ in range(2):  # opening twice: the migration is idempotent
        s = JournaledLogStore(path)
        info = s.stream_info("old/sandbox")
        assert (info.layers, info.meta, info.parent, info.parent_step) == (["l1"], {"sandbox": "sb-x"}, None, None)
        assert s.get("old/sandbox", 0).result == {"exit_code": 0}
        s.close()
    s = SQLiteLogStore(path)
    assert s.branch_stream("old/sandbox", "new/sandbox", 1, episode="new", step=1) == 1
    assert s.stream_info("new/sandbox").parent == "old/sandbox"
    s.close()
