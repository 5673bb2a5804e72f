"""The app in a real browser (Playwright driving Debian's chromium): load, click a token, pick a
candidate, see the continuation, mark good, export; typing and undo by keyboard; a model server that
goes away mid-stream; two annotators on one tree. SHOAL_ANNOTATE_SHOTS=DIR saves screenshots there."""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

pytest.importorskip("playwright")
if not Path("/usr/bin/chromium").exists():  # `make setup` installs Debian's chromium
    pytest.skip("Debian's chromium is not installed (make setup)", allow_module_level=True)

from playwright.sync_api import expect, sync_playwright  # noqa: E402

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run"]
SHOTS = os.environ.get("SHOAL_ANNOTATE_SHOTS")


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path="/usr/bin/chromium", headless=True, args=FLAGS)
        yield b
        b.close()


def login(browser, server, name):
    ctx = browser.new_context(viewport={"width": 1280, "height": 760})
    page = ctx.new_page()
    page.goto(f"{server.url}/login?token={server.ann.store.tokens[name]}")
    return page


def shot(page, name):
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(SHOTS) / f"{name}.png"))


def resp_text(page) -> str:
    return "".join(page.locator("#resp .tok").all_text_contents())


def test_click_a_token_pick_a_candidate_see_the_continuation_mark_good_export(browser, app_server):
    page = login(browser, app_server, "alice")
    expect(page.locator("#queue li")).to_have_count(4)
    shot(page, "queue")
    page.click("text=265+988=")
    expect(page.locator("#status")).to_have_text("loaded", timeout=30000)
    first = resp_text(page)
    assert len(first) > 5 and page.locator("#resp .tok").count() == len(first)
    page.click('#resp .tok[data-i="4"]')
    expect(page.locator("#cands li")).to_have_count(8)
    shot(page, "candidates")
    cand = page.locator("#cands li").nth(1)
    cand.click()
    expect(page.locator("#status")).to_contain_text("the model continued", timeout=30000)
    after = resp_text(page)
    assert after[:4] == first[:4] and after != first
    assert page.locator("#resp .tok.c").count() == 1  # the picked candidate, marked as such
    assert page.locator("#tree li").count() == 2
    shot(page, "continued")
    page.keyboard.press("g")
    expect(page.locator("#label")).to_have_text("good")
    sft = page.request.get(f"{app_server.url}/api/export/sft").text()
    assert json.loads(sft.splitlines()[0])["messages"][-1]["content"] == after
    page.context.close()


def test_keyboard_select_type_and_undo(browser, app_server):
    page = login(browser, app_server, "bob")
    page.goto(f"{app_server.url}/item/q1")
    expect(page.locator("#status")).to_have_text("loaded", timeout=30000)
    n = page.locator("#resp .tok").count()
    for _ in range(3):
        page.keyboard.press("ArrowRight")
    expect(page.locator("#resp .tok.sel")).to_have_attribute("data-i", "2")
    page.keyboard.press("t")
    page.keyboard.type("9")
    page.keyboard.press("Enter")
    expect(page.locator("#status")).to_contain_text("corrected at token 2", timeout=30000)
    assert resp_text(page)[2] == "9" and page.locator("#resp .tok.t").count() == 1
    page.keyboard.press("u")
    expect(page.locator("#status")).to_have_text("undone")
    expect(page.locator("#tree li")).to_have_count(1)
    assert page.locator("#resp .tok").count() == n
    page.context.close()


def test_two_annotators_on_one_tree_see_a_clear_conflict(browser, app_server):
    a = login(browser, app_server, "alice")
    a.goto(f"{app_server.url}/item/q2")
    expect(a.locator("#status")).to_have_text("loaded", timeout=30000)
    b = login(browser, app_server, "bob")
    b.goto(f"{app_server.url}/item/q2")
    expect(b.locator("#resp .tok").first).to_be_visible(timeout=30000)
    a.click('#resp .tok[data-i="3"]')
    a.locator("#cands li").nth(1).click()
    expect(a.locator("#status")).to_contain_text("the model continued", timeout=30000)
    b.click('#resp .tok[data-i="5"]')  # bob's page still shows the old version
    b.locator("#cands li").nth(1).click()
    expect(b.locator("#status")).to_contain_text("another annotator changed this tree", timeout=30000)
    expect(b.locator("#tree li")).to_have_count(2)  # alice's correction, reloaded; nothing lost
    shot(b, "conflict")
    a.context.close()
    b.context.close()


def test_model_server_going_away_mid_stream(browser, bpe_dir, bpe_model, tmp_path):
    import httpx

    from shoal.annotate.model import OpenAIModel
    from shoal.annotate.tree import AnnotationStore

    from .conftest import AppServer, ScriptedServer

    model_server = ScriptedServer(bpe_dir)
    store = AnnotationStore(tmp_path / "a.db")
    store.add_item("p", {"text": "The agent reads"}, title="The agent reads")
    store.tokens = {"alice": store.add_annotator("alice")}  # type: ignore[attr-defined]
    store.assign("alice", store.items())
    remote = OpenAIModel(model_server.url, bpe_model.name, bpe_model.tokenizer)
    server = AppServer(store, remote, k=5, max_tokens=60)
    try:
        page = login(browser, server, "alice")
        page.goto(f"{server.url}/item/p")
        expect(page.locator("#status")).to_have_text("loaded", timeout=30000)
        httpx.post(f"{model_server.url}/admin/token_delay", json={"seconds": 0.25})
        page.click('#resp .tok[data-i="1"]')
        page.locator("#cands li").nth(1).click()
        expect(page.locator("#resp .tok.new").first).to_be_visible(timeout=30000)
        threading.Thread(target=model_server.stop).start()
        expect(page.locator("#status")).to_contain_text("model server failed after", timeout=30000)
        shot(page, "server-gone")
        saved = int(page.locator("#status").inner_text().split("failed after ")[1].split(" ")[0])
        tree = store.tree("p")  # what arrived before the server went away is saved, and said so
        assert tree is not None and len(tree.nodes) == 2 and len(tree.nodes[1].tokens) == 2 + saved >= 3
        page.reload()  # the page comes back with everything saved; scoring now fails clearly
        expect(page.locator("#status")).to_contain_text("failed", timeout=30000)
        page.context.close()
    finally:
        server.stop()
        model_server.stop()
        remote.close()
        store.close()



