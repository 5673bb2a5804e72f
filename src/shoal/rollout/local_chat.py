"""`/v1/chat/completions` answered by a real local model (`annotate.model.ModelBackend`), so the
chat-based clients (the rollout policy `ChatEndpointPolicy`, FLARE's `LLMJudge`) run end to end
against a model that computes its answers, on a machine with no network and no GPU.

Mounted on the project's scripted server by `--model PATH`: a request whose `model` is the local
model's name comes here; the scripted models keep their names.

- The conversation is rendered with a plain template (`<|role|>` lines; tool calls as Hermes-style
  `<tool_call>{json}</tool_call>`), tokenized by the model's own tokenizer, and cut on the left to
  fit the model's context with room for the answer (`prompt_tokens_cut` in the answer says how much
  was cut: a small model sees only the end of a long prompt).
- Without `response_format`, the model generates freely (greedy at temperature 0, else sampled);
  `<tool_call>` blocks in its text become `tool_calls`, and the text around them the content.
- `response_format: json_schema` is enforced by construction, as guided decoding does on vLLM: the
  object's keys and punctuation are forced, each `enum` property takes the option the model scores
  highest (sum of its tokens' log-probabilities), and each string property is generated up to the
  first quote or newline (at most `STRING_TOKENS` tokens). Only flat objects of string and enum
  properties are supported; another schema is a 400.
- `choices[0].token_ids` are the answer's token ids in the model's vocabulary (vLLM's field), so
  per-token rewards can be aligned with them.
"""
from __future__ import annotations

import json
from typing import Any

from ..core.errors import InvalidArgument

STRING_TOKENS = 24  # per string property of a constrained answer
MAX_NEW = 256  # a free answer's cap, whatever max_tokens asks (CPU time)


def render(messages: list[dict], tools: list[dict] | None = None) -> str:
    """The plain chat template: one `<|role|>` block per message, then the assistant's turn."""
    parts = []
    if tools:
        names = [t.get("function", {}).get("name", "") for t in tools]
        parts.append("<|system|>\nTools: " + ", ".join(n for n in names if n) +
                     '. Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call>.\n')
    for m in messages:
        text = str(m.get("content") or "")
        for c in m.get("tool_calls") or []:
            fn = c.get("function", {})
            args = fn.get("arguments")
            try:
                args = json.loads(args) if isinstance(args, str) else args
            except ValueError:
                pass
            text += "<tool_call>" + json.dumps({"name": fn.get("name", ""), "arguments": args}) + "</tool_call>"
        parts.append(f"<|{m.get('role', 'user')}|>\n{text}\n")
    parts.append("<|assistant|>\n")
    return "".join(parts)


def _fit(ids: list[int], room: int | None) -> list[int]:
    """The last `room` ids (the end of the conversation and the generation prompt)."""
    if room is None or len(ids) <= room:
        return ids
    return ids[-max(room, 1):]


def _schema_props(schema: Any) -> list[tuple[str, dict]]:
    if not isinstance(schema, dict) or schema.get("type") != "object" or not isinstance(schema.get("properties"), dict):
        raise InvalidArgument("this server constrains answers to flat JSON objects only (type object with properties)")
    props = schema["properties"]
    order = [k for k in schema.get("required") or [] if k in props] + \
        [k for k in props if k not in (schema.get("required") or [])]
    out = []
    for k in order:
        spec = props[k]
        if not isinstance(spec, dict):
            raise InvalidArgument(f"property {k!r}: not a schema")
        if "enum" in spec:
            if not spec["enum"] or not all(isinstance(v, str) for v in spec["enum"]):
                raise InvalidArgument(f"property {k!r}: only enums of strings are supported")
        elif spec.get("type") != "string":
            raise InvalidArgument(f"property {k!r}: only string and enum properties are supported")
        out.append((k, spec))
    return out


def _constrained(backend: Any, prompt: list[int], schema: Any, temperature: float, seed: int | None) -> str:
    tok = backend.tokenizer
    ctx = backend.max_context
    text = "{"
    for i, (name, spec) in enumerate(_schema_props(schema)):
        text += ("" if i == 0 else ", ") + json.dumps(name) + ": "
        if "enum" in spec:
            so_far = prompt + tok.encode(text)

            def total(v: str, so_far: list[int] = so_far) -> float:
                opt = tok.encode(json.dumps(v))
                head = _fit(so_far, None if ctx is None else ctx - len(opt))
                return sum(t.logprob for t in backend.score(head, opt, k=0))
            text += json.dumps(max(spec["enum"], key=total))
        else:
            head = _fit(prompt + tok.encode(text + '"'), None if ctx is None else ctx - STRING_TOKENS)
            out = b""
            for t in backend.stream(head, STRING_TOKENS, k=0, temperature=temperature, seed=seed):
                if t.id == tok.eos_id:
                    break
                out += tok.token_bytes(t.id)
                if b'"' in out or b"\n" in out:
                    break
            value = out.decode("utf-8", "replace").split('"')[0].split("\n")[0]
            text += json.dumps(value)
    return text + "}"


def chat_completion(backend: Any, body: dict) -> dict:
    """An OpenAI chat completion computed by `backend` (module doc); InvalidArgument for a bad body."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("messages must be a non-empty list")
    tok = backend.tokenizer
    temperature = float(body.get("temperature", 1.0) or 0.0)
    seed = body.get("seed")
    seed = None if seed is None else int(seed)
    max_new = max(1, min(int(body.get("max_tokens") or MAX_NEW), MAX_NEW))
    if backend.max_context is not None:  # at least half the context stays the prompt's
        max_new = min(max_new, max(1, backend.max_context // 2))
    full = tok.encode(render(messages, body.get("tools")))
    fmt = body.get("response_format") or {}
    tool_calls: list[dict] = []
    logprobs: dict | None = None
    if fmt.get("type") == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema")
        prompt = _fit(full, None if backend.max_context is None else backend.max_context - STRING_TOKENS - 8)
        content = _constrained(backend, prompt, schema, temperature, seed)
        ids = tok.encode(content)
        finish = "stop"
    else:
        prompt = _fit(full, None if backend.max_context is None else backend.max_context - max_new)
        infos = list(backend.stream(prompt, max_new, k=0, temperature=temperature, seed=seed))
        ids = [t.id for t in infos]
        if body.get("logprobs"):  # per generated token, as OpenAI's chat logprobs (no top-k here)
            logprobs = {"content": [{"token": tok.token_bytes(t.id).decode("utf-8", "replace"),
                                     "logprob": t.logprob, "top_logprobs": []} for t in infos]}
        finish = "stop" if ids and ids[-1] == tok.eos_id else "length"
        gen = [i for i in ids if i != tok.eos_id]
        content = b"".join(tok.token_bytes(i) for i in gen).decode("utf-8", "replace")
        from .adapters import parse_tool_calls  # here: adapters needs gymnasium (the rollout extra)

        for n, c in enumerate(parse_tool_calls(content)):
            if c["name"] != "__invalid__":
                tool_calls.append({"id": f"call_{n}", "type": "function",
                                   "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}})
        if tool_calls:
            finish = "tool_calls"
    return {"id": "chatcmpl-local", "object": "chat.completion", "model": backend.name,
            "choices": [{"index": 0, "finish_reason": finish, "token_ids": ids, "logprobs": logprobs,
                         "message": {"role": "assistant", "content": content, "tool_calls": tool_calls or None}}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                      "prompt_tokens_cut": len(full) - len(prompt)}}
