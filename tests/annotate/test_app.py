"""The annotation app over HTTP: accounts and queues, the correct -> continue loop, bad input."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from shoal.annotate.app import episode_items


def client(server, name):
    c = httpx.Client(base_url=server.url, timeout=30)
    r = c.get(f"/login?token={server.ann.store.tokens[name]}", follow_redirects=False)
    assert r.status_code == 303
    return c


def events(r) -> list[tuple[str, dict]]:
    out = []
    for block in r.text.strip().split("\n\n"):
        ev, data = block.split("\n")
        out.append((ev.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_queue_start_correct_continue_label_export(app_server):
    alice = client(app_server, "alice")
    assert [q["item_id"] for q in alice.get("/api/queue").json()] == ["q0", "q1", "q2", "q3"]
    assert httpx.get(f"{app_server.url}/api/queue").status_code == 401  # no cookie, no queue
    evs = events(alice.post("/api/tree/q0/start", json={}))
    assert evs[-1][0] == "done" and [e for e, _ in evs].count("token") == evs[-1][1]["n"] > 5
    view = alice.get("/api/tree/q0").json()
    toks = view["current"]["tokens"]
    assert "".join(t["text"] for t in toks) == "".join(d["text"] for e, d in evs if e == "token")
    assert all(len(t["top"]) == 8 for t in toks)
    alt = toks[4]["top"][1]  # the model's second choice at token 4
    r = alice.post("/api/tree/q0/correct", json={"parent": 0, "pos": 4, "token": alt["id"], "version": view["version"]})
    evs = events(r)
    node = int(r.headers["x-node"])
    after = alice.get(f"/api/tree/q0?node={node}").json()
    cur = after["current"]
    assert [t["id"] for t in cur["tokens"][:5]] == [t["id"] for t in toks[:4]] + [alt["id"]]
    assert cur["sources"] == "g" * 4 + "c" + "g" * (len(cur["tokens"]) - 5) and len(cur["tokens"]) > 5
    assert after["version"] == evs[-1][1]["version"]
    v = alice.post("/api/tree/q0/label", json={"node": node, "label": "good", "version": after["version"]}).json()
    assert v["version"] == after["version"] + 1
    assert alice.get("/api/queue").json()[0]["done"]
    sft = [json.loads(x) for x in alice.get("/api/export/sft").text.splitlines()]
    assert sft[0]["messages"][-1]["content"] == "".join(t["text"] for t in cur["tokens"])
    pairs = [json.loads(x) for x in alice.get("/api/export/pairs").text.splitlines()]
    assert pairs[0]["kind"] == "fork" and pairs[0]["rejected"] == "".join(t["text"] for t in toks)
    assert alice.get("/api/export/everything").status_code == 400


def test_bad_input_gets_clear_errors_and_changes_nothing(app_server):
    alice = client(app_server, "alice")
    events(alice.post("/api/tree/q1/start", json={}))
    v = alice.get("/api/tree/q1").json()["version"]
    r = alice.post("/api/tree/q1/correct", json={"parent": 0, "pos": 999, "token": 1, "version": v})
    assert r.status_code == 400 and "token position 999 is outside node 0" in r.json()["error"]["message"]
    r = alice.post("/api/tree/q1/correct", json={"parent": 7, "pos": 0, "token": 1, "version": v})
    assert r.status_code == 404 and "no node 7" in r.json()["error"]["message"]
    r = alice.post("/api/tree/q1/correct", json={"parent": 0, "pos": 0, "token": 10 ** 6, "version": v})
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]
    r = alice.post("/api/tree/q1/correct", json={"parent": 0, "pos": 0, "text": "abc", "version": v})
    assert r.status_code == 400 and "not in this model's vocabulary" in r.json()["error"]["message"]
    r = alice.post("/api/tree/q1/correct", json={"parent": 0, "pos": "x", "version": v})
    assert r.status_code == 400
    assert alice.get("/api/tree/nope").status_code == 404
    assert alice.get("/api/tree/q1").json()["version"] == v


def test_two_annotators_on_one_tree_conflict_and_nothing_is_lost(app_server):
    alice, bob = client(app_server, "alice"), client(app_server, "bob")
    events(alice.post("/api/tree/q2/start", json={}))
    v = bob.get("/api/tree/q2").json()["version"]
    events(alice.post("/api/tree/q2/correct", json={"parent": 0, "pos": 2, "token": 3, "version": v}))
    r = bob.post("/api/tree/q2/correct", json={"parent": 0, "pos": 1, "token": 4, "version": v})
    assert r.status_code == 409
    err = r.json()["error"]
    assert err["type"] == "EditConflict" and "another annotator" in err["message"] and err["current_version"] > v
    retry = {"parent": 0, "pos": 1, "token": 4, "version": err["current_version"]}
    events(bob.post("/api/tree/q2/correct", json=retry))
    nodes = bob.get("/api/tree/q2").json()["nodes"]
    assert [(n["annotator"], n["pos"]) for n in nodes] == [("alice", 0), ("alice", 2), ("bob", 1)]


def test_an_episode_step_is_annotated_and_its_continuation_stops_at_the_next_tool_call(bpe_model, tmp_path):
    from shoal.annotate.tree import AnnotationStore

    from .conftest import AppServer

    record = {"episode_id": "ep1", "instance_id": "demo", "reward": 0.0, "messages": [
        {"role": "system", "content": "You fix bugs."}, {"role": "user", "content": "The tests fail."},
        {"role": "assistant", "content": "Run the tests.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{\"cmd\": \"pytest\"}"}}]},
        {"role": "tool", "content": "1 failed"}, {"role": "assistant", "content": "Fix it."}]}
    items = episode_items(record, "ep1")
    assert [i["id"] for i in items] == ["ep1-step0", "ep1-step1"]
    assert items[0]["prompt"]["messages"][-1]["role"] == "user" and items[0]["meta"]["after"][0]["role"] == "tool"
    store = AnnotationStore(tmp_path / "a.db")
    for it in items:
        store.add_item(it["id"], it["prompt"], kind="episode", title=it["title"], response=it["response"],
                       meta=it["meta"])
    token = store.add_annotator("alice")
    store.assign("alice", store.items())
    store.tokens = {"alice": token}  # type: ignore[attr-defined]
    server = AppServer(store, bpe_model, k=5, max_tokens=40)
    try:
        alice = client(server, "alice")
        assert alice.post("/api/tree/ep1-step0/start", json={}).json() == {"version": 1, "node": 0}
        cur = alice.get("/api/tree/ep1-step0").json()["current"]
        text = "".join(t["text"] for t in cur["tokens"])
        assert text.startswith("Run the tests.\n<tool_call>") and text.endswith("</tool_call>")
        assert set(cur["sources"]) == {"e"}
    finally:
        server.stop()
        store.close()


def test_a_browser_that_goes_away_mid_stream_keeps_what_the_model_wrote(bpe_model, scripted_server_inproc, tmp_path):
    from shoal.annotate.model import OpenAIModel
    from shoal.annotate.tree import AnnotationStore

    from .conftest import AppServer

    store = AnnotationStore(tmp_path / "a.db")
    store.add_item("p", {"text": "The agent reads"})
    store.tokens = {"alice": store.add_annotator("alice")}  # type: ignore[attr-defined]
    store.assign("alice", ["p"])
    remote = OpenAIModel(scripted_server_inproc.url, bpe_model.name, bpe_model.tokenizer)
    server = AppServer(store, remote, k=3, max_tokens=60)
    try:
        alice = client(server, "alice")
        events(alice.post("/api/tree/p/start", json={}))
        v = store.tree("p").version  # type: ignore[union-attr]  (started just above)
        httpx.post(f"{scripted_server_inproc.url}/admin/token_delay", json={"seconds": 0.2})
        with alice.stream("POST", "/api/tree/p/correct", json={"parent": 0, "pos": 1, "token": 5, "version": v}) as r:
            for line in r.iter_lines():
                if line.startswith("event: token"):
                    break  # the browser closes after the first token
        deadline = time.monotonic() + 10
        while len(store.tree("p").nodes[1].tokens) < 3 and time.monotonic() < deadline:  # type: ignore[union-attr]  # saved when the server sees the disconnect
            time.sleep(0.1)
        node = store.tree("p").nodes[1]  # type: ignore[union-attr]  (it exists: the correction was saved first)
        assert 3 <= len(node.tokens) < 2 + 60 and node.sources.startswith("gc")
    finally:
        httpx.post(f"{scripted_server_inproc.url}/admin/token_delay", json={"seconds": 0})
        server.stop()
        remote.close()
        store.close()


def test_prompt_and_episode_files_become_queue_items(tmp_path):
    from shoal.annotate.cli import demo_prompts, load_items
    from shoal.annotate.tree import AnnotationStore

    prompts = demo_prompts(tmp_path / "p.jsonl", n=3)
    eps = tmp_path / "e.jsonl"
    eps.write_text(json.dumps({"episode_id": "ep9", "messages": [
        {"role": "user", "content": "go"}, {"role": "assistant", "content": "ok"}]}) + "\n")
    store = AnnotationStore(tmp_path / "a.db")
    ids = load_items(store, prompts, eps)
    assert ids == ["arith-0", "arith-1", "arith-2", "ep9-step0"]
    assert store.item("arith-0")["title"] == store.item("arith-0")["prompt"]["text"]
    assert store.item("ep9-step0")["response"] == [{"role": "assistant", "content": "ok"}]
    assert load_items(store, prompts, None) == ids[:3]  # loading twice adds nothing twice
    assert store.items() == ids
    store.close()


def test_serve_deals_items_out_and_admins_see_all(tmp_path):
    from shoal.annotate.cli import accounts
    from shoal.annotate.tree import AnnotationStore, NotYourItem

    store = AnnotationStore(tmp_path / "a.db")
    for i in range(5):
        store.add_item(f"i{i}", {"text": str(i)})
    tokens = accounts(store, store.items(), ["a", "b"], ["lead"], deal=True)
    assert [q["item_id"] for q in store.queue("a")] == ["i0", "i2", "i4"]
    assert [q["item_id"] for q in store.queue("b")] == ["i1", "i3"]
    assert store.login(tokens["lead"]) == "lead" and store.queue("lead") == []
    store.check_access("lead", "i1")
    with pytest.raises(NotYourItem):
        store.check_access("a", "i1")
    store.close()


def test_an_item_id_from_the_data_file_cannot_inject_markup(bpe_model, tmp_path):
    """Item ids come from the imported files: they are escaped in the queue's links and in the JSON
    the page embeds in a <script>, so an id cannot end the script or add an element."""
    from urllib.parse import quote

    from shoal.annotate.tree import AnnotationStore

    from .conftest import AppServer

    evil = '"><img src=x onerror=alert(1)><b><!--'  # (a '/' would not route: ids with one 404)
    store = AnnotationStore(tmp_path / "a.db")
    store.add_item(evil, {"text": "hello"}, title="evil")
    store.tokens = {"alice": store.add_annotator("alice")}  # type: ignore[attr-defined]
    store.assign("alice", [evil])
    server = AppServer(store, bpe_model, k=3)
    try:
        alice = client(server, "alice")
        queue = alice.get("/").text
        assert "<img" not in queue and "<b>" not in queue and quote(evil, safe="") in queue
        page = alice.get("/item/" + quote(evil, safe=""))
        assert page.status_code == 200
        assert "<img" not in page.text and "<!--" not in page.text
    finally:
        server.stop()


def test_an_annotator_cannot_read_or_edit_another_annotators_item(repro_model, tmp_path):
    """Bob tries Alice's item by id (API), by URL (the page), and through the export; each fails with
    a clear 403, and Alice's tree is as she left it. An admin's share opens it to him."""
    from urllib.parse import quote

    from shoal.annotate.tree import AnnotationStore

    from .conftest import AppServer

    store = AnnotationStore(tmp_path / "a.db")
    store.add_item("alice-1", {"text": "265+988="}, title="alice's")
    store.add_item("bob-1", {"text": "776-430="}, title="bob's")
    store.tokens = {n: store.add_annotator(n, admin=n == "root") for n in ("alice", "bob", "root")}  # type: ignore[attr-defined]
    store.assign("alice", ["alice-1"])
    store.assign("bob", ["bob-1"])
    server = AppServer(store, repro_model, k=4, max_tokens=12)
    try:
        alice, bob, root = client(server, "alice"), client(server, "bob"), client(server, "root")
        events(alice.post("/api/tree/alice-1/start", json={}))
        v = alice.get("/api/tree/alice-1").json()["version"]
        events(alice.post("/api/tree/alice-1/correct", json={"parent": 0, "pos": 1, "token": 3, "version": v}))
        alice.post("/api/tree/alice-1/label", json={"node": 1, "label": "good", "version": v + 2})
        before = alice.get("/api/tree/alice-1").json()
        assert [q["item_id"] for q in bob.get("/api/queue").json()] == ["bob-1"]
        assert "alice-1" not in bob.get("/").text

        def refused(r):
            assert r.status_code == 403, r.text
            err = r.json()["error"]
            assert err["type"] == "NotYourItem" and "'alice-1' is not in bob's queue" in err["message"]

        refused(bob.get("/api/tree/alice-1"))  # by id
        refused(bob.get("/item/" + quote("alice-1")))  # by URL: the page itself
        refused(bob.get("/api/tree/alice-1?node=1"))
        refused(bob.post("/api/tree/alice-1/start", json={}))
        refused(bob.post("/api/tree/alice-1/correct", json={"parent": 0, "pos": 0, "token": 2,
                                                            "version": before["version"]}))
        refused(bob.post("/api/tree/alice-1/label", json={"node": 1, "label": "bad", "version": before["version"]}))
        refused(bob.post("/api/tree/alice-1/undo", json={"version": before["version"]}))
        assert bob.get("/api/tree/nope").status_code == 404
        for kind in ("sft", "pairs", "token_level", "corrections"):  # via export: none of her data
            assert bob.get(f"/api/export/{kind}").text == ""
        assert json.loads(alice.get("/api/export/sft").text)["messages"][-1]["content"]
        r = bob.post("/api/share", json={"item": "alice-1", "annotator": "bob"})  # only an admin shares
        assert r.status_code == 403 and "only an admin shares" in r.json()["error"]["message"]
        assert alice.get("/api/tree/alice-1").json() == before  # untouched
        assert store.tree("alice-1").version == before["version"]  # type: ignore[union-attr]

        assert root.get("/api/tree/bob-1").status_code == 200  # an admin sees every item
        assert root.post("/api/share", json={"item": "alice-1", "annotator": "bob"}).status_code == 200
        assert bob.get("/api/tree/alice-1").json()["version"] == before["version"]
        assert len(bob.get("/api/export/sft").text.splitlines()) == 1
    finally:
        server.stop()
        store.close()
