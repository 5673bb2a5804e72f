"""Desktop tasks in rollout's agent loop: `DesktopRolloutTask` implements `rollout.task.Task`.

The agent has three tools:

- `computer`: one step, as pyautogui code (`{"code": "pyautogui.hotkey('ctrl', 's')"}`) or a step
  object (`{"action": {"action": "type", "text": "hi"}}`; also `{"launch": app, ...}`, `{"focus":
  title}`, `{"wait_for_window": title}`), optionally naming the click `target` ({role, name}) and
  the `intended` text of a typing step (failure.py says how these are scored);
- `screenshot`: the screen now, without acting;
- `submit`: the end.

Every step goes through the episode's trajectory-log stream, in this order, each one entry:
`desktop_probe` (a targeted click: the element under the point in the accessibility tree taken
just before the click), `desktop_step` (the action), `screenshot` (the screen after it: the entry
holds its digest, the PNG is a blob beside the log, trajlog.blobs) and `track` (the subgoals the
step fulfilled: the frontier's checks, run in the sandbox). A worker that dies mid-episode is
replaced by one that replays all of these from the log, without touching the sandbox, and goes on
live in the same sandbox (reattached); a step that was in flight at the kill is never re-run (the
agent is told its outcome is unknown), a screenshot or a check in flight is simply taken again.
When the sandbox itself is gone (its host was lost), the task's setup runs in a new one and every
completed logged step is re-applied to it, in order, before the episode goes on.

Grading reads the process record (`answer()`: when each subgoal was fulfilled, the steps, the
screenshots' digests, the scored clicks and typing) and needs no sandbox: reward = the fraction of
subgoals fulfilled; `report` has the ordered prefix, drift, click accuracy and typing errors.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...core.errors import HostUnavailable, InvalidArgument, SandboxLost, ShoalError, UnknownOutcome
from ...desktop.actions import DesktopAction, parse_pyautogui
from ...trajlog.blobs import BlobStore, blobs_for
from .failure import CLICK_ACTIONS, check_target, click_accuracy, click_hit, typing_errors
from .metrics import drift
from .task import DesktopTask, Episode, TaskScore, check, load_suite, run_step

if TYPE_CHECKING:
    from ...core.contract import SandboxBackend
    from ...host import Host
    from ...layers.store import ImageSource
    from ...rollout.task import Verdict
    from ...sdk.sandbox import Sandbox
    from ...trajlog import LoggedSandbox

SYSTEM_PROMPT = """You operate a Linux desktop (X11) through screenshots, mouse and keyboard.
Each turn you see the screen; answer with ONE step:
- pyautogui code in a ```python block, e.g. pyautogui.click(640, 400) or pyautogui.hotkey('ctrl', 's');
  lines may carry `# target: <role> "<name>"` (the element a click means to hit) and
  `# intended: "<text>"` (the text a write() means to type);
- or a JSON object: a DesktopAction ({"action": "click", "x": 10, "y": 20}), {"launch": "editor",
  "args": [...]}, {"focus": "<window title>"}, optionally with "target" and "intended";
