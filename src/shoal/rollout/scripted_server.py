"""An OpenAI-compatible chat endpoint that answers with a scripted policy.

It lets the HTTP policy path (retries, outages, token ids, logprobs) run end to end on a machine
without a GPU: `model` picks the policy ("oracle", "null", "random"); the oracle finds its task by
the problem statement in the conversation. `POST /admin/outage {"seconds": s, "status": 503}` makes
it fail for a while, for outage tests and demos. Models "desktop-oracle", "desktop-oracle:detour" and
"desktop-judge" answer vision requests for desktop tasks and refuse any without a real PNG
(`tasks.desktop.scripted`). Model "judge" (or "judge-bad:N": N invalid answers
first) answers FLARE's step-judge prompt (`flare.judge.scripted_judge_completion`). With `--model
PATH` a real local model answers chat requests that name it: agents' and judges' (with `tools` or
`response_format`, or neither and none of the annotation client's fields) through
`rollout.local_chat`, the annotation client's (`continue_final_message`, `logprobs`, `stream`, ...)
through `annotate.openai_routes`.

    python -m shoal.rollout.scripted_server --port 8011   # then SHOAL_LLM_URL=http://127.0.0.1:8011/v1
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ..tasks.swe.suite import load_suite
from .policy import NullPolicy, OraclePolicy, RandomEditPolicy, ScriptedPolicy

ANNOTATE_FEATURES = ("continue_final_message", "add_generation_prompt", "logprobs", "top_logprobs", "stream")


def make_app(suite: str | None = None, model: str | None = None) -> FastAPI:
    """`model`: a local model (HF directory or shoal.train.repro checkpoint) served on /v1/completions
    with real logprobs and top-k (shoal.annotate.openai_routes), beside the scripted chat policies."""
    app = FastAPI(title="shoal scripted chat endpoint")
    served: Any = None  # the local model's chat handler, for requests that name it
    served_name = None
    local = None
    if model:
        from ..annotate.model import LocalModel
        from ..annotate.openai_routes import add_completions

        local = LocalModel.load(model)
        served, served_name = add_completions(app, local), local.name
    by_statement = {t.problem_statement: t for t in load_suite(suite)}
    state: dict[str, Any] = {"down_until": 0.0, "status": 503, "requests": 0, "failed": 0}
    desktop_models: list[Any] = []

    def desktop() -> Any:  # the desktop suite's scripted models (tasks.desktop.scripted), made on first use
        if not desktop_models:
            from ..tasks.desktop.scripted import DesktopModels

            desktop_models.append(DesktopModels(os.environ.get("SHOAL_DESKTOP_SUITE")))
        return desktop_models[0]

    @app.post("/admin/outage")
    async def outage(body: dict) -> dict:
        state["down_until"] = time.time() + float(body.get("seconds", 0))
        state["status"] = int(body.get("status", 503))
        return {"down_until": state["down_until"]}

    @app.get("/admin/stats")
    async def stats() -> dict:
        return {k: v for k, v in state.items()}

    @app.get("/v1/models")
    async def models() -> dict:
        names = ("oracle", "null", "random") + ((local.name,) if local is not None else ())
        return {"object": "list", "data": [{"id": m, "object": "model"} for m in names]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        state["requests"] += 1
        if time.time() < state["down_until"]:
            state["failed"] += 1
            return JSONResponse({"error": {"message": "scripted outage", "type": "server_error"}},
                                status_code=state["status"])
        body = await request.json()
        if served is not None and body.get("model") == served_name:
            agentic = body.get("tools") or body.get("response_format")
            if not agentic and any(k in body for k in ANNOTATE_FEATURES):  # the annotation client's chat
                return await served(body)
            import asyncio

            from ..core.errors import InvalidArgument
            from .local_chat import chat_completion

            try:  # agents and judges: tool calls, a JSON schema, the prompt cut to the context
                return await asyncio.to_thread(chat_completion, local, body)
            except (InvalidArgument, ValueError, TypeError) as e:
                return JSONResponse({"error": {"message": str(e), "type": "invalid_request_error"}}, status_code=400)
        messages = body.get("messages") or []
        model = body.get("model", "oracle")
        if str(model).startswith("desktop"):  # vision requests: a real PNG screenshot is required
            status, reply = desktop().complete(body)
            state["desktop_pngs"] = desktop().pngs
            return reply if status == 200 else JSONResponse(reply, status_code=status)
        if str(model).startswith("judge"):  # FLARE's step judge, answered by the programmatic diagnoser
            from ..flare.judge import scripted_judge_completion

            return scripted_judge_completion(body)
        if model == "oracle":
            statement = next((m.get("content") for m in messages if m.get("role") == "user"), "")
            task = by_statement.get(statement)
            if task is None:
                return JSONResponse({"error": {"message": "no task has this problem statement"}}, status_code=400)
            policy: ScriptedPolicy = OraclePolicy(task.patch)
        elif model == "null":
            policy = NullPolicy()
        elif model.startswith("random"):
            policy = RandomEditPolicy(int(model.partition(":")[2] or 0))
        else:
            return JSONResponse({"error": {"message": f"unknown model {model!r}"}}, status_code=404)
        step = sum(1 for m in messages if m.get("role") == "assistant")
        out = policy.act(step, messages)
        text = out["content"] + json.dumps(out["tool_calls"])
        token_ids = list(text.encode())  # a byte-level "tokenizer": lets trainers' code paths run
        choice = {"index": 0, "finish_reason": "tool_calls" if out["tool_calls"] else "stop",
                  "message": {"role": "assistant", "content": out["content"] or None,
                              "tool_calls": out["tool_calls"] or None},
                  "token_ids": token_ids}
        if body.get("logprobs"):
            choice["logprobs"] = {"content": [{"token": chr(b) if 32 <= b < 127 else f"<0x{b:02x}>",
                                               "logprob": -0.01, "top_logprobs": []} for b in token_ids]}
        return {"id": f"chatcmpl-{uuid.uuid4().hex[:12]}", "object": "chat.completion", "created": int(time.time()),
                "model": model, "choices": [choice],
                "usage": {"prompt_tokens": sum(len(str(m.get("content") or "")) for m in messages),
                          "completion_tokens": len(token_ids)}}

    return app


def spawn(*args: str, env: dict[str, str] | None = None, timeout: float = 60.0) -> tuple[subprocess.Popen, str]:
    """This server as a real process on a free loopback port (for tests and benchmarks): the process
    and its base URL, once it answers `/v1/models`. `args` are extra flags (`--suite`, `--model`).
    The caller ends the process."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "shoal.rollout.scripted_server", "--port", str(port), *args],
                            env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/v1/models", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"the scripted server did not start (exit code {proc.returncode})")
        time.sleep(0.05)


def main() -> None:
    import argparse

    import uvicorn

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--suite", default=None)
    ap.add_argument("--model", default=None, help="also serve this local model on /v1/completions")
    a = ap.parse_args()
    uvicorn.run(make_app(a.suite, a.model), host=a.host, port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
