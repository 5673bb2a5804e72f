"""The annotation tree (SQLite and PostgreSQL) and every export, on a hand-built tree with known output."""
from __future__ import annotations

import pytest

from shoal.annotate import export
from shoal.annotate.tokens import CharTokenizer
from shoal.annotate.tree import AnnotationStore, EditConflict, NotFound, Tree
from shoal.core.errors import InvalidArgument, Unauthorized

CHARS = "0123456789+-*=,."
TOK = CharTokenizer(CHARS, pad_id=len(CHARS), eos_id=CHARS.index("."))


def enc(s: str) -> list[int]:
    return TOK.encode(s)


def build(store: AnnotationStore) -> Tree:
    """root "1+2=4." -> (pos 4, picked "3") "1+2=3." good; root -> (pos 0, typed "7") "7+2=9." good;
    that -> (pos 4, picked "8") "7+2=8." bad."""
    store.add_item("q1", {"text": "12+34="}, title="sum")
    tok = store.add_annotator("ann")
    assert store.login(tok) == "ann"
    root, v = store.start("q1", enc("12+34="), enc("1+2=4."), "g" * 6, "ann", model="m")
    n1, v = store.correct("q1", root, 4, enc("3"), "c", "ann", v)
    v = store.extend("q1", n1, enc("."), "g", "ann", v)
    v = store.label("q1", n1, "good", "ann", v)
    n2, v = store.correct("q1", root, 0, enc("7"), "t", "ann", v)
    v = store.extend("q1", n2, enc("+2=9."), "ggggg", "ann", v)
    v = store.label("q1", n2, "good", "ann", v)
    n3, v = store.correct("q1", n2, 4, enc("8"), "c", "ann", v)
    v = store.extend("q1", n3, enc("."), "g", "ann", v)
    v = store.label("q1", n3, "bad", "ann", v)
    tree = store.tree("q1")
    assert tree is not None and tree.version == v == 10
    return tree


@pytest.fixture(params=["sqlite", "postgres"])
def store(request, tmp_path):
    where = tmp_path / "ann.db" if request.param == "sqlite" else request.getfixturevalue("pg_dsn")
    s = AnnotationStore(where)
    yield s
    s.close()


def test_the_tree_holds_every_operation_with_who_wrote_each_token(store):
    tree = build(store)
    texts = {n.id: TOK.decode(n.tokens) for n in tree.nodes}
    assert texts == {0: "1+2=4.", 1: "1+2=3.", 2: "7+2=9.", 3: "7+2=8."}
    assert [(n.parent, n.op, n.pos, n.sources, n.label) for n in tree.nodes] == [
        (None, "root", 0, "gggggg", None), (0, "correct", 4, "ggggcg", "good"),
        (0, "correct", 0, "tggggg", "good"), (2, "correct", 4, "tgggcg", "bad")]
    assert [o["op"] for o in tree.ops] == ["root"] + ["correct", "extend", "label"] * 3
    # a reopened store (a browser crash, a server restart) sees every operation
    assert store.__class__(store.db._pg.dsn if store.db.pg else store.db._lite.path).tree("q1") == tree


def test_exports_of_the_hand_built_tree(store):
    tree = build(store)
    assert export.sft([tree], TOK) == [
        {"messages": [{"role": "user", "content": "12+34="}, {"role": "assistant", "content": "1+2=3."}],
         "item_id": "q1", "node": 1},
        {"messages": [{"role": "user", "content": "12+34="}, {"role": "assistant", "content": "7+2=9."}],
         "item_id": "q1", "node": 2}]
    pairs = export.preference_pairs([tree], TOK)
    assert [(p["kind"], p["chosen"], p["rejected"]) for p in pairs] == [
        ("fork", "1+2=3.", "1+2=4."),  # the corrected root vs the good one sharing "1+2="
        ("fork", "7+2=9.", "7+2=8."),  # the bad dialog vs its nearest good sibling, not "1+2=3."
        ("outcome", "1+2=3.", "7+2=8.")]
    assert all(p["prompt"] == "12+34=" for p in pairs)
    rows = export.token_level([tree], TOK)
    assert [(r["role"], r["patch"], r["weights"], r["segments"]) for r in rows] == [
        ("chosen", [4, 5], [0, 0, 0, 0, 1, 0], ["1+2=", "3", "."]),
        ("rejected", [4, 5], [0, 0, 0, 0, -1, 0], ["1+2=", "4", "."]),
        ("chosen", [4, 5], [0, 0, 0, 0, 1, 0], ["7+2=", "9", "."]),
        ("rejected", [4, 5], [0, 0, 0, 0, -1, 0], ["7+2=", "8", "."])]
    assert [(c["context"], c["find"], c["replace"]) for c in export.corrections([tree], TOK)] == [
        ("1+2=", "4", "3"), ("", "1", "7"), ("7+2=", "9", "8")]