def test_an_episode_step_with_multibyte_text_renders_token_for_token(browser, bpe_model, tmp_path):
    from shoal.annotate.app import episode_items
    from shoal.annotate.tree import AnnotationStore

    from .conftest import AppServer

    record = {"episode_id": "ep", "instance_id": "shoal-demo", "messages": [
        {"role": "user", "content": "Fix 🐟"},
        {"role": "assistant", "content": "Tests pass 🎉 沙箱", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "sh", "arguments": "ls"}}]},
        {"role": "tool", "content": "3 passed"}]}
    store = AnnotationStore(tmp_path / "a.db")
    for it in episode_items(record, "ep"):
        store.add_item(it["id"], it["prompt"], kind="episode", title=it["title"], response=it["response"],
                       meta=it["meta"])
    store.tokens = {"alice": store.add_annotator("alice")}  # type: ignore[attr-defined]
    store.assign("alice", store.items())
    server = AppServer(store, bpe_model, k=5, max_tokens=30)
    try:
        page = login(browser, server, "alice")
        page.goto(f"{server.url}/item/ep-step0")
        expect(page.locator("#status")).to_have_text("loaded", timeout=30000)
        text = resp_text(page)
        assert text.startswith("Tests pass 🎉 沙箱\n<tool_call>") and text.endswith("</tool_call>")
        n = page.locator("#resp .tok").count()
        assert n == len(bpe_model.tokenizer.encode(text)) > len(text.split())  # one span per model token
        assert page.locator("#resp .tok.empty").count() >= 1  # a token holding only part of a character
        expect(page.locator("#after .msg")).to_have_count(1)
        page.click('#resp .tok[data-i="3"]')
        expect(page.locator("#cands li")).to_have_count(5)
        shot(page, "episode")
        page.context.close()
    finally:
        server.stop()
        store.close()


@pytest.mark.slow
def test_an_agent_step_corrected_run_in_a_branch_and_continued(browser, host, base_image, bpe_long_model, tmp_path):
    """The page on an episode step: type a corrected command into the tool call, press x; the call
    runs in a branch of the episode in a real sandbox, its output appears, and the model continues."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from shoal.annotate.agent import EpisodeEnv
    from shoal.annotate.app import episode_items
    from shoal.annotate.tree import AnnotationStore
    from shoal.rollout.episode import run_episode
    from shoal.rollout.policy import ScriptPolicy
    from shoal.trajlog import TrajectoryLog

    from .conftest import AppServer
    from .test_agent import ShellTask, call_text, cut_at

    log = TrajectoryLog(tmp_path / "traj.db")
    task = ShellTask(base_image)
    script = [["create_file", {"path": "/work/a.txt", "content": "hello\n"}], ["shell", {"command": "cat /work/a.txt"}]]
    with ThreadPoolExecutor(1) as pool:  # Playwright's sync API holds this thread's event loop
        rec = pool.submit(asyncio.run, run_episode(task, ScriptPolicy(script), log, host, "ep", max_steps=4)).result()
    store = AnnotationStore(tmp_path / "a.db")
    for it in episode_items(rec.to_dict(), "ep"):
        store.add_item(it["id"], it["prompt"], kind="episode", title=it["title"], response=it["response"],
                       meta=it["meta"])
    store.tokens = {"alice": store.add_annotator("alice")}  # type: ignore[attr-defined]
    store.assign("alice", store.items())
    server = AppServer(store, bpe_long_model, k=5, max_tokens=12, env=EpisodeEnv(log, host, lambda item: task))
    try:
        page = login(browser, server, "alice")
        page.goto(f"{server.url}/item/ep-step1")
        expect(page.locator("#status")).to_have_text("loaded", timeout=30000)
        expect(page.locator("#after h4")).to_contain_text("press x")
        toks = [{"text": t} for t in page.locator("#resp .tok").all_text_contents()]
        text = "".join(t["text"] for t in toks)
        pos, lead = cut_at(toks, text, "cat /work/a.txt")
        fixed = call_text("ls /work && echo marker-$((6*7))")
        page.click(f'#resp .tok[data-i="{pos}"]')
        page.keyboard.press("t")
        page.fill("#typed", lead + fixed[fixed.index("ls /work"):])
        page.keyboard.press("Enter")
        expect(page.locator("#status")).to_contain_text("corrected at token", timeout=30000)
        page.keyboard.press("x")
        expect(page.locator("#status")).to_contain_text("ran in branch ep.a2.", timeout=60000)
        out = "".join(page.locator("#resp .tok.o").all_text_contents())
        assert "a.txt" in out and "marker-42" in out
        assert page.locator("#resp .tok.g").count() > 0  # the model went on after the output
        expect(page.locator("#tree li")).to_have_count(3)  # root, the correction, the tool step
        shot(page, "agent-branch")
        page.context.close()
    finally:
        server.stop()
        store.close()
