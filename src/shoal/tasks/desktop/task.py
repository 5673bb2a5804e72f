"""Process-level desktop tasks (issue 18 section 2): a task JSON with ordered subgoals and their
dependencies, programmatic checkers run against the sandbox, and scoring.

    {"id": "editor-note", "instruction": "...", "category": "Diversity", "apps": ["editor"],
     "variant": false,
     "setup": [{"type": "file", "path": "/root/todo.txt", "content": "..."},
               {"type": "launch", "app": "editor", "args": ["/root/todo.txt"], "window": "todo"}],
     "subgoals": [{"id": "open", "description": "...", "depends_on": [],
                   "check": {"type": "window", "title": "todo.txt"}, "rubric": "..."}, ...],
     "oracle": ["pyautogui.hotkey('ctrl', 'end')", {"action": "type", "text": "..."}, ...]}

A subgoal is fulfilled when its check passes *and* every subgoal it depends on is fulfilled, so a
step done out of order does not count. Checks are probes of state inside the sandbox (files,
windows, the accessibility tree, a spreadsheet cell, a command's output); a `rubric` is what an
LLM judge reads for subgoals without a probe. The oracle is an action list (pyautogui strings,
DesktopAction dicts, or {"launch": app, "args": [...]}) that fulfils every subgoal."""
from __future__ import annotations

import csv
import hashlib
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ...core.errors import InvalidArgument, ShoalError
from ...sdk.sandbox import Sandbox
from .browser import page_key

Category = Literal["Diversity", "Coordination", "Robustness"]