- or DONE when the task is finished (FAIL if it cannot be done).
Coordinates are screen pixels of the screenshot you were shown."""

COMPUTER_TOOLS: list[dict] = [
    {"type": "function", "function": {
        "name": "computer", "description": "Do one desktop step: pyautogui `code`, or a step object `action`.",
        "parameters": {"type": "object", "properties": {
            "code": {"type": "string"}, "action": {"type": "object"},
            "target": {"type": "object", "description": "the element a click means to hit: {role, name}"},
            "intended": {"type": "string", "description": "the text a typing step means to type"}}}}},
    {"type": "function", "function": {
        "name": "screenshot", "description": "Look at the screen without acting.",
        "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {
        "name": "submit", "description": "Finish the task.", "parameters": {"type": "object", "properties": {}}}},
]
_COMMENT_TARGET = re.compile(r'#\s*target:\s*([^"\n]*?)\s*"([^"\n]*)"')
_COMMENT_INTENDED = re.compile(r'#\s*intended:\s*("(?:[^"\\\n]|\\.)*")')
A11Y_DEPTH, A11Y_NODES = 30, 5000


# ---------------------------------------------------------------------------------------- steps
@dataclass
class Step:
    """One agent step: what runs (`run`: a pyautogui string or a step dict, as task.run_step takes),
    and what it meant (click target, intended text)."""

    run: Any
    target: dict | None = None
    intended: str | None = None

    @property
    def text(self) -> str:
        return self.run if isinstance(self.run, str) else json.dumps(self.run, ensure_ascii=False)

    def actions(self) -> list[DesktopAction]:
        """The input actions of this step (none for launch / focus / wait_for_window)."""
        if isinstance(self.run, str):
            return [a for a in parse_pyautogui(self.run) if isinstance(a, DesktopAction)]
        if isinstance(self.run, dict) and "action" in self.run:
            return [DesktopAction.model_validate(self.run)]
        return []

    def click_point(self) -> tuple[int, int] | None:
        for a in self.actions():
            if a.action in CLICK_ACTIONS and a.x is not None and a.y is not None:
                return a.x, a.y
        return None

    def typed(self) -> str | None:
        texts = [a.text or "" for a in self.actions() if a.action == "type"]
        return "".join(texts) if texts else None


def to_step(args: dict) -> Step:
    """The `computer` tool's arguments (or an oracle / policy step spec) -> a Step. Annotations
    ("target", "intended") are taken off the step before it runs."""
    if not isinstance(args, dict):
        raise InvalidArgument(f"a step is an object with `code` or `action`, got {type(args).__name__}")
    unknown = set(args) - {"code", "action", "target", "intended"}
    if unknown or ("code" in args) == ("action" in args):
        raise InvalidArgument(f"a step has exactly one of `code` or `action` (and optional target, intended); "
                              f"got keys {sorted(args)}")
    target, intended = args.get("target"), args.get("intended")
    if "code" in args:
        code = args["code"]
        if not isinstance(code, str):
            raise InvalidArgument("`code` is a string of pyautogui calls")
        if target is None and (m := _COMMENT_TARGET.search(code)):
            target = {k: v for k, v in (("role", m.group(1)), ("name", m.group(2))) if v}
        if intended is None and (m := _COMMENT_INTENDED.search(code)):
            intended = json.loads(m.group(1))
        run: Any = code
    else:
        action = args["action"]
        if not isinstance(action, dict):
            raise InvalidArgument("`action` is an object (a DesktopAction, or launch / focus / wait_for_window)")
        action = dict(action)
        target = action.pop("target", target)
        intended = action.pop("intended", intended)
        run = action
    if target is not None:
        target = check_target(target)
    if intended is not None and not isinstance(intended, str):
        raise InvalidArgument("`intended` is the text a typing step means to type")
    return Step(run, target, intended)


def step_args(spec: Any) -> dict:
    """An oracle / script step (a pyautogui string, a step dict, or an annotated {"code"|"action",
    "target", "intended"}) as `computer` tool arguments."""
    if isinstance(spec, str):
        return {"code": spec}
    if isinstance(spec, dict) and ("code" in spec or ("action" in spec and isinstance(spec["action"], dict))):
        return dict(spec)
    if isinstance(spec, dict):
        return {"action": dict(spec)}
    raise InvalidArgument(f"unknown step {spec!r}")


# ---------------------------------------------------------------------------------------- tools
@dataclass
class StepRecord:
    text: str
    shot: str | None = None  # the screenshot digest after the step
    fulfilled: list[str] = field(default_factory=list)
    error: str | None = None
    click: dict | None = None  # click_hit, when the step named a target
    typed: str | None = None
    intended: str | None = None
    unknown: bool = False


class DesktopTools:
    """The desktop tools on a logged sandbox (implements `rollout.task.Tools`), tracking subgoals."""

    specs = COMPUTER_TOOLS

    def __init__(self, task: DesktopTask, sandbox: LoggedSandbox, blobs: BlobStore, judge: Any = None):
        self.task, self.lsb, self.blobs, self.judge = task, sandbox, blobs, judge
        self.at: dict[str, int | None] = {g.id: None for g in task.subgoals}
        self.steps: list[StepRecord] = []
        self.looks = 0  # screenshot-tool calls (not steps)
        self.restored = self._restore() if sandbox.sandbox is not None else 0

    def _restore(self) -> int:
        """A sandbox that is not the one the logged steps ran in (that one was lost with its host):
        re-apply every completed logged step to it, in order, so that it reaches the state the log
        goes on from. Steps in flight when their writer died (UNKNOWN) are not re-applied, as
        `trajlog.restore` does for commands. Returns how many were re-applied."""
        done = [e for e in self.lsb.stream.log.history(self.lsb.stream.name) if e.kind == "desktop_step"]
        if not done or done[-1].sandbox == self.sb.id:
            return 0  # a new episode, or its own sandbox reattached
        n = 0
        for e in done:
            if e.status != "DONE" or "ok" not in (e.result or {}) and "error" not in (e.result or {}):
                continue
            try:
                run_step(self.sb, e.request["run"])
            except ShoalError:  # it failed the same way the first time, or now differs: go on
                pass
            n += 1
        return n

    @property
    def sb(self) -> Sandbox:
        if self.lsb.sandbox is None:
            raise ShoalError("the desktop tools have no sandbox attached")
        return self.lsb.sandbox

    # logged operations: each one entry in the sandbox stream; reads may run again after a kill
    def _logged(self, kind: str, req: dict, run: Any, idempotent: bool) -> dict:
        stream = self.lsb.stream
        try:
            return stream.call(kind, req, run).result
        except UnknownOutcome:
            if not idempotent:
                raise
            return stream.settle(run()).result

    def _shot(self, tag: str) -> dict:
        def take() -> dict:
            png = self.sb.desktop.screenshot()
            w = int.from_bytes(png[16:20], "big")
            h = int.from_bytes(png[20:24], "big")
            return {"digest": self.blobs.put(png), "bytes": len(png), "width": w, "height": h}

        return self._logged("screenshot", {"at": tag}, take, idempotent=True)

    def _track(self, i: int) -> list[str]:
        task, at = self.task, self.at

        def sweep() -> dict:
            new: list[str] = []
            done = {k for k, v in at.items() if v is not None}
            progressed = True
            while progressed:  # one step may fulfil a chain (saved -> content -> ...)
                progressed = False
                for g in task.subgoals:
                    if g.id in done or any(d not in done for d in g.depends_on):
                        continue
                    ok = check(self.sb, g.check) if g.check is not None else bool(
                        self.judge and self.judge(task, g, self.sb))
                    if ok:
                        done.add(g.id)
                        new.append(g.id)
                        progressed = True
            return {"fulfilled": new}

        new = self._logged("track", {"step": i}, sweep, idempotent=True)["fulfilled"]
        for gid in new:
            at[gid] = i
        return new

    def run(self, name: str, arguments: str | dict) -> Any:
        from ...rollout.tools import Observation, parse_arguments

        args = parse_arguments(arguments)
        if isinstance(args, Observation):
            return args
        try:
            if name == "submit":
                return Observation("submitted", submitted=True)
            if name == "screenshot":
                s = self._shot(f"look{self.looks}")
                self.looks += 1
                return Observation(f"screenshot {s['digest']} {s['width']}x{s['height']}")
            if name == "computer":
                return self._computer(args)
            return Observation(f"error: unknown tool {name!r}; tools: computer, screenshot, submit", error=True)
        except (SandboxLost, HostUnavailable):
            raise  # the worker moves the episode (rollout.worker)
        except ShoalError as e:
            return Observation(f"error: {e}", error=True)

    def _computer(self, args: dict) -> Any:
        from ...rollout.tools import Observation

        i = len(self.steps)
        try:
            step = to_step(args)
            step.actions()  # a malformed step is a wasted step, caught before anything runs
        except InvalidArgument as e:
            rec = StepRecord(json.dumps(args, ensure_ascii=False, sort_keys=True)[:500], error=str(e))
            self.steps.append(rec)
            rec.shot = self._shot(f"step{i}")["digest"]
            rec.fulfilled = self._track(i)
            return Observation(f"error: {e}\nscreenshot {rec.shot}", error=True)
        rec = StepRecord(step.text, typed=step.typed(), intended=step.intended, )
        self.steps.append(rec)
        pt = step.click_point()
        if step.target is not None and pt is not None:
            x, y, target = pt[0], pt[1], step.target

            def probe() -> dict:
                tree = self.sb.desktop.accessibility_tree(depth=A11Y_DEPTH, max_nodes=A11Y_NODES)
                return click_hit(tree.model_dump(), x, y, target)

            rec.click = self._logged("desktop_probe", {"step": i, "x": x, "y": y, "target": target}, probe,
                                     idempotent=True)

        def act() -> dict:
            try:
                run_step(self.sb, step.run)
            except (SandboxLost, HostUnavailable):
                raise
            except ShoalError as e:  # the step failed in the desktop: its outcome, logged like any other
                return {"error": f"{type(e).__name__}: {e}"}
            return {"ok": True}

        note = ""
        try:
            res = self._logged("desktop_step", {"step": i, "run": step.run}, act, idempotent=False)
            rec.error = res.get("error")
        except UnknownOutcome:
            note = ("[shoal] the worker running this step died while it was in flight; its outcome is unknown. "
                    "Look at the screen before repeating it.")
            self.lsb.stream.settle({"note": note})
            rec.unknown = True
        rec.shot = self._shot(f"step{i}")["digest"]
        rec.fulfilled = self._track(i)
        head = note or (f"error: {rec.error}" if rec.error else "ok")
        return Observation(f"{head}\nscreenshot {rec.shot}", error=bool(rec.error or note), unknown=rec.unknown)

    def record(self) -> dict:
        """The episode's process record (what `answer` returns, as JSON)."""
        return {"task": self.task.id, "steps": len(self.steps), "fulfilled_at": [self.at[g.id] for g in
                                                                                  self.task.subgoals],
                "records": [vars(r) for r in self.steps]}


