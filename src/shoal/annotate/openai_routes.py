"""`/v1/completions` over a `ModelBackend`, as vLLM answers it: token-id prompts, `logprobs` = top-k,
`echo` (prompt tokens scored too), `stream` (server-sent events), `return_tokens_as_token_ids`.

Mounted on the project's scripted OpenAI-compatible server by `--model PATH`, so the annotation
client is tested against a real HTTP server with a real model. `POST /admin/token_delay
{"seconds": s}` slows the stream down, for tests that stop the server mid-stream.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..core.errors import InvalidArgument
from .model import ModelBackend, TokenInfo


def add_completions(app: FastAPI, backend: ModelBackend) -> None:
    state: dict[str, Any] = {"token_delay_s": 0.0}
    tok = backend.tokenizer

    def name(i: int, as_ids: bool) -> str:
        return f"token_id:{i}" if as_ids else tok.token_bytes(i).decode(errors="replace")

    def lp_block(infos: list[TokenInfo], as_ids: bool, first_none: bool = False) -> dict:
        return {"tokens": [name(t.id, as_ids) for t in infos],
                "token_logprobs": [None if first_none and j == 0 else t.logprob for j, t in enumerate(infos)],
                "top_logprobs": [None if first_none and j == 0 else {name(c.id, as_ids): c.logprob for c in t.top}
                                 for j, t in enumerate(infos)],
                "text_offset": []}

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
            it = iter(gen)
            last = None
            while True:
                t = await asyncio.to_thread(next, it, None)
                if t is None:
                    break
                last = t
                if state["token_delay_s"]:
                    await asyncio.sleep(state["token_delay_s"])
                chunk = {"id": rid, "object": "text_completion", "created": created, "model": backend.name,
                         "choices": [{"index": 0, "text": tok.token_bytes(t.id).decode(errors="replace"),
                                      "finish_reason": None, "logprobs": lp_block([t], as_ids)}]}
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            finish = "stop" if last is not None and (last.id in stops or last.id == tok.eos_id) else "length"
            end = {"id": rid, "object": "text_completion", "created": created, "model": backend.name,
                   "choices": [{"index": 0, "text": "", "finish_reason": finish, "logprobs": None}]}
            yield f"data: {json.dumps(end)}\n\ndata: [DONE]\n\n".encode()

        return StreamingResponse(events(), media_type="text/event-stream")
