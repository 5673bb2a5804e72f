"""The scripted server's desktop models (rollout.scripted_server): vision requests answered by
scripted desktop policies, so the vision path runs end to end without a GPU.

Every request must carry a real PNG screenshot as a base64 `image_url` (the newest user turn): its
signature, chunk CRCs, IHDR and the decompressed image data's size are checked (`check_png`); a
request without one is refused with 400. Models:

- `desktop-oracle`: the oracle of the task whose instruction opens the conversation, one step per
  turn (pyautogui code in a ```python block, or a step's JSON), then DONE;
- `desktop-oracle:detour`: the same with a harmless pointer detour (two moves) before each step;
- `desktop-judge`: a stand-in for an LLM judge of one subgoal (agreement.py's judge prompt). It
  reads the action history in the prompt and answers {"fulfilled": bool}: a subgoal is judged
  fulfilled when the oracle's steps, in order, up to the share of the oracle that the subgoal's
  position in the task stands for (subgoal k of n: the first ceil(k/n) of the oracle), all appear in
  the history. A heuristic, not a model: it exists to exercise the judge path and the agreement
  metrics, and it can disagree with the programmatic checks.
"""
from __future__ import annotations

import base64
import binascii
import json
import math
import re
import struct
import time
import uuid
import zlib
from typing import Any

from ...core.errors import InvalidArgument
from .task import DesktopTask, load_suite

_CHANNELS = {0: 1, 2: 3, 4: 2, 6: 4}  # 8-bit greyscale, RGB, grey+alpha, RGBA


def check_png(data: bytes) -> tuple[int, int]:
    """(width, height) of a well-formed 8-bit, non-interlaced PNG; InvalidArgument otherwise."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise InvalidArgument("not a PNG (bad signature)")
    pos, chunks, idat = 8, [], bytearray()
    while pos < len(data):
        if pos + 12 > len(data):
            raise InvalidArgument("PNG truncated inside a chunk header")
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        if len(body) != n or pos + 12 + n > len(data):
            raise InvalidArgument("PNG truncated inside a chunk")
        (crc,) = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
        if binascii.crc32(kind + body) != crc:
            raise InvalidArgument(f"PNG chunk {kind!r} has a bad CRC")
        chunks.append(kind)
        if kind == b"IHDR":
            ihdr = body
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    if not chunks or chunks[0] != b"IHDR" or chunks[-1] != b"IEND" or b"IDAT" not in chunks:
        raise InvalidArgument("PNG chunks out of order (IHDR first, IDAT, IEND last)")
    w, h, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", ihdr)
    if depth != 8 or color not in _CHANNELS or interlace or not (0 < w <= 16384 and 0 < h <= 16384):
        raise InvalidArgument(f"unexpected PNG header: {w}x{h}, depth {depth}, colour type {color}")
    try:
        raw = zlib.decompress(bytes(idat))
    except zlib.error as e:
        raise InvalidArgument(f"PNG image data does not inflate: {e}") from None
    if len(raw) != h * (1 + w * _CHANNELS[color]):
        raise InvalidArgument(f"PNG image data is {len(raw)} bytes, {w}x{h} needs {h * (1 + w * _CHANNELS[color])}")
    return w, h


def last_png(messages: list[dict]) -> bytes:
    """The newest image_url in the conversation, decoded (InvalidArgument if none, or not base64 PNG)."""
    for m in reversed(messages):
        content = m.get("content")
        if isinstance(content, list):
            for part in reversed(content):
                if isinstance(part, dict) and part.get("type") == "image_url":
                    url = (part.get("image_url") or {}).get("url", "")
                    prefix = "data:image/png;base64,"
                    if not url.startswith(prefix):
                        raise InvalidArgument(f"image_url is not a base64 PNG data URL: {url[:60]!r}")
                    try:
                        return base64.b64decode(url[len(prefix):], validate=True)
                    except binascii.Error:
                        raise InvalidArgument("image_url's base64 does not decode") from None
    raise InvalidArgument("no image_url in the conversation")


def _text(m: dict) -> str:
    c = m.get("content")
    if isinstance(c, list):
        return "\n".join(p.get("text", "") for p in c if isinstance(p, dict) and p.get("type") == "text")
    return c or ""


def _reply(step: Any) -> str:
    if isinstance(step, str):
        return f"```python\n{step}\n```"
    return json.dumps(step, ensure_ascii=False)


def _completion(model: str, text: str) -> dict:
    return {"id": f"chatcmpl-{uuid.uuid4().hex[:12]}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "finish_reason": "stop",
                                         "message": {"role": "assistant", "content": text}}],
            "usage": {"prompt_tokens": 0, "completion_tokens": len(text)}}


def _normal(step: Any) -> str:
    """A step as comparable text (annotations dropped)."""
    if isinstance(step, dict):
        step = {k: v for k, v in step.items() if k not in ("target", "intended")}
        if "code" in step:
            step = step["code"]
        elif isinstance(step.get("action"), dict):
            step = step["action"]
    return step if isinstance(step, str) else json.dumps(step, sort_keys=True, ensure_ascii=False)


def judge_verdict(task: DesktopTask, subgoal: str, history: list[Any]) -> bool:
    """The scripted judge's rule (module docstring)."""
    ids = [g.id for g in task.subgoals]
    k = ids.index(subgoal) + 1
    need = [_normal(s) for s in task.oracle[:math.ceil(k / len(ids) * len(task.oracle))]]
    seen = iter(_normal(s) for s in history)
    return all(any(s == h for h in seen) for s in need)  # a subsequence, in order