# ---------------------------------------------------------------------------------------- the task
class DesktopRolloutTask:
    """A `DesktopTask` as a `rollout.task.Task`."""

    def __init__(self, task: DesktopTask, judge: Any = None):
        self.task, self.judge = task, judge

    @property
    def id(self) -> str:
        return self.task.id

    @property
    def image(self) -> str:
        from ...envs.desktop import DESKTOP_IMAGE

        return DESKTOP_IMAGE

    def describe(self) -> dict[str, Any]:
        t = self.task
        return {"repo": f"desktop/{t.category}", "labels": {"category": t.category, "apps": t.apps,
                                                            "variant": t.variant,
                                                            "subgoals": [g.id for g in t.subgoals]}}

    def prepare(self, host: Host, source: ImageSource | None = None) -> None:
        from ...envs.desktop import ensure_desktop

        ensure_desktop(host, apps=tuple(self.task.apps), variant=self.task.variant)

    def sandbox(self, backend: SandboxBackend, **create: Any) -> Sandbox:
        from .task import open_task_sandbox

        return open_task_sandbox(backend, self.task, **create)

    def prompt(self) -> list[dict]:
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": self.task.instruction}]

    def tools(self, sandbox: LoggedSandbox) -> DesktopTools:
        return DesktopTools(self.task, sandbox, blobs_for(sandbox.stream.log), self.judge)

    def answer(self, tools: Any) -> str:
        if not isinstance(tools, DesktopTools):
            raise TypeError(f"a desktop task's answer is read through DesktopTools, got {type(tools).__name__}")
        return json.dumps(tools.record(), ensure_ascii=False, sort_keys=True)

    def grade(self, backend: SandboxBackend, answer: str) -> Verdict:
        from ...rollout.task import Verdict

        rep = score_record(self.task, json.loads(answer))
        return Verdict(reward=rep["fraction"], resolved=rep["complete"], report=rep)

    def make_policy(self, spec: dict) -> Any:
        from .policies import make_desktop_policy

        return make_desktop_policy(spec, self.task)


