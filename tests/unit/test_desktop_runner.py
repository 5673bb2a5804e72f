"""The desktop runner's pure parts against hand-computed values: click accuracy from an
accessibility tree, typing errors, step parsing (annotations, replies of vision models), the
vision request (blob references, images only where asked), the PNG check the scripted server
applies, synthetic step labels and the agreement metrics over them, and the blob store."""
from __future__ import annotations

import base64
import json
import struct
import zlib

import pytest
from fastapi.testclient import TestClient

from shoal.core.errors import InvalidArgument
from shoal.rollout.scripted_server import make_app
from shoal.tasks.desktop import agreement
from shoal.tasks.desktop.failure import click_accuracy, click_hit, edit_distance, typing_errors, under
from shoal.tasks.desktop.policies import _expand, _vision_messages, oracle_steps, parse_reply
from shoal.tasks.desktop.runner import to_step
from shoal.tasks.desktop.scripted import check_png, judge_verdict
from shoal.tasks.desktop.task import load_suite
from shoal.trajlog import blobs


def _node(role, name, bounds, *children):
    return {"role": role, "name": name, "bounds": bounds, "children": list(children)}


# a window 0,0 800x600 with a toolbar holding two buttons; the "Save" button has a label child
TREE = _node("application", "mousepad", None,
             _node("frame", "notes.txt - Mousepad", [0, 0, 800, 600],
                   _node("tool bar", "", [0, 30, 800, 40],
                         _node("push button", "Open", [10, 35, 60, 30]),
                         _node("push button", "Save", [80, 35, 60, 30], _node("label", "Save", [90, 40, 40, 20]))),
                   _node("text", "", [0, 70, 800, 530])))


def test_click_hit_by_hand():
    save = {"role": "push button", "name": "Save"}
    # on the button's label: the deepest node is the label; its parent is the target -> a hit
    r = click_hit(TREE, 100, 50, save)
    assert r == {"hit": True, "under": {"role": "label", "name": "Save"}, "target_found": True, "distance": 0.0}
    # on the button but beside the label (x=82): the button itself
    assert click_hit(TREE, 82, 36, save)["under"] == {"role": "push button", "name": "Save"}
    # on "Open" (x=40): a miss; the nearest Save bounds start at x=80 -> 40 px away
    r = click_hit(TREE, 40, 50, save)
    assert not r["hit"] and r["under"]["name"] == "Open" and r["distance"] == 40.0
    # below-left of Save: dx = 80-70 = 10, dy = 100-64 = 36 -> sqrt(100+1296)
    assert click_hit(TREE, 70, 100, save)["distance"] == pytest.approx((10 ** 2 + 36 ** 2) ** 0.5)
    # the right edge is exclusive: x = 80 + 60 is outside the button
    assert not click_hit(TREE, 140, 50, save)["hit"]
    # a name only, case and spaces ignored
    assert click_hit(TREE, 100, 50, {"name": "  save "})["hit"]
    # a target not in the tree; a point on no node at all
    r = click_hit(TREE, 100, 50, {"role": "menu", "name": "File"})
    assert not r["hit"] and not r["target_found"] and r["distance"] is None
    assert click_hit(TREE, 900, 900, save)["under"] is None and under(TREE, 900, 900) == []
    with pytest.raises(InvalidArgument):
        click_hit(TREE, 1, 1, {"label": "x"})
    assert click_accuracy([{"hit": True, "target_found": True}, {"hit": False, "target_found": False},
                           {"hit": False, "target_found": True}]) == \
        {"clicks": 3, "hits": 1, "accuracy": 1 / 3, "target_missing": 1}
    assert click_accuracy([])["accuracy"] is None


def test_typing_errors_by_hand():
    assert edit_distance("kitten", "sitting") == 3 and edit_distance("", "abc") == 3 and edit_distance("ab", "ab") == 0
    assert edit_distance("cal mom", "call mom") == 1 and edit_distance("héllo ✓", "hello ✓") == 1
    r = typing_errors([("buy milk\n", "buy milk\n"), ("cal mom\n", "call mom\n"), ("teh", "the")])
    assert r == {"steps": 3, "steps_with_errors": 2, "edits": 3, "chars": 9 + 9 + 3, "rate": 3 / 21}
    assert typing_errors([])["rate"] is None