def test_minimal_patch_spans_whole_characters_and_masks_long_rejected_patches(bpe_model):
    tok = bpe_model.tokenizer
    good, bad = tok.encode("Tests pass 🎉 ok"), tok.encode("Tests pass 🐟🐟 ok")
    tree = Tree("e", 3, {"text": "x"}, tok.encode("x"))
    from shoal.annotate.tree import Node
    tree.nodes = [Node(0, None, "root", 0, bad, "g" * len(bad), "a", 0.0, "bad"),
                  Node(1, 0, "correct", 0, good, "g" * len(good), "a", 1.0, "good")]
    rows = export.token_level([tree], tok)
    chosen, rejected = rows
    assert chosen["segments"][1].strip().startswith("🎉") and "".join(chosen["segments"]) == "Tests pass 🎉 ok"
    assert rejected["segments"][1].strip().startswith("🐟") and "".join(rejected["segments"]) == "Tests pass 🐟🐟 ok"
    a, b = rejected["patch"]
    assert b - a > 1 and set(rejected["weights"]) == {0.0}  # a multi-token rejected patch: masked
    fork = export.common_prefix(good, bad)
    assert chosen["patch"][0] <= fork < chosen["patch"][1]


def test_token_level_rows_train_through_shoal_train_masked_losses(repro_model):
    import torch

    from shoal.train import repro

    model = repro_model.model
    tok = repro_model.tokenizer
    prompt = tok.encode("265+988=")
    gen = [t.id for t in repro_model.stream(prompt, 40, k=1)]
    wrong = gen[:4] + [(gen[4] + 1) % 10] + gen[5:]
    tree = Tree("t", 3, {"text": "265+988="}, prompt)
    from shoal.annotate.tree import Node
    tree.nodes = [Node(0, None, "root", 0, wrong, "g" * len(wrong), "a", 0.0, "bad"),
                  Node(1, 0, "correct", 4, gen, "g" * len(gen), "a", 1.0, "good")]
    rows = export.token_level([tree], tok)
    assert [r["weights"][4] for r in rows] == [1.0, -1.0]
    trained = repro.make_model(1, 64, seed=0)
    trained.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(trained.parameters(), lr=0.5)

    def lp(ids):
        from shoal.annotate.model import LocalModel
        return LocalModel(trained, tok, "x").score(prompt, ids, k=0)[4].logprob

    before = lp(gen), lp(wrong)
    for _ in range(3):
        loss = export.weighted_nll(trained, rows, pad_id=tok.pad_id)
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = lp(gen), lp(wrong)
    assert after[0] > before[0] and after[1] < before[1]


def test_concurrent_edits_conflict_clearly_and_lose_nothing(store):
    tree = build(store)
    store.add_annotator("bob")
    v = tree.version
    n_alice, v2 = store.correct("q1", 0, 2, enc("3"), "t", "ann", v)
    with pytest.raises(EditConflict, match=r"at version 11, not 10.*another annotator") as e:
        store.correct("q1", 0, 3, enc("5"), "t", "bob", v)  # bob loaded the tree at version 10
    assert e.value.current_version == v2
    n_bob, v3 = store.correct("q1", 0, 3, enc("5"), "t", "bob", v2)  # after reloading
    after = store.tree("q1")
    assert after is not None and after.node(n_alice).tokens == enc("1+3") and after.node(n_bob).tokens == enc("1+25")
    with pytest.raises(EditConflict, match="already started"):
        store.start("q1", [1], [1], "g", "bob")


def test_undo_hides_and_restores_and_bad_input_is_refused(store):
    tree = build(store)
    v = store.undo("q1", "ann", tree.version)  # the last label: bad -> none
    t = store.tree("q1")
    assert t is not None and t.node(3).label is None
    v = store.undo("q1", "ann", v)  # then the correction and its continuation, as one step
    t = store.tree("q1")
    assert t is not None and t.node(3).hidden and [n.id for n in t.visible()] == [0, 1, 2]
    assert len(t.nodes) == 4  # hidden, not deleted
    with pytest.raises(InvalidArgument, match="token position 9 is outside node 0's response"):
        store.correct("q1", 0, 9, enc("1"), "t", "ann", v)
    with pytest.raises(NotFound, match="no node 42"):
        store.correct("q1", 42, 0, enc("1"), "t", "ann", v)
    with pytest.raises(InvalidArgument, match="sources must give"):
        store.correct("q1", 0, 0, enc("1"), "x", "ann", v)
    with pytest.raises(InvalidArgument, match="nothing of yours to undo"):
        store.undo("q1", "nobody", v)
    with pytest.raises(Unauthorized):
        store.login("not-a-token")
    assert store.tree("q1").version == v  # type: ignore[union-attr]  (refused writes left no trace)
