"""Policies for desktop tasks, driven by rollout's agent loop like any other (rollout.policy.Policy).

- `VisionPolicy`: any OpenAI-compatible chat endpoint with vision. Each turn it is shown the
  instruction, its own earlier replies, and the newest screenshot(s) as base64 PNG `image_url`
  parts; it replies with pyautogui code or a step JSON (parse_reply), which becomes a `computer`
  tool call. Nothing in the reply is executed on the host: pyautogui code is read with `ast`
  (desktop.actions.parse_pyautogui). In the logged request the images are `shoal-blob:sha256:..`
  references (the PNGs are blobs beside the log); they become data: URLs only in the HTTP body.
- `ScriptedDesktopPolicy` (kind "script"): a fixed list of steps, then submit; `oracle` (the task's
  oracle, optionally with detours inserted, typos made, or the end cut off), `null` (submits at
  once) and `random` (seeded random clicks, moves and keys within the screen).
"""
from __future__ import annotations

import json
import random
import re
from typing import Any

from ...core.errors import InvalidArgument, LLMUnavailable
from ...rollout.policy import ChatEndpointPolicy, Policy, ScriptedPolicy, tool_call, turn
from ...trajlog import blobs
from .runner import COMPUTER_TOOLS, step_args, to_step
from .task import DesktopTask

_SHOT = re.compile(r"screenshot (sha256:[0-9a-f]{64})")
_FENCE = re.compile(r"```(?:python|py|json)?\s*\n?(.*?)```", re.S)
BLOB_URL = "shoal-blob:"


# --------------------------------------------------------------------------------------- scripted
class ScriptedDesktopPolicy(ScriptedPolicy):
    """Steps (pyautogui strings, step dicts, or annotated {"code"|"action", "target", "intended"}),
    one `computer` call each, then submit."""

    name = "script"

    def __init__(self, steps: list[Any], name: str | None = None):
        self.steps = [step_args(s) for s in steps]
        for a in self.steps:
            to_step(a)  # a bad script fails here, not mid-episode
        if name:
            self.name = name

    def request(self, messages: list[dict], tools: list[dict] | None = None) -> dict:
        return {"policy": self.name, "messages": messages, "tools": COMPUTER_TOOLS if tools is None else tools}

    def act(self, step: int, messages: list[dict]) -> dict:
        if step < len(self.steps):
            return turn("", [tool_call(step, "computer", **self.steps[step])])
        return turn("", [tool_call(step, "submit")])


def oracle_steps(task: DesktopTask, detours: dict[int, list[Any]] | None = None, typos: dict[int, str] | None = None,
                 cut: int = 0) -> list[dict]:
    """The task's oracle as annotated steps: typing steps intend what the oracle types. `detours`:
    {i: steps} inserted before oracle step i (i = len(oracle): at the end); `typos`: {i: text}
    types `text` instead at oracle step i (still intending the oracle's text); `cut`: leave out the
    last `cut` oracle steps."""
    out: list[dict] = []
    oracle = task.oracle[:len(task.oracle) - cut] if cut else list(task.oracle)
    for i, s in enumerate(oracle):
        out += [step_args(d) for d in (detours or {}).get(i, [])]
        a = step_args(s)
        st = to_step(a)
        typed = st.typed()
        if typed is not None and "intended" not in a:
            a["intended"] = typed
            if typos and i in typos:
                if "code" in a:
                    a["code"] = f"pyautogui.write({typos[i]!r})"
                else:
                    a["action"] = {**a["action"], "text": typos[i]}
        out.append(a)
    out += [step_args(d) for d in (detours or {}).get(len(oracle), [])]
    return out


class NullDesktopPolicy(ScriptedPolicy):
    """Submits at once (the floor)."""

    name = "null"

    def request(self, messages: list[dict], tools: list[dict] | None = None) -> dict:
        return {"policy": self.name, "messages": messages, "tools": COMPUTER_TOOLS}

    def act(self, step: int, messages: list[dict]) -> dict:
        return turn("", [tool_call(step, "submit")])