def test_steps_and_replies():
    s = to_step({"code": "pyautogui.click(10, 20)  # target: push button \"Save\""})
    assert s.target == {"role": "push button", "name": "Save"} and s.click_point() == (10, 20)
    s = to_step({"action": {"action": "type", "text": "cal mom", "intended": "call mom"}})
    assert s.run == {"action": "type", "text": "cal mom"} and s.intended == "call mom" and s.typed() == "cal mom"
    s = to_step({"code": "pyautogui.write('teh')  # intended: \"the\""})
    assert s.intended == "the" and s.typed() == "teh" and s.click_point() is None
    assert to_step({"action": {"launch": "editor", "args": ["/root/a"]}}).actions() == []
    for bad in ({"code": "x", "action": {}}, {}, {"code": 1}, {"action": "click"}, {"code": "x", "junk": 1},
                {"code": "pyautogui.click(1, 2)", "target": {"role": 3}}):
        with pytest.raises(InvalidArgument):
            to_step(bad)
    assert parse_reply("I will save.\n```python\npyautogui.hotkey('ctrl', 's')\n```") == \
        {"code": "pyautogui.hotkey('ctrl', 's')"}
    assert parse_reply('{"action": "click", "x": 1, "y": 2, "target": {"name": "OK"}}') == \
        {"action": {"action": "click", "x": 1, "y": 2}, "target": {"name": "OK"}}
    assert parse_reply('{"launch": "editor"}') == {"action": {"launch": "editor"}}
    assert parse_reply("DONE") is None and parse_reply("```\nFAIL\n```") is None
    assert parse_reply("rm -rf /") == {"code": "rm -rf /"}  # the tool refuses it: never executed


def test_oracle_steps_with_detours_typos_and_cut():
    task = next(t for t in load_suite() if t.id == "editor-append-and-save")
    steps = oracle_steps(task, detours={2: ["WAIT"], 10: ["WAIT", "WAIT"]}, typos={5: "cal mom\n"}, cut=0)
    assert len(steps) == 10 + 3 and steps[2] == {"code": "WAIT"}
    assert steps[3] == {"action": {"action": "type", "text": "buy milk\n"}, "intended": "buy milk\n"}
    assert steps[6] == {"action": {"action": "type", "text": "cal mom\n"}, "intended": "call mom\n"}
    assert len(oracle_steps(task, cut=2)) == 8


def _png(w=3, h=2, colour=2):
    raw = b"".join(b"\x00" + bytes(range(w * 3)) for _ in range(h))

    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, colour, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def test_png_check():
    assert check_png(_png()) == (3, 2)
    good = _png()
    bad_crc = good[:-5] + bytes([good[-5] ^ 1]) + good[-4:]
    for bad in (b"GIF89a", good[:-12], bad_crc, _png(colour=6)):  # RGBA declared, RGB data: wrong size
        with pytest.raises(InvalidArgument):
            check_png(bad)


def test_scripted_server_refuses_requests_without_a_real_png():
    task = next(t for t in load_suite() if t.id == "editor-append-and-save")
    c = TestClient(make_app())

    def ask(data: bytes):
        url = "data:image/png;base64," + base64.b64encode(data).decode()
        return c.post("/v1/chat/completions", json={"model": "desktop-oracle", "messages": [
            {"role": "user", "content": task.instruction},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]})

    r = ask(_png())
    assert r.status_code == 200 and json.loads(r.json()["choices"][0]["message"]["content"])["launch"] == "editor"
    assert ask(b"\x89PNG\r\n\x1a\nnot really").status_code == 400
    assert ask(_png()[:-12]).status_code == 400
    r = c.post("/v1/chat/completions", json={"model": "desktop-oracle", "messages": [
        {"role": "user", "content": task.instruction}]})
    assert r.status_code == 400 and "no image_url" in r.text


