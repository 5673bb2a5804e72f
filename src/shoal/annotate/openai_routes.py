"""`/v1/completions` over a `ModelBackend`, as vLLM answers it: token-id prompts, `logprobs` = top-k,
`echo` (prompt tokens scored too), `stream` (server-sent events), `return_tokens_as_token_ids`.

Mounted on the project's scripted OpenAI-compatible server by `--model PATH`, so the annotation
client is tested against a real HTTP server with a real model. `add_completions` also returns the
chat handler (`chat_completion`) that the scripted server's `/v1/chat/completions` hands requests for
this model to: messages rendered by the model's chat template, an assistant-prefilled continuation
(`continue_final_message: true`, `add_generation_prompt: false`, vLLM's names), `logprobs` /
`top_logprobs` per token, streamed or not. `POST /admin/token_delay
{"seconds": s}` slows the stream down, for tests that stop the server mid-stream.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..core.errors import InvalidArgument
from .model import ModelBackend, TokenInfo


def add_completions(app: FastAPI, backend: ModelBackend) -> Callable[[dict], Awaitable[Any]]:
    state: dict[str, Any] = {"token_delay_s": 0.0}
    tok: Any = backend.tokenizer  # (its chat_prompt: HFTokenizer and CharTokenizer both have one)

    def name(i: int, as_ids: bool) -> str:
        return f"token_id:{i}" if as_ids else tok.token_bytes(i).decode(errors="replace")

    def lp_block(infos: list[TokenInfo], as_ids: bool, first_none: bool = False) -> dict:
        return {"tokens": [name(t.id, as_ids) for t in infos],
                "token_logprobs": [None if first_none and j == 0 else t.logprob for j, t in enumerate(infos)],
                "top_logprobs": [None if first_none and j == 0 else {name(c.id, as_ids): c.logprob for c in t.top}
                                 for j, t in enumerate(infos)],
                "text_offset": []}

    async def paced(gen: Any) -> AsyncIterator[TokenInfo]:
        """The backend's tokens, each made off the event loop, slowed by the admin delay."""
        it = iter(gen)
        while (t := await asyncio.to_thread(next, it, None)) is not None:
            if state["token_delay_s"]:
                await asyncio.sleep(state["token_delay_s"])
            yield t

    def sse(event: dict, done: bool = False) -> bytes:
        return f"data: {json.dumps(event)}\n\n".encode() + (b"data: [DONE]\n\n" if done else b"")

    @app.post("/admin/token_delay")
    async def token_delay(body: dict) -> dict:
        state["token_delay_s"] = float(body.get("seconds", 0))
        return state

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        if body.get("model") not in (None, backend.name):
            return JSONResponse({"error": {"message": f"unknown model {body.get('model')!r}; this server has "
                                                      f"{backend.name!r}"}}, status_code=404)
        prompt = body.get("prompt")
        try:
            ids = tok.encode(prompt) if isinstance(prompt, str) else [int(i) for i in prompt or []]
            if not ids:
                raise InvalidArgument("an empty prompt")
            k = int(body.get("logprobs") or 0)
            max_tokens = int(body.get("max_tokens", 16))
            temperature = float(body.get("temperature", 1.0))
            as_ids = bool(body.get("return_tokens_as_token_ids"))
            stops = [int(i) for i in body.get("stop_token_ids") or []]
            seed = body.get("seed")
            gen = backend.stream(ids, max_tokens, k, temperature, stops, None if seed is None else int(seed))
            echoed = ([TokenInfo(ids[0], 0.0)] + backend.score(ids[:1], ids[1:], k)) if body.get("echo") else []
        except (InvalidArgument, ValueError, TypeError) as e:
            return JSONResponse({"error": {"message": str(e), "type": "invalid_request_error"}}, status_code=400)
        rid, created = f"cmpl-{uuid.uuid4().hex[:12]}", int(time.time())

        if not body.get("stream"):
            out = await asyncio.to_thread(lambda: list(gen))
            finish = "stop" if out and (out[-1].id in stops or out[-1].id == tok.eos_id) else "length"
            infos = echoed + out
            text = b"".join(tok.token_bytes(t.id) for t in infos).decode(errors="replace")
            lps = lp_block(infos, as_ids, first_none=bool(echoed)) if k or echoed else None
            return {"id": rid, "object": "text_completion", "created": created, "model": backend.name,
                    "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": lps}],
                    "usage": {"prompt_tokens": len(ids), "completion_tokens": len(out)}}

        async def events() -> AsyncIterator[bytes]:
            last = None
            async for t in paced(gen):
                last = t
                chunk = {"id": rid, "object": "text_completion", "created": created, "model": backend.name,
                         "choices": [{"index": 0, "text": tok.token_bytes(t.id).decode(errors="replace"),
                                      "finish_reason": None, "logprobs": lp_block([t], as_ids)}]}
                yield sse(chunk)
            finish = "stop" if last is not None and (last.id in stops or last.id == tok.eos_id) else "length"
            end = {"id": rid, "object": "text_completion", "created": created, "model": backend.name,
                   "choices": [{"index": 0, "text": "", "finish_reason": finish, "logprobs": None}]}
            yield sse(end, done=True)

        return StreamingResponse(events(), media_type="text/event-stream")

    async def chat_completion(body: dict):
        """/v1/chat/completions for this model (the scripted server routes requests naming it here)."""
        msgs = body.get("messages") or []
        try:
            cont = bool(body.get("continue_final_message"))
            if cont and body.get("add_generation_prompt", True):
                raise InvalidArgument("continue_final_message needs add_generation_prompt: false")
            if not msgs or not all(isinstance(m, dict) for m in msgs):
                raise InvalidArgument("messages must be a non-empty list of message objects")
            if cont:
                if msgs[-1].get("role") != "assistant":
                    raise InvalidArgument("continue_final_message needs the last message to be the assistant's")
                # the template opens the assistant's turn; the prefilled text goes on from there
                ids = tok.encode(tok.chat_prompt(msgs[:-1])) + tok.encode(str(msgs[-1].get("content") or ""))
            else:
                ids = tok.encode(tok.chat_prompt(msgs))
            k = int(body.get("top_logprobs") or 0) if body.get("logprobs") else 0
            if k > 20:
                raise InvalidArgument("top_logprobs is at most 20")
            max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
            temperature = float(body.get("temperature", 1.0))
            as_ids = bool(body.get("return_tokens_as_token_ids"))
            stops = [int(i) for i in body.get("stop_token_ids") or []]
            seed = body.get("seed")
            gen = backend.stream(ids, max_tokens, k, temperature, stops, None if seed is None else int(seed))
        except (InvalidArgument, ValueError, TypeError) as e:
            return JSONResponse({"error": {"message": str(e), "type": "invalid_request_error"}}, status_code=400)
        rid, created = f"chatcmpl-{uuid.uuid4().hex[:12]}", int(time.time())
        want_lp = bool(body.get("logprobs"))

        def content_lp(t: TokenInfo) -> dict:
            return {"token": name(t.id, as_ids), "logprob": t.logprob, "bytes": list(tok.token_bytes(t.id)),
                    "top_logprobs": [{"token": name(c.id, as_ids), "logprob": c.logprob,
                                      "bytes": list(tok.token_bytes(c.id))} for c in t.top]}

        def finish(last: TokenInfo | None) -> str:
            return "stop" if last is not None and (last.id in stops or last.id == tok.eos_id) else "length"

        if not body.get("stream"):
            out = await asyncio.to_thread(lambda: list(gen))
            text = b"".join(tok.token_bytes(t.id) for t in out).decode(errors="replace")
            return {"id": rid, "object": "chat.completion", "created": created, "model": backend.name,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "finish_reason": finish(out[-1] if out else None),
                                 "logprobs": {"content": [content_lp(t) for t in out]} if want_lp else None}],
                    "usage": {"prompt_tokens": len(ids), "completion_tokens": len(out)}}

        async def events() -> AsyncIterator[bytes]:
            last = None
            head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": backend.name}
            first = {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                          "finish_reason": None, "logprobs": None}]}
            yield sse(first)
            async for t in paced(gen):
                last = t
                chunk = {**head, "choices": [{"index": 0, "finish_reason": None,
                                              "delta": {"content": tok.token_bytes(t.id).decode(errors="replace")},
                                              "logprobs": {"content": [content_lp(t)]} if want_lp else None}]}
                yield sse(chunk)
            end = {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": finish(last), "logprobs": None}]}
            yield sse(end, done=True)

        return StreamingResponse(events(), media_type="text/event-stream")

    return chat_completion