class RandomDesktopPolicy(ScriptedPolicy):
    """`n` seeded random steps (clicks, moves, scrolls, harmless keys) inside a w x h screen, then submit."""

    name = "random"
    KEYS = ("left", "right", "up", "down", "home", "end", "tab", "escape")

    def __init__(self, seed: int = 0, n: int = 5, size: tuple[int, int] = (1024, 768)):
        self.seed, self.n, self.size = seed, n, size

    def request(self, messages: list[dict], tools: list[dict] | None = None) -> dict:
        return {"policy": f"{self.name}:{self.seed}", "messages": messages, "tools": COMPUTER_TOOLS}

    def act(self, step: int, messages: list[dict]) -> dict:
        if step >= self.n:
            return turn("", [tool_call(step, "submit")])
        rng = random.Random(f"{self.seed}:{step}")
        x, y = rng.randrange(self.size[0]), rng.randrange(self.size[1])
        kind = rng.choice(("click", "move", "scroll", "key"))
        if kind == "key":
            code = f"pyautogui.press({rng.choice(self.KEYS)!r})"
        elif kind == "scroll":
            code = f"pyautogui.scroll({rng.choice((-3, 3))}, x={x}, y={y})"
        else:
            code = f"pyautogui.{'click' if kind == 'click' else 'moveTo'}({x}, {y})"
        return turn("", [tool_call(step, "computer", code=code)])


# ----------------------------------------------------------------------------------------- vision
def parse_reply(text: str) -> dict | None:
    """A model's reply -> `computer` arguments, or None for DONE / FAIL (the episode ends).
    A fenced block (```python / ```json) is taken if there is one; a JSON object is a step object
    (with optional "target" / "intended"); anything else is pyautogui code (comments may name the
    target and the intended text). Nothing is checked here beyond the shape: the tool checks the rest."""
    m = _FENCE.search(text)
    body = (m.group(1) if m else text).strip()
    lines = [ln.strip() for ln in body.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    if lines and all(ln in ("DONE", "FAIL") for ln in lines) or (not m and text.strip() in ("DONE", "FAIL")):
        return None
    if body.startswith("{"):
        try:
            obj = json.loads(body)
        except ValueError:
            obj = None
        if isinstance(obj, dict):
            if "code" in obj or ("action" in obj and isinstance(obj["action"], dict)):
                return obj
            target, intended = obj.pop("target", None), obj.pop("intended", None)
            out: dict = {"action": obj}
            if target is not None:
                out["target"] = target
            if intended is not None:
                out["intended"] = intended
            return out
    return {"code": body}


def _vision_messages(messages: list[dict], images: int) -> list[dict]:
    """The loop's messages as a vision chat: tool observations become user turns, the newest
    `images` screenshots as image parts (blob references), older ones as text."""
    shots = [i for i, m in enumerate(messages) if m.get("role") == "tool" and _SHOT.search(m.get("content") or "")]
    keep = set(shots[-images:]) if images > 0 else set()
    out: list[dict] = []
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content") or ""
        if role in ("system", "user"):
            out.append({"role": role, "content": content})
        elif role == "assistant":
            if content:  # a local screenshot turn has no content: the model never said it
                out.append({"role": "assistant", "content": content})
        elif role == "tool":
            text = _SHOT.sub("", content).strip() or "ok"
            shot = _SHOT.search(content)
            if i in keep and shot:
                out.append({"role": "user", "content": [
                    {"type": "text", "text": f"Result: {text}. The screen now:"},
                    {"type": "image_url", "image_url": {"url": BLOB_URL + shot.group(1)}}]})
            else:
                out.append({"role": "user", "content": f"Result: {text}. (screenshot omitted)"})
    return out


def _expand(request: dict) -> dict:
    """The HTTP body: blob references -> base64 PNG data: URLs."""
    import base64

    def fix(part: Any) -> Any:
        if isinstance(part, dict) and part.get("type") == "image_url":
            url = part["image_url"]["url"]
            if url.startswith(BLOB_URL):
                data = base64.b64encode(blobs.find(url[len(BLOB_URL):])).decode()
                return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}
        return part

    msgs = [{**m, "content": [fix(p) for p in m["content"]]} if isinstance(m.get("content"), list) else m
            for m in request["messages"]]
    return {**request, "messages": msgs}


