"""Policies: an OpenAI-compatible chat endpoint (vLLM, SGLang, a hosted API), or a scripted one.

Every policy is driven the same way: `request(messages)` builds the chat-completions payload (which
the trajectory log hashes), `complete(request)` returns a `Turn` as a dict (the log stores it).
Scripted policies (oracle, null, random-edit, a fixed script) decide from the messages alone, so a
resumed episode asks them the same questions and gets the same answers.
"""
from __future__ import annotations

import asyncio
import json
import random
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import httpx

from ..core.errors import InvalidArgument, LLMUnavailable
from .tools import TOOLS


def tool_call(i: int, name: str, **arguments: Any) -> dict:
    return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def turn(content: str = "", tool_calls: list[dict] | None = None, **extra: Any) -> dict:
    """A policy's answer: the assistant message, plus token ids / logprobs when the server gave them."""
    return {"content": content, "tool_calls": tool_calls or [], **extra}



RETRY_STATUS = (408, 409, 425, 429, 500, 502, 503, 504)


async def post_chat_completions(client: httpx.AsyncClient, url: str, body: dict, *, retries: int,
                                backoff_s: float, max_backoff_s: float = 8.0,
                                on_attempt: Callable[[], None] | None = None, who: str = "") -> dict:
    """POST `body` to `{url}/chat/completions`; the 200 answer's JSON. Outages (connection errors and
    the statuses in RETRY_STATUS) get `retries` more tries with exponential backoff; any other status
    and the last failure raise LLMUnavailable naming `who` and the endpoint."""
    delay, last, name = backoff_s, "", f"{who} {url}" if who else url
    for attempt in range(retries + 1):
        if on_attempt:
            on_attempt()
        try:
            r = await client.post(f"{url}/chat/completions", json=body)
            if r.status_code == 200:
                return r.json()
            last = f"HTTP {r.status_code}: {r.text[:300]}"
            if r.status_code not in RETRY_STATUS:
                raise LLMUnavailable(f"{name} refused the request: {last}")
        except httpx.HTTPError as e:
            last = f"{type(e).__name__}: {e}"
        if attempt < retries:
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_backoff_s)
    raise LLMUnavailable(f"{name} failed {retries + 1} times; last: {last}")

class Policy(ABC):
    name: str = "policy"

    def request(self, messages: list[dict], tools: list[dict] | None = None) -> dict:
        """The model call for this turn; `tools` are the task's tool schemas (default: the coding tools)."""
        return {"policy": self.name, "messages": messages, "tools": TOOLS if tools is None else tools}

    @abstractmethod
    async def complete(self, request: dict) -> dict: ...

    async def aclose(self) -> None:  # noqa: B027 - optional hook: most policies hold nothing to close
        pass


# ------------------------------------------------------------------------------------------ endpoint
class ChatEndpointPolicy(Policy):
    """Any OpenAI-compatible `/v1/chat/completions`. Outages get bounded retries with exponential
    backoff; after that `LLMUnavailable` (the episode is paused, not failed)."""

    def __init__(self, url: str, model: str, api_key: str | None = None, *, temperature: float = 0.0,
                 max_tokens: int = 1024, retries: int = 4, backoff_s: float = 0.5, max_backoff_s: float = 8.0,
                 timeout_s: float = 300.0, extra_body: dict | None = None):
        if not url.startswith(("http://", "https://")):
            raise InvalidArgument(f"LLM url must be http(s)://host[:port][/v1], got {url!r}")
        self.url = url.rstrip("/")
        if not self.url.endswith("/v1"):
            self.url += "/v1"
        self.model, self.name = model, f"chat:{model}"
        self.temperature, self.max_tokens = temperature, max_tokens
        self.retries, self.backoff_s, self.max_backoff_s = retries, backoff_s, max_backoff_s
        self.extra_body = extra_body or {}
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(timeout=timeout_s, headers=headers)
        self.attempts = 0  # HTTP requests made, retries included

    def request(self, messages: list[dict], tools: list[dict] | None = None) -> dict:
        return {"model": self.model, "messages": messages, "tools": TOOLS if tools is None else tools,
                "tool_choice": "auto",
                "temperature": self.temperature, "max_tokens": self.max_tokens, "logprobs": True,
                **self.extra_body}

    async def complete(self, request: dict) -> dict:
        return parse_completion(await self.post_chat(request))

    async def post_chat(self, body: dict) -> dict:
        """POST to `/chat/completions` with the bounded retries; the 200 answer's JSON."""
        def count() -> None:
            self.attempts += 1
        return await post_chat_completions(self._client, self.url, body, retries=self.retries,
                                           backoff_s=self.backoff_s, max_backoff_s=self.max_backoff_s,
                                           on_attempt=count)

    async def aclose(self) -> None:
        await self._client.aclose()


def parse_completion(body: dict) -> dict:
    """An OpenAI chat completion -> turn dict; keeps token ids (vLLM's `token_ids` /
    `prompt_token_ids`) and per-token logprobs when present."""
    try:
        choice = body["choices"][0]
        msg = choice["message"]
    except (KeyError, IndexError, TypeError):
        raise LLMUnavailable(f"not a chat completion: {json.dumps(body)[:300]}") from None
    extra: dict[str, Any] = {"finish_reason": choice.get("finish_reason")}
    lp = (choice.get("logprobs") or {}).get("content") if isinstance(choice.get("logprobs"), dict) else None
    if lp:
        extra["logprobs"] = [t.get("logprob") for t in lp]
        extra["tokens"] = [t.get("token") for t in lp]
    for k in ("token_ids", "prompt_token_ids"):
        v = choice.get(k) if choice.get(k) is not None else body.get(k)
        if v is not None:
            extra[k] = v
    if body.get("usage"):
        extra["usage"] = body["usage"]
    calls = [{"id": c.get("id") or f"call_{i}", "type": "function",
              "function": {"name": c["function"]["name"], "arguments": c["function"].get("arguments") or "{}"}}
             for i, c in enumerate(msg.get("tool_calls") or [])]
    return turn(msg.get("content") or "", calls, **extra)


