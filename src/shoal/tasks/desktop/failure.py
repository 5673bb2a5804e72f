"""Failure modes of a desktop episode besides drift (metrics.drift): click accuracy and typing errors.

**Click accuracy.** A click is scored only when its step names the element it means to hit, its
*target* `{"role": ..., "name": ...}` (either may be left out; compared case-insensitively, names
with surrounding whitespace trimmed). Oracle steps and scripted policies name targets in the step
(`{"action": "click", "x": .., "y": .., "target": {...}}`, or `{"code": "pyautogui.click(..)",
"target": {...}}`); a vision policy names one in its reply (a `# target: <role> "<name>"` comment or
a "target" key). The element *under* the click is read from the accessibility tree taken at click
time, just before the click runs: the deepest node whose screen bounds contain the point (of
equally deep ones, the last in document order, which toolkits draw on top). The click *hit* when
that node or one of its ancestors matches the target: a click on a button's label is a click on the
button. For a miss we also say whether the target was in the tree at all, and how far the click was
from the nearest matching node's bounds (0 when inside).

**Typing errors.** A typing step may name the text it *intended* (`"intended": "call mom\\n"`);
the oracle's own typing steps intend what they type. An error is a character edit (Levenshtein:
insert, delete, substitute) between the typed and the intended text; the rate is edits over
intended characters, summed over the episode's typing steps that name an intention.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from ...core.errors import InvalidArgument

CLICK_ACTIONS = ("click", "double_click", "triple_click", "right_click", "middle_click", "mouse_down")


def _norm(s: object) -> str:
    return " ".join(str(s or "").split()).lower()


def check_target(target: Any) -> dict[str, str]:
    if not isinstance(target, dict) or not set(target) <= {"role", "name"} or not (target.get("role")
                                                                                   or target.get("name")):
        raise InvalidArgument(f"a click target is {{'role': ..., 'name': ...}} (at least one), got {target!r}")
    if not all(isinstance(v, str) for v in target.values()):
        raise InvalidArgument(f"a click target's role and name are strings, got {target!r}")
    return {k: str(v) for k, v in target.items()}


def matches(node: dict, target: dict) -> bool:
    return all(_norm(node.get(k)) == _norm(v) for k, v in target.items() if v)


def _inside(b: Sequence[int] | None, x: int, y: int) -> bool:
    return bool(b) and b is not None and len(b) == 4 and b[2] > 0 and b[3] > 0 and \
        b[0] <= x < b[0] + b[2] and b[1] <= y < b[1] + b[3]


def _distance(b: Sequence[int], x: int, y: int) -> float:
    dx = max(b[0] - x, 0, x - (b[0] + b[2] - 1))
    dy = max(b[1] - y, 0, y - (b[1] + b[3] - 1))
    return float((dx * dx + dy * dy) ** 0.5)


def under(tree: dict, x: int, y: int) -> list[dict]:
    """The path from the root to the deepest node whose bounds contain (x, y) (the last such of
    equal depth); empty when no node contains it. Nodes without bounds are passed through."""
    best: list[dict] = []

    def walk(node: dict, path: list[dict]) -> None:
        nonlocal best
        here = path + [node]
        if _inside(node.get("bounds"), x, y) and len(here) >= len(best):
            best = here
        for ch in node.get("children") or []:
            walk(ch, here)

    walk(tree, [])
    return best


def click_hit(tree: dict, x: int, y: int, target: dict) -> dict:
    """Score one click against the accessibility tree taken at click time (plain dicts: an A11yNode's
    model_dump()). {"hit", "under": {role, name} | None, "target_found", "distance"}."""
    target = check_target(target)
    path = under(tree, x, y)
    found: list[Sequence[int]] = []

    def collect(node: dict) -> None:
        if matches(node, target) and node.get("bounds") and len(node["bounds"]) == 4:
            found.append(node["bounds"])
        for ch in node.get("children") or []:
            collect(ch)

    collect(tree)
    hit = any(matches(n, target) for n in path)
    dist = 0.0 if hit else min((_distance(b, x, y) for b in found), default=None)
    top = path[-1] if path else None
    return {"hit": hit, "under": {"role": top.get("role", ""), "name": top.get("name", "")} if top else None,
            "target_found": bool(found), "distance": dist}


def click_accuracy(clicks: Iterable[dict]) -> dict:
    """Over scored clicks (click_hit results): how many, how many hit, the accuracy (None if none)."""
    xs = list(clicks)
    hits = sum(1 for c in xs if c["hit"])
    return {"clicks": len(xs), "hits": hits, "accuracy": hits / len(xs) if xs else None,
            "target_missing": sum(1 for c in xs if not c["target_found"])}


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (unit cost insert, delete, substitute)."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def typing_errors(pairs: Iterable[tuple[str, str]]) -> dict:
    """Over (typed, intended) pairs: steps, steps with an error, character edits, intended characters,
    and the error rate (edits / intended characters; None if nothing was intended)."""
    steps = wrong = edits = chars = 0
    for typed, intended in pairs:
        d = edit_distance(typed, intended)
        steps += 1
        wrong += d > 0
        edits += d
        chars += len(intended)
    return {"steps": steps, "steps_with_errors": wrong, "edits": edits, "chars": chars,
            "rate": edits / chars if chars else None}
