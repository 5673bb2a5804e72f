"""The bundled desktop suite without a sandbox (fast, every task): it meets issue 18's bar, every task
is well formed (subgoals with programmatic checks, dependencies on earlier subgoals, oracle steps
that parse, apps it launches are its own), and `suite_problems` names what a short suite misses."""
from __future__ import annotations

import hashlib

import pytest

from shoal.core.errors import InvalidArgument
from shoal.desktop.actions import DesktopAction, parse_pyautogui
from shoal.envs.desktop import APPS
from shoal.tasks.desktop.task import BrowserDom, SetupLaunch, load_suite, load_task
from shoal.tasks.desktop.validation import suite_figures, suite_problems

SUITE = load_suite()


def test_the_suite_meets_the_bar():
    f = suite_figures(SUITE)
    assert suite_problems(SUITE) == []
    assert f["tasks"] >= 24 and len(f["apps"]) >= 4 and f["mean_subgoals"] >= 5
    assert all(n > 0 for n in f["by_category"].values())
    assert f["coordination_3apps"] >= 6 and f["variant_tasks"] >= 6
    # Coordination tasks over 3+ apps span at least 3 apps between them, and every app has Robustness tasks but one
    coord_apps = {a for t in SUITE if t.category == "Coordination" and len(t.apps) >= 3 for a in t.apps}
    assert len(coord_apps) >= 3
    assert all(t.variant for t in SUITE if t.category == "Robustness")


def test_suite_problems_name_what_is_missing():
    short = [t for t in SUITE if t.category != "Coordination"][:10]
    problems = "\n".join(suite_problems(short))
    assert "10 tasks, fewer than 24" in problems and "Coordination" in problems and "Robustness variant" in problems
    assert "task ids repeat" in "\n".join(suite_problems(SUITE + SUITE[:1]))


@pytest.mark.parametrize("task", SUITE, ids=[t.id for t in SUITE])
def test_every_task_is_well_formed(task):
    assert set(task.apps) <= set(APPS), task.apps
    assert len(task.subgoals) >= 3 and all(g.check is not None for g in task.subgoals)
    # ordered, dependent subgoals: each after the first depends on an earlier one
    assert all(g.depends_on for g in task.subgoals[1:])
    if any(isinstance(g.check, BrowserDom) for g in task.subgoals):
        assert "browser" in task.apps
    launched = [s.app for s in task.setup if isinstance(s, SetupLaunch)]
    for step in task.oracle:
        if isinstance(step, str):
            parse_pyautogui(step)  # raises on anything that is not a plain pyautogui call
        elif "launch" in step:
            launched.append(step["launch"])
        elif "focus" in step or "wait_for_window" in step:
            assert isinstance(step.get("focus", step.get("wait_for_window")), str)
        else:
            DesktopAction.model_validate(step)
    assert set(launched) == set(task.apps), (launched, task.apps)  # it uses every app it names, and only those
    assert task.instruction.strip() and task.id.replace("-", "").isalnum()


def test_browser_dom_schema():
    base = {"id": "t", "instruction": "x", "category": "Diversity", "apps": ["browser"]}
    ok = {"type": "browser_dom", "selector": "#status", "equals": "Done.", "url": "file:///root/site/page.html"}
    t = load_task({**base, "subgoals": [{"id": "a", "description": "a", "check": ok}]})
    assert isinstance(t.subgoals[0].check, BrowserDom) and t.subgoals[0].check.prop == "textContent"
    assert t.subgoals[0].check.page_sha256 is None  # no setup file at that path: nothing to pin
    page = "<p id=status>Done.</p>"
    t = load_task({**base, "setup": [{"type": "file", "path": "/root/site/page.html", "content": page}],
                   "subgoals": [{"id": "a", "description": "a", "check": ok},
                                {"id": "b", "description": "b", "check": {**ok, "page_editable": True}}]})
    assert t.subgoals[0].check.page_sha256 == hashlib.sha256(page.encode()).hexdigest()
    assert t.subgoals[1].check.page_sha256 is None
    for bad in ({**ok, "script": "alert(1)"}, {"type": "browser_dom"}, {**ok, "selector": 3},
                {**ok, "page_sha256": "not a digest"}):
        with pytest.raises(InvalidArgument):
            load_task({**base, "subgoals": [{"id": "a", "description": "a", "check": bad}]})
    # every check names the page it grades, by a page URL: never "the first tab", a substring, or a
    # scheme whose content the agent writes itself
    no_url = {k: v for k, v in ok.items() if k != "url"}
    for bad in (no_url, *({**ok, "url": u} for u in (
            "", "page.html", "data:text/html,<p id=status>Done.", "javascript:document.title", "blob:file:///x",
            "about:blank", "view-source:file:///root/site/page.html"))):
        with pytest.raises(InvalidArgument, match="url"):
            load_task({**base, "subgoals": [{"id": "a", "description": "a", "check": bad}]})