def test_vision_messages_keep_the_newest_screenshots_as_blob_refs(tmp_path):
    bs = blobs.BlobStore(tmp_path / "b")
    blobs._open[bs.root.resolve()] = bs
    d1, d2 = bs.put(_png(2, 2)), bs.put(_png(3, 2))
    assert d1 != d2 and bs.put(_png(2, 2)) == d1 and bs.get(d1) == _png(2, 2)
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "do it"},
            {"role": "assistant", "content": "", "tool_calls": [{}]},
            {"role": "tool", "content": f"screenshot {d1} 2x2"},
            {"role": "assistant", "content": "```python\npyautogui.click(1, 1)\n```", "tool_calls": [{}]},
            {"role": "tool", "content": f"ok\nscreenshot {d2}"}]
    out = _vision_messages(msgs, images=1)
    assert [m["role"] for m in out] == ["system", "user", "user", "assistant", "user"]
    assert out[2]["content"] == "Result: 2x2. (screenshot omitted)"
    assert out[4]["content"][1] == {"type": "image_url", "image_url": {"url": f"shoal-blob:{d2}"}}
    body = _expand({"messages": out})
    url = body["messages"][4]["content"][1]["image_url"]["url"]
    assert base64.b64decode(url.split(",", 1)[1]) == _png(3, 2)
    assert len([m for m in _vision_messages(msgs, images=2) if isinstance(m["content"], list)]) == 2
    with pytest.raises(InvalidArgument):
        bs.get("sha256:" + "0" * 64)
    (bs.root / d1[7:9] / d1[7:]).write_bytes(b"tampered")
    with pytest.raises(InvalidArgument, match="does not match"):
        bs.get(d1)
    with pytest.raises(InvalidArgument):
        bs.get("../../etc/passwd")


def test_synthetic_labels_and_agreement_by_hand():
    task = next(t for t in load_suite() if t.id == "editor-append-and-save")
    # the clean oracle: step 0 opens, 2 types, 3 saves, 6 saves the second line, 9 sees the editor gone
    omap = [["open"], [], ["typed"], ["saved"], [], [], ["second"], [], [], ["quit"]]
    plan = agreement.Plan(task.id, "p", detours={1: ["WAIT", "WAIT"]}, typos={5: "cal mom\n"}, cut=2)
    steps = agreement.step_labels(task, plan, omap)
    # oracle 0, the 2 detours, oracle 1..7 (5 is the typo: it and all after it advance nothing)
    assert steps == [["open"], [], [], [], ["typed"], ["saved"], [], [], [], []]
    assert agreement.subgoal_labels(task, steps) == [True, True, True, False, False]
    assert agreement.step_labels(task, agreement.Plan(task.id, "cut", cut=4), omap)[-1] == []
    # one step fulfilling a chain (typed, then saved, which depends on it) labels both
    chain = [["open"], [], ["typed", "saved"], [], [], [], ["second"], [], [], ["quit"]]
    assert agreement.step_labels(task, agreement.Plan(task.id, "c"), chain)[2] == ["typed", "saved"]
    # two episodes of 5 subgoals: the judge misses one subgoal the labels have
    human = [[True, True, True, False, False], [True] * 5]
    judge = [[True, True, False, False, False], [True] * 5]
    a = agreement.agreement(human, judge, n_boot=500)
    assert a["one_minus_mae"] == pytest.approx(100 * (1 - (0.2 + 0) / 2))  # 90.0
    # pooled: 10 items, 9 agree; p_o = 0.9, judge yes 7/10, labels yes 8/10:
    # p_e = 0.7*0.8 + 0.3*0.2 = 0.62 -> kappa = (0.9 - 0.62) / 0.38
    assert a["kappa"] == pytest.approx(0.28 / 0.38)
    lo, hi = a["one_minus_mae_ci"]
    assert 80.0 <= lo <= 90.0 <= hi <= 100.0
    assert a["subgoal_agreement"] == 0.9


def test_scripted_judge_rule():
    task = next(t for t in load_suite() if t.id == "editor-append-and-save")
    full = list(task.oracle)
    assert all(judge_verdict(task, g.id, full) for g in task.subgoals)
    # the first 4 oracle steps: subgoal k of 5 needs ceil(k/5*10) = 2k steps -> open, typed
    assert [judge_verdict(task, g.id, ["WAIT", *full[:4]]) for g in task.subgoals] == [True, True, False, False, False]
    assert parse_verdict_cases()


def parse_verdict_cases() -> bool:
    assert agreement.parse_verdict('{"fulfilled": true}') is True
    assert agreement.parse_verdict('Sure. {"fulfilled": false}') is False
    assert agreement.parse_verdict("Yes.") is True
    with pytest.raises(InvalidArgument):
        agreement.parse_verdict("maybe")
    return True