class DesktopModels:
    def __init__(self, suite: str | None = None):
        from pathlib import Path

        from .task import SUITE

        self.tasks = {t.instruction: t for t in load_suite(Path(suite) if suite else SUITE)}
        self.pngs = 0  # screenshots received and checked

    def complete(self, body: dict) -> tuple[int, dict]:
        model = str(body.get("model", ""))
        messages = body.get("messages") or []
        try:
            self.pngs += check_png(last_png(messages)) is not None
        except InvalidArgument as e:
            return 400, {"error": {"message": f"{model}: {e}", "type": "invalid_request_error"}}
        if model == "desktop-judge":
            return self._judge(model, messages)
        instruction = next((_text(m) for m in messages if m.get("role") == "user"), "")
        task = self.tasks.get(instruction)
        if task is None:
            return 400, {"error": {"message": "no desktop task has this instruction"}}
        step = sum(1 for m in messages if m.get("role") == "assistant")
        if model == "desktop-oracle":
            plan = list(task.oracle)
        elif model == "desktop-oracle:detour":
            plan = [s for o in task.oracle for s in ("pyautogui.moveTo(700, 500)", "pyautogui.moveTo(20, 20)", o)]
        else:
            return 404, {"error": {"message": f"unknown desktop model {model!r}"}}
        return 200, _completion(model, _reply(plan[step]) if step < len(plan) else "DONE")

    def _judge(self, model: str, messages: list[dict]) -> tuple[int, dict]:
        prompt = "\n".join(_text(m) for m in messages)
        m = re.search(r"^TASK: (.*)$", prompt, re.M)
        g = re.search(r"^SUBGOAL: (\S+)", prompt, re.M)
        h = re.search(r"^HISTORY:\n(.*?)^END HISTORY", prompt, re.M | re.S)
        task = self.tasks.get(json.loads(m.group(1))) if m else None
        if task is None or g is None or h is None or g.group(1) not in {x.id for x in task.subgoals}:
            return 400, {"error": {"message": "not a desktop judge prompt (TASK, SUBGOAL, HISTORY)"}}
        history = [json.loads(line) for line in h.group(1).splitlines() if line.strip()]
        ok = judge_verdict(task, g.group(1), history)
        return 200, _completion(model, json.dumps({"fulfilled": ok}))