def test_page_key_matches_the_page_exactly():
    from shoal.tasks.desktop.browser import page_key

    page = page_key("file:///root/site/code.html")
    assert page == ("file", "", "/root/site/code.html")
    assert page_key("file:///root/site/code.html#done") == page  # a fragment is the same page
    assert page_key("FILE:///root/site/code%2Ehtml") == page
    for other in ("file:///tmp/root/site/code.html", "file:///root/site/code.html.evil.html",
                  "file:///root/site/code.htm", "http://127.0.0.1/root/site/code.html"):
        assert page_key(other) != page, other
    for refused in ("data:text/html,<p>file:///root/site/code.html</p>", "javascript:'file:///root/site/code.html'",
                    "blob:file:///root/site/code.html", "about:blank", "chrome-error://chromewebdata/", "",
                    "code.html"):
        assert page_key(refused) is None, refused


@pytest.mark.parametrize("task", [t for t in SUITE if any(isinstance(g.check, BrowserDom) for g in t.subgoals)],
                         ids=lambda t: t.id)
def test_browser_checks_grade_a_page_the_task_writes(task):
    """Each browser_dom check's page is a file the task's own setup writes (not a page the agent could
    choose), and the oracle or the setup opens a page of the task."""
    from shoal.tasks.desktop.task import SetupFile

    written = {f"file://{s.path}": hashlib.sha256(s.content.encode()).hexdigest() for s in task.setup
               if isinstance(s, SetupFile)}
    for g in task.subgoals:
        if isinstance(g.check, BrowserDom):
            assert g.check.url in written, (g.id, g.check.url)
            # graded only as the setup wrote it, unless the task is to edit the page (one task)
            assert g.check.page_sha256 == (None if g.check.page_editable else written[g.check.url]), g.id
            assert not g.check.page_editable or task.id == "coord-edit-web-page", g.id


def test_devtools_frames_from_a_hostile_page_are_bounded():
    """The checker's WebSocket reader over a real socket pair: fragments join, pings are answered,
    and a frame or message larger than MAX_BODY is refused before it is read."""
    import socket
    import struct
    import time

    from shoal.tasks.desktop.browser import MAX_BODY, BrowserUnavailable, _ws_messages

    a, b = socket.socketpair()
    try:
        a.settimeout(5)
        b.sendall(bytes([0x01, 3]) + b'{"i' + bytes([0x89, 2]) + b"hi" + bytes([0x80, 8]) + b'd": 1}  ')
        msgs = _ws_messages(a, bytearray(), time.monotonic() + 5)
        assert next(msgs) == b'{"id": 1}  '
        pong = b.recv(64)
        assert pong[0] == 0x8A and pong[1] == 0x80 | 2  # masked, as a client's frames must be
        b.sendall(bytes([0x81, 127]) + struct.pack(">Q", MAX_BODY + 1))
        with pytest.raises(BrowserUnavailable, match="oversized frame"):
            next(_ws_messages(a, bytearray(), time.monotonic() + 5))
        b.sendall(bytes([0x88, 0]))
        with pytest.raises(BrowserUnavailable, match="closed"):
            next(_ws_messages(a, bytearray(), time.monotonic() + 5))
    finally:
        a.close()
        b.close()