class _M(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FileContains(_M):
    type: Literal["file_contains"]
    path: str
    text: str


class FileLacks(_M):
    type: Literal["file_lacks"]
    path: str
    text: str


class FileExists(_M):
    type: Literal["file_exists"]
    path: str


class WindowCheck(_M):
    type: Literal["window"]
    title: str  # a window whose title contains this (case-insensitive)
    focused: bool = False


class A11yText(_M):
    type: Literal["a11y_text"]
    contains: str  # some text widget's text contains this


class SpreadsheetCell(_M):
    type: Literal["spreadsheet_cell"]
    path: str  # a workbook gnumeric can read (ssconvert in the sandbox turns it into CSV)
    cell: str  # "B2"
    value: str


class CommandCheck(_M):
    type: Literal["command"]
    cmd: str
    stdout_contains: str = ""


class BrowserDom(_M):
    """A DOM property of the browser's page, read through Chromium's DevTools port (browser.py)."""

    type: Literal["browser_dom"]
    selector: str  # CSS selector; the first match
    prop: str = "textContent"  # e.g. value, checked, textContent, href
    text: str = ""  # String(element[prop]) contains this
    equals: str | None = None  # ... or equals this exactly
    # the page graded: the target whose URL is this one (scheme, host, path; browser.page_key), so a
    # data:/javascript: tab the agent opens beside it is never read
    url: str
    # a file:// page is graded only as the task wrote it: the document Chromium shows must be the file
    # unchanged since it loaded, and the file must hold these bytes (filled in from the task's setup
    # file at that path); `page_editable` tasks (the agent edits the page on purpose) skip the digest
    page_editable: bool = False
    page_sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")

    @field_validator("url")
    @classmethod
    def _page_url(cls, v: str) -> str:
        if page_key(v) is None:
            raise ValueError(f"url {v[:200]!r}: a browser_dom check names its page by a file://, http:// or "
                             "https:// URL with a path")
        return v


Check = Annotated[FileContains | FileLacks | FileExists | WindowCheck | A11yText | SpreadsheetCell | CommandCheck
                  | BrowserDom, Field(discriminator="type")]


class Subgoal(_M):
    id: str
    description: str
    depends_on: list[str] = []
    check: Check | None = None
    rubric: str = ""  # for an LLM judge; required when there is no check


class SetupFile(_M):
    type: Literal["file"]
    path: str
    content: str


class SetupLaunch(_M):
    type: Literal["launch"]
    app: str
    args: list[str] = []
    window: str = ""  # wait for a window titled like this


Setup = Annotated[SetupFile | SetupLaunch, Field(discriminator="type")]


class DesktopTask(_M):
    id: str
    instruction: str
    category: Category
    apps: list[str]
    variant: bool = False  # the Robustness variant's layer
    setup: list[Setup] = []
    subgoals: list[Subgoal]
    oracle: list[Any] = []

    @model_validator(mode="after")
    def _ordered(self) -> DesktopTask:
        seen: set[str] = set()
        for g in self.subgoals:
            if g.id in seen:
                raise ValueError(f"subgoal id {g.id!r} repeats")
            missing = [d for d in g.depends_on if d not in seen]
            if missing:
                raise ValueError(f"subgoal {g.id!r} depends on {missing}, which are not earlier subgoals")
            if g.check is None and not g.rubric:
                raise ValueError(f"subgoal {g.id!r} has neither a check nor a rubric")
            seen.add(g.id)
        if not self.subgoals:
            raise ValueError("a task needs at least one subgoal")
        written = {f.path: hashlib.sha256(f.content.encode()).hexdigest() for f in self.setup
                   if isinstance(f, SetupFile)}
        for g in self.subgoals:
            c = g.check
            if isinstance(c, BrowserDom) and not c.page_editable and c.page_sha256 is None:
                key = page_key(c.url)
                if key is not None and key[0] == "file" and key[2] in written:
                    c.page_sha256 = written[key[2]]
        return self


def load_task(data: dict | str) -> DesktopTask:
    try:
        return DesktopTask.model_validate_json(data) if isinstance(data, str) else DesktopTask.model_validate(data)
    except ValidationError as e:
        from ...host import describe

        raise InvalidArgument(f"desktop task: {describe(e)}") from None


SUITE = Path(__file__).with_name("suite.json")


def load_suite(path: Path = SUITE) -> list[DesktopTask]:
    return [load_task(t) for t in json.loads(path.read_text())]


# ------------------------------------------------------------------------------------- checkers
def _cell_index(cell: str) -> tuple[int, int]:
    import re

    m = re.fullmatch(r"([A-Za-z]{1,3})([1-9][0-9]{0,6})", cell)
    if not m:
        raise InvalidArgument(f"bad cell reference {cell!r}")
    c = 0
    for ch in m.group(1).upper():
        c = c * 26 + (ord(ch) - 64)
    return int(m.group(2)) - 1, c - 1


def _texts(node, out: list[str]) -> list[str]:
    if node.text:
        out.append(node.text)
    for ch in node.children:
        _texts(ch, out)
    return out


def check(sb: Sandbox, c: Any) -> bool:
    """Run one programmatic check against the sandbox's state now."""
    try:
        if isinstance(c, FileContains | FileLacks):
            text = sb.files.read(c.path) if sb.files.exists(c.path) else None
            if isinstance(c, FileLacks):
                return text is not None and c.text not in text
            return text is not None and c.text in text
        if isinstance(c, FileExists):
            return sb.files.exists(c.path)
        if isinstance(c, WindowCheck):
            return any(c.title.lower() in w.title.lower() and (w.focused or not c.focused)
                       for w in sb.desktop.windows())
        if isinstance(c, A11yText):
            return any(c.contains in t for t in _texts(sb.desktop.accessibility_tree(depth=30, max_nodes=20000), []))
        if isinstance(c, SpreadsheetCell):
            out = "/tmp/.shoal-check.csv"
            r = sb.commands.run(["ssconvert", "--export-type=Gnumeric_stf:stf_csv", c.path, out], timeout=60)
            if r.exit_code != 0:
                return False
            rows = list(csv.reader(io.StringIO(sb.files.read(out))))
            i, j = _cell_index(c.cell)
            return i < len(rows) and j < len(rows[i]) and rows[i][j].strip() == c.value
        if isinstance(c, CommandCheck):
            r = sb.commands.run(c.cmd, timeout=60)
            return r.exit_code == 0 and c.stdout_contains in r.stdout
        if isinstance(c, BrowserDom):
            from .browser import dom_property

            v = dom_property(sb, c.selector, c.prop, c.url, page_sha256=c.page_sha256)
            return v is not None and (v == c.equals if c.equals is not None else c.text in v)
    except ShoalError:
        return False
    raise InvalidArgument(f"unknown check {c!r}")


Judge = Any  # callable(task, subgoal, evidence) -> bool: an LLM judge for rubric-only subgoals


def evaluate(sb: Sandbox, task: DesktopTask, judge: Judge | None = None) -> list[bool]:
    """Each subgoal's fulfilment now: its check (or the judge on its rubric) and all its dependencies."""
    done: dict[str, bool] = {}
    for g in task.subgoals:
        if g.check is not None:
            ok = check(sb, g.check)
        elif judge is not None:
            ok = bool(judge(task, g, sb))
        else:
            ok = False
        done[g.id] = ok and all(done[d] for d in g.depends_on)
    return [done[g.id] for g in task.subgoals]


# --------------------------------------------------------------------------------------- scoring
@dataclass
class TaskScore:
    task: str
    category: str
    fulfilled: list[bool]

    @property
    def fraction(self) -> float:
        """Subgoals fulfilled / subgoals."""
        return sum(self.fulfilled) / len(self.fulfilled)

    @property
    def prefix(self) -> float:
        """Subgoals fulfilled in order before the first unfulfilled one / subgoals."""
        n = 0
        for f in self.fulfilled:
            if not f:
                break
            n += 1
        return n / len(self.fulfilled)

    @property
    def complete(self) -> bool:
        return all(self.fulfilled)


def by_category(scores: list[TaskScore]) -> dict[str, dict[str, float]]:
    """Per category: completion rate, mean fraction, mean ordered prefix, task count."""
    out: dict[str, dict[str, float]] = {}
    for cat in sorted({s.category for s in scores}):
        xs = [s for s in scores if s.category == cat]
        out[cat] = {"tasks": len(xs), "completion": sum(s.complete for s in xs) / len(xs),
                    "fraction": sum(s.fraction for s in xs) / len(xs), "prefix": sum(s.prefix for s in xs) / len(xs)}
    return out


# ----------------------------------------------------------------------------------- setup, oracle
def set_up(sb: Sandbox, task: DesktopTask) -> None:
    sb.desktop.start()
    for s in task.setup:
        if isinstance(s, SetupFile):
            sb.commands.run(["mkdir", "-p", str(Path(s.path).parent)], check=True)
            sb.files.write(s.path, s.content)
        else:
            sb.desktop.launch(s.app, s.args)
            if s.window:
                sb.desktop.wait_for_window(s.window, timeout=60)


def run_step(sb: Sandbox, step: Any) -> None:
    """One oracle / policy step: a pyautogui string, a DesktopAction dict, {"launch": app, "args": [...],
    "window": title}, {"focus": title} (raise and focus that window), or {"wait_for_window": title}."""
    if isinstance(step, str):
        sb.desktop.run_pyautogui(step)
    elif isinstance(step, dict) and "launch" in step:
        sb.desktop.launch(step["launch"], step.get("args", []))
        if step.get("window"):
            sb.desktop.wait_for_window(step["window"], timeout=60)
    elif isinstance(step, dict) and "focus" in step:  # raise and focus the window titled like this
        sb.desktop.activate(step["focus"])
    elif isinstance(step, dict) and "wait_for_window" in step:
        sb.desktop.wait_for_window(step["wait_for_window"], timeout=60)
    elif isinstance(step, dict):
        sb.desktop.act(step)
    else:
        raise InvalidArgument(f"unknown step {step!r}")


def open_task_sandbox(backend: Any, task: DesktopTask, **fields: Any) -> Sandbox:
    """A fresh desktop sandbox with the task's apps (and the Robustness variant), set up."""
    from ...envs.desktop import DESKTOP_IMAGE, desktop_layers
    from ...envs.sandboxes import open_sandbox

    fields.setdefault("memory_mb", 2048)
    fields.setdefault("disk_mb", 256)
    sb = open_sandbox(backend, DESKTOP_IMAGE, desktop_layers(task.apps, task.variant), **fields)
    try:
        set_up(sb, task)
    except BaseException:
        sb.kill()
        raise
    return sb


@dataclass
class Episode:
    """A process-level record: when each subgoal was first seen fulfilled (its step index, or None)."""

    task: DesktopTask
    steps: int
    fulfilled_at: list[int | None]
    actions: list[str] = field(default_factory=list)  # each step as text (the report's captions)
    shots: list[bytes] = field(default_factory=list)  # a PNG after each step, when recorded

    @property
    def score(self) -> TaskScore:
        return TaskScore(self.task.id, self.task.category, [t is not None for t in self.fulfilled_at])

    @property
    def advances(self) -> list[bool]:
        """Per step: did it fulfil some subgoal (the input of metrics.drift)."""
        hit = {t for t in self.fulfilled_at if t is not None}
        return [i in hit for i in range(self.steps)]


def track(sb: Sandbox, task: DesktopTask, steps: list[Any], judge: Judge | None = None,
          record: float | None = None) -> Episode:
    """Run `steps` one by one and check, after each, the subgoals whose dependencies are all
    fulfilled already (the frontier). A fulfilled subgoal stays fulfilled: a window closed later
    does not undo "the file was opened". A step done before its prerequisites does not count.
    record: keep a screenshot after each step at this scale (the HTML report's filmstrip)."""
    at: dict[str, int | None] = {g.id: None for g in task.subgoals}

    def sweep(i: int) -> None:
        progressed = True
        while progressed:  # one step may fulfil a chain (saved -> content -> ...)
            progressed = False
            for g in task.subgoals:
                if at[g.id] is not None or any(at[d] is None for d in g.depends_on):
                    continue
                ok = check(sb, g.check) if g.check is not None else bool(judge and judge(task, g, sb))
                if ok:
                    at[g.id] = i
                    progressed = True

    shots: list[bytes] = []
    for i, step in enumerate(steps):
        try:
            run_step(sb, step)
        except InvalidArgument:
            pass  # a malformed agent action is a wasted step, not the end of the episode
        sweep(i)
        if record is not None:
            shots.append(sb.desktop.screenshot(scale=record))
    return Episode(task, len(steps), [at[g.id] for g in task.subgoals],
                   [s if isinstance(s, str) else json.dumps(s, ensure_ascii=False) for s in steps], shots)


def validate(backend: Any, task: DesktopTask) -> tuple[list[bool], Episode]:
    """In a fresh sandbox: each subgoal's state before anything ran (a valid task: none fulfilled),
    then the oracle's episode (a valid task: all fulfilled)."""
    sb = open_task_sandbox(backend, task)
    try:
        before = evaluate(sb, task)
        return before, track(sb, task, task.oracle)
    finally:
        sb.kill()