class VisionPolicy(ChatEndpointPolicy):
    """An OpenAI-compatible vision model as a desktop policy (retries and outages as ChatEndpointPolicy)."""

    def __init__(self, url: str, model: str, api_key: str | None = None, *, images: int = 1, **kw: Any):
        super().__init__(url, model, api_key, **kw)
        self.images = images
        self.name = f"vision:{model}"

    def request(self, messages: list[dict], tools: list[dict] | None = None) -> dict:
        step = sum(1 for m in messages if m.get("role") == "assistant")
        if not any(m.get("role") == "tool" and _SHOT.search(m.get("content") or "") for m in messages):
            return {"model": self.model, "local": "first-screenshot", "step": step}  # nothing to show yet
        return {"model": self.model, "messages": _vision_messages(messages, self.images),
                "temperature": self.temperature, "max_tokens": self.max_tokens, **self.extra_body}

    async def complete(self, request: dict) -> dict:
        step = int(request.get("step", 0))
        if request.get("local") == "first-screenshot":
            return turn("", [tool_call(step, "screenshot")])
        return self._turn(await self.post_chat(_expand(request)), len(request["messages"]))

    def _turn(self, body: dict, n: int) -> dict:
        try:
            msg = body["choices"][0]["message"]
        except (KeyError, IndexError, TypeError):
            raise LLMUnavailable(f"not a chat completion: {json.dumps(body)[:300]}") from None
        text = msg.get("content") or ""
        args = parse_reply(text)
        extra = {"usage": body["usage"]} if body.get("usage") else {}
        if args is None:
            return turn(text, [tool_call(n, "submit")], **extra)
        return turn(text, [tool_call(n, "computer", **args)], **extra)


def make_desktop_policy(spec: dict, task: DesktopTask | None = None) -> Policy:
    """{"kind": "oracle", "detours"?: {i: [steps]}, "typos"?: {i: text}, "cut"?: n},
    {"kind": "script", "steps": [...]}, {"kind": "null"}, {"kind": "random", "seed"?, "n"?},
    {"kind": "vision" | "chat", "url", "model", "api_key"?, "images"?, ...}."""
    kind = spec.get("kind")
    if kind == "oracle":
        if task is None:
            raise InvalidArgument("the desktop oracle policy needs its task")
        detours = {int(k): v for k, v in (spec.get("detours") or {}).items()}
        typos = {int(k): v for k, v in (spec.get("typos") or {}).items()}
        plain = not (detours or typos or spec.get("cut"))
        return ScriptedDesktopPolicy(oracle_steps(task, detours, typos, int(spec.get("cut", 0))),
                                     name="oracle" if plain else spec.get("name", "oracle+detours"))
    if kind == "script":
        return ScriptedDesktopPolicy(spec["steps"], name=spec.get("name"))
    if kind == "null":
        return NullDesktopPolicy()
    if kind == "random":
        return RandomDesktopPolicy(int(spec.get("seed", 0)), int(spec.get("n", 5)))
    if kind in ("vision", "chat"):
        opts = {k: v for k, v in spec.items() if k not in ("kind", "url", "model", "api_key")}
        return VisionPolicy(spec["url"], spec["model"], spec.get("api_key"), **opts)
    raise InvalidArgument(f"unknown desktop policy kind {kind!r}: oracle, script, null, random or vision")