def score_record(task: DesktopTask, rec: dict) -> dict:
    """Process-level scores of one episode record: fraction, ordered prefix, drift, clicks, typing."""
    at = rec["fulfilled_at"]
    if len(at) != len(task.subgoals):
        raise InvalidArgument(f"the record has {len(at)} subgoals, task {task.id} has {len(task.subgoals)}")
    sc = TaskScore(task.id, task.category, [t is not None for t in at])
    hit = {t for t in at if t is not None}
    steps = rec["records"]
    return {"task": task.id, "category": task.category, "fraction": sc.fraction, "prefix": sc.prefix,
            "complete": sc.complete, "steps": len(steps), "fulfilled_at": at,
            "subgoals": {g.id: t for g, t in zip(task.subgoals, at, strict=True)},
            "drift": drift([i in hit for i in range(len(steps))]),
            "clicks": click_accuracy(r["click"] for r in steps if r.get("click")),
            "typing": typing_errors((r["typed"] or "", r["intended"]) for r in steps
                                    if r.get("intended") is not None),
            "errors": sum(1 for r in steps if r.get("error")), "unknown": sum(1 for r in steps if r.get("unknown"))}


def episode_of(task: DesktopTask, record: dict, blobs: BlobStore | None = None) -> Episode:
    """An episode record (the graded answer) as a report.Episode, screenshots read from `blobs`."""
    recs = record["records"]
    shots = [blobs.get(r["shot"]) for r in recs if r.get("shot")] if blobs is not None else []
    return Episode(task, len(recs), list(record["fulfilled_at"]), [r["text"] for r in recs], shots)


def load_desktop_tasks(path: str | None = None, judge: Any = None) -> list[DesktopRolloutTask]:
    from pathlib import Path

    from .task import SUITE

    return [DesktopRolloutTask(t, judge) for t in load_suite(Path(path) if path else SUITE)]