# ------------------------------------------------------------------------------------------ scripted
class ScriptedPolicy(Policy):
    """Decides from the messages alone (deterministic, so resume and replay see the same turns)."""

    async def complete(self, request: dict) -> dict:
        messages = request["messages"]
        step = sum(1 for m in messages if m["role"] == "assistant")
        return self.act(step, messages)

    @abstractmethod
    def act(self, step: int, messages: list[dict]) -> dict: ...


class OraclePolicy(ScriptedPolicy):
    """Applies the gold patch through the tools: write it to /tmp, `git apply`, submit."""

    name = "oracle"

    def __init__(self, gold_patch: str):
        self.gold = gold_patch

    def act(self, step, messages):
        if step == 0:
            return turn("Writing the fix as a patch.", [tool_call(0, "create_file", path="/tmp/fix.patch",
                                                                  content=self.gold)])
        if step == 1:
            return turn("Applying it.",
                        [tool_call(1, "shell", command="git apply /tmp/fix.patch && git status --short")])
        return turn("Done.", [tool_call(step, "submit")])


class NullPolicy(ScriptedPolicy):
    """Submits at once, changing nothing (the floor: resolves nothing)."""

    name = "null"

    def act(self, step, messages):
        return turn("", [tool_call(step, "submit")])


class RandomEditPolicy(ScriptedPolicy):
    """Lists the source files, opens one at random and flips one operator on a random line, submits."""

    name = "random"
    _OPS = (("==", "!="), ("!=", "=="), ("<", ">"), (">", "<"), (" + ", " - "), (" - ", " + "), (" and ", " or "),
            (" or ", " and "))

    def __init__(self, seed: int = 0):
        self.seed = seed

    def act(self, step, messages):
        rng = random.Random(f"{self.seed}:{step}:{len(messages)}")
        if step == 0:
            return turn("", [tool_call(0, "shell", command="git ls-files '*.py' | grep -v -i test")])
        if step == 1:
            files = [f for f in _last_tool_output(messages).splitlines() if f.endswith(".py")]
            if not files:
                return turn("", [tool_call(1, "submit")])
            return turn("", [tool_call(1, "view_file", path=rng.choice(files))])
        if step == 2:
            path = json.loads(_last_call(messages)["function"]["arguments"])["path"]
            lines = [re.sub(r"^\s*\d+\t", "", x, count=1) for x in _last_tool_output(messages).splitlines()]
            candidates = [(ln, a, b) for ln in lines for a, b in self._OPS if a in ln and lines.count(ln) == 1]
            if candidates:
                ln, a, b = rng.choice(candidates)
                return turn("", [tool_call(2, "edit_file", path=path, old_str=ln, new_str=ln.replace(a, b, 1))])
        return turn("", [tool_call(step, "submit")])


class ScriptPolicy(ScriptedPolicy):
    """A fixed list of tool calls ([name, {args}] pairs), then submit: for tests and demos."""

    name = "script"

    def __init__(self, actions: list[list]):
        self.actions = actions

    def act(self, step, messages):
        if step < len(self.actions):
            name, args = self.actions[step]
            return turn("", [tool_call(step, name, **args)])
        return turn("", [tool_call(step, "submit")])


def _last_tool_output(messages: list[dict]) -> str:
    for m in reversed(messages):
        if m["role"] == "tool":
            return re.sub(r"\[exit code -?\d+.*\]$", "", m["content"]).strip()
    return ""


def _last_call(messages: list[dict]) -> dict:
    for m in reversed(messages):
        if m["role"] == "assistant" and m.get("tool_calls"):
            return m["tool_calls"][-1]
    raise InvalidArgument("no tool call in the conversation")


def make_policy(spec: dict, task: Any = None) -> Policy:
    """A policy from a JSON-able spec, so worker processes and Ray actors can build it:
    {"kind": "oracle"|"null"|"random", "seed"?}, {"kind": "script", "actions": [...]},
    {"kind": "chat", "url": ..., "model": ..., "api_key"?, "temperature"?, ...}."""
    kind = spec.get("kind")
    if task is not None and hasattr(task, "make_policy"):  # a task with its own action space (desktop)
        return task.make_policy(spec)
    if kind == "oracle":
        if task is None:
            raise InvalidArgument("the oracle policy needs the task (its gold patch)")
        return OraclePolicy(task.patch)
    if kind == "null":
        return NullPolicy()
    if kind == "random":
        return RandomEditPolicy(int(spec.get("seed", 0)))
    if kind == "script":
        return ScriptPolicy(spec["actions"])
    if kind == "chat":
        opts = {k: v for k, v in spec.items() if k not in ("kind", "url", "model", "api_key")}
        return ChatEndpointPolicy(spec["url"], spec["model"], spec.get("api_key"), **opts)
    raise InvalidArgument(f"unknown policy kind {kind!r}: oracle, null, random, script or chat")
