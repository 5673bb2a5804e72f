"""`shoal annotate serve`: the annotation web app (FastAPI; one server-rendered page + plain JS).

Routes (all but /login need the annotator's cookie, set by /login?token=...):
  GET  /                               the annotator's queue
  GET  /item/{id}                      the annotation page
  GET  /api/tree/{id}                  the tree, the current dialog with per-token probabilities + top-k
  POST /api/tree/{id}/start            the first response (prompts: the model's, streamed; episodes: the
                                       episode's own turn)
  POST /api/tree/{id}/correct          {parent, pos, token | text, version}: saved at once, then the
                                       model's continuation from the corrected prefix, streamed (SSE)
  POST /api/tree/{id}/label|undo       {node, label, version} / {version}
  GET  /api/export/{sft|pairs|token_level|corrections}   JSON lines
A write made against an old version answers 409 with the current version (EditConflict).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, RedirectResponse, StreamingResponse

from ..core.errors import InvalidArgument, LLMUnavailable, ShoalError, Unauthorized
from . import export
from .model import ModelBackend, TokenInfo
from .tokens import split_text, text_of
from .tree import AnnotationStore, EditConflict, NotFound, Tree

COOKIE = "shoal_annotator"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
PAGE = (Path(__file__).parent / "page.html")


def render_turn(message: dict) -> str:
    """An assistant turn as the text the model writes: content, then each tool call in tags (the
    continuation of an agent turn stops at the end of the next tool call)."""
    out = str(message.get("content") or "")
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call)
        out += f"\n{TOOL_OPEN}{json.dumps({'name': fn.get('name'), 'arguments': fn.get('arguments')})}{TOOL_CLOSE}"
    return out


def episode_items(record: dict, stem: str) -> list[dict]:
    """Items for a Shoal episode (rollout.episode.EpisodeRecord as a dict): one per assistant step,
    the conversation before it as the prompt and the steps after it as read-only context."""
    msgs = record.get("messages") or []
    items: list[dict] = []
    for i, m in enumerate(msgs):
        if m.get("role") != "assistant":
            continue
        items.append({"id": f"{stem}-step{len(items)}", "kind": "episode",
                      "title": f"{record.get('instance_id', stem)} step {len(items)}",
                      "prompt": {"messages": msgs[:i]}, "response": [m],
                      "meta": {"after": msgs[i + 1:i + 7], "reward": record.get("reward"),
                               "episode_id": record.get("episode_id")}})
    return items


class Annotator:
    """The app's state: the store, the model, and the scores of dialogs already shown."""

    def __init__(self, store: AnnotationStore, model: ModelBackend, k: int = 20, max_tokens: int = 96,
                 low_confidence: float = 0.3):
        self.store, self.model, self.k, self.max_tokens, self.low = store, model, k, max_tokens, low_confidence
        self._scores: dict[tuple, list[TokenInfo]] = {}
        self._lock = threading.Lock()

    def prompt_ids(self, item: dict) -> list[int]:
        tok: Any = self.model.tokenizer
        p = item["prompt"]
        return tok.encode(p["text"] if "text" in p else tok.chat_prompt(p["messages"]))

    def scores(self, prompt_ids: list[int], tokens: list[int]) -> list[TokenInfo]:
        key = (tuple(prompt_ids), tuple(tokens))
        with self._lock:
            hit = self._scores.get(key)
        if hit is None:
            hit = self.model.score(prompt_ids, tokens, self.k)
            with self._lock:
                if len(self._scores) > 512:
                    self._scores.clear()
                self._scores[key] = hit
        return hit

    def token_view(self, ids: list[int], infos: list[TokenInfo] | None = None, offset: int = 0) -> list[dict]:
        tok = self.model.tokenizer
        texts = split_text(tok, ids)
        out = []
        for j, (i, text) in enumerate(zip(ids, texts, strict=True)):
            d: dict[str, Any] = {"i": offset + j, "id": i, "text": text, "hex": tok.token_bytes(i).hex()}
            if infos is not None:
                d["logprob"] = round(infos[j].logprob, 4)
                d["top"] = [{"id": c.id, "text": tok.token_bytes(c.id).decode(errors="replace"),
                             "logprob": round(c.logprob, 4)} for c in infos[j].top]
            out.append(d)
        return out

    def view(self, item_id: str, node_id: int | None = None) -> dict:
        item = self.store.item(item_id)
        tree = self.store.tree(item_id)
        base: dict[str, Any] = {"item": item, "low_confidence": self.low, "k": self.k, "model": self.model.name}
        if tree is None:
            return {**base, "version": 0, "nodes": [], "current": None}
        node = tree.node(node_id) if node_id is not None else tree.latest()
        if node is None or node.hidden:
            node = tree.latest()
        nodes = [{"id": n.id, "parent": n.parent, "op": n.op, "pos": n.pos, "label": n.label,
                  "annotator": n.annotator, "n": len(n.tokens), "typed": n.sources.count("t"),
                  "preview": text_of(self.model.tokenizer, n.tokens)[:80]} for n in tree.visible()]
        cur = None
        if node is not None:
            infos = self.scores(tree.prompt_ids, node.tokens)
            cur = {"id": node.id, "label": node.label, "sources": node.sources,
                   "tokens": self.token_view(node.tokens, infos)}
        return {**base, "version": tree.version, "nodes": nodes, "current": cur}

    async def continuation(self, item_id: str, node: int, prefix: list[int], version: int, annotator: str,
                           already: int) -> AsyncIterator[bytes]:
        """The model's continuation streamed as SSE, then saved on the node (what arrived before a
        failure is saved too, and the failure is reported as an `error` event)."""
        tok = self.model.tokenizer
        gen = iter(self.model.stream(prefix, self.max_tokens, self.k))
        got: list[int] = []
        error = None
        saved = False
        try:
            while True:
                try:
                    t = await asyncio.to_thread(next, gen, None)
                except (LLMUnavailable, ShoalError) as e:
                    error = str(e)
                    break
                if t is None:
                    break
                got.append(t.id)
                view = self.token_view([t.id], [t], offset=already + len(got) - 1)[0]
                yield _sse("token", view)
                if TOOL_CLOSE in text_of(tok, got[-32:]):
                    break  # until FLARE branching lands: no tool output to continue with
            version = await asyncio.to_thread(self.store.extend, item_id, node, got, "g" * len(got), annotator,
                                              version)
            saved = True
            if error:
                yield _sse("error", {"message": error, "saved_tokens": len(got), "version": version})
            yield _sse("done", {"version": version, "node": node, "n": len(got)})
        finally:
            if not saved and got:
                # the browser went away mid-stream (closed, crashed): keep what the model wrote; an
                # EditConflict here means the save above had already gone through
                with contextlib.suppress(ShoalError):
                    self.store.extend(item_id, node, got, "g" * len(got), annotator, version)


def _sse(event: str, data: dict) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


def make_app(ann: Annotator) -> FastAPI:
    app = FastAPI(title="shoal annotate")
    store = ann.store

    @app.exception_handler(ShoalError)
    async def shoal_error(request: Request, exc: ShoalError) -> JSONResponse:
        status = 409 if isinstance(exc, EditConflict) else 404 if isinstance(exc, NotFound) else \
            401 if isinstance(exc, Unauthorized) else 502 if isinstance(exc, LLMUnavailable) else \
            400 if isinstance(exc, InvalidArgument) else 500
        body: dict[str, Any] = {"type": type(exc).__name__, "message": str(exc)}
        if isinstance(exc, EditConflict):
            body["current_version"] = exc.current_version
        return JSONResponse({"error": body}, status_code=status)

    def who(request: Request) -> str:
        token = request.cookies.get(COOKIE) or request.headers.get("x-annotator-token")
        if not token:
            raise Unauthorized("log in first: open the /login?token=... link `shoal annotate` printed")
        return store.login(token)

    @app.get("/login")
    async def login(token: str) -> RedirectResponse:
        store.login(token)
        r = RedirectResponse("/", status_code=303)
        r.set_cookie(COOKIE, token, httponly=True, samesite="strict")
        return r

    @app.get("/", response_class=HTMLResponse)
    async def queue_page(request: Request) -> HTMLResponse:
        try:
            name = who(request)
        except Unauthorized as e:
            return HTMLResponse(f"<!doctype html><title>shoal annotate</title><p>{e}</p>", status_code=401)
        rows = "".join(
            f'<li class="{"done" if q["done"] else "todo"}"><a href="/item/{_esc(quote(q["item_id"], safe=""))}">'
            f'{_esc(q["title"])}</a> <span class="kind">{_esc(q["kind"])}</span>{" ✓" if q["done"] else ""}</li>'
            for q in store.queue(name))
        return HTMLResponse(QUEUE_HTML.replace("{name}", _esc(name)).replace("{rows}", rows or "<li>empty</li>"))

    @app.get("/item/{item_id}", response_class=HTMLResponse)
    async def item_page(item_id: str, request: Request) -> HTMLResponse:
        name = who(request)
        store.item(item_id)
        html = PAGE.read_text().replace("{{item_id}}", _script_json(item_id)).replace("{{annotator}}", _esc(name))
        return HTMLResponse(html)

    @app.get("/api/queue")
    async def api_queue(request: Request) -> list[dict]:
        return store.queue(who(request))

    @app.get("/api/tree/{item_id}")
    async def api_tree(item_id: str, request: Request, node: int | None = None) -> dict:
        who(request)
        return await asyncio.to_thread(ann.view, item_id, node)

    @app.post("/api/tree/{item_id}/start")
    async def api_start(item_id: str, request: Request):
        name = who(request)
        item = store.item(item_id)
        prompt_ids = ann.prompt_ids(item)
        if item["response"]:
            ids = ann.model.tokenizer.encode("".join(render_turn(m) for m in item["response"]))
            _, version = store.start(item_id, prompt_ids, ids, "e" * len(ids), name, ann.model.name)
            return {"version": version, "node": 0}
        _, version = store.start(item_id, prompt_ids, [], "", name, ann.model.name)
        return StreamingResponse(ann.continuation(item_id, 0, prompt_ids, version, name, 0),
                                 media_type="text/event-stream")

    @app.post("/api/tree/{item_id}/correct")
    async def api_correct(item_id: str, request: Request):
        name = who(request)
        body = await request.json()
        try:
            parent, pos, version = int(body["parent"]), int(body["pos"]), int(body["version"])
        except (KeyError, TypeError, ValueError):
            raise InvalidArgument("correct needs integer parent, pos and version") from None
        tree = _tree(item_id)
        ptoks = tree.node(parent).tokens
        if not 0 <= pos <= len(ptoks):
            raise InvalidArgument(f"token position {pos} is outside node {parent}'s response (0..{len(ptoks)})")
        if "token" in body:
            tokens, sources = [int(body["token"])], "c"
            ann.model.tokenizer.token_bytes(tokens[0])  # an id outside the vocabulary: InvalidArgument
        elif body.get("text"):
            # typed text joins the prefix's text and is tokenized the model's way: the prefix keeps its
            # tokens, the typed characters get the model's own tokens after it
            tokens = ann.model.tokenizer.encode(str(body["text"]))
            sources = "t" * len(tokens)
        else:
            raise InvalidArgument("correct needs a candidate 'token' id or typed 'text'")
        node, version = await asyncio.to_thread(store.correct, item_id, parent, pos, tokens, sources, name, version)
        prefix = tree.prompt_ids + ptoks[:pos] + tokens
        return StreamingResponse(ann.continuation(item_id, node, prefix, version, name, pos + len(tokens)),
                                 media_type="text/event-stream", headers={"x-node": str(node)})

    @app.post("/api/tree/{item_id}/label")
    async def api_label(item_id: str, request: Request) -> dict:
        name = who(request)
        body = await request.json()
        version = await asyncio.to_thread(store.label, item_id, int(body["node"]), body.get("label"), name,
                                          int(body["version"]))
        if body.get("label") == "good":
            store.mark_done(name, item_id)
        return {"version": version}

    @app.post("/api/tree/{item_id}/undo")
    async def api_undo(item_id: str, request: Request) -> dict:
        name = who(request)
        body = await request.json()
        return {"version": await asyncio.to_thread(store.undo, item_id, name, int(body["version"]))}

    @app.get("/api/export/{kind}")
    async def api_export(kind: str, request: Request) -> PlainTextResponse:
        who(request)
        tok = ann.model.tokenizer
        fns = {"sft": lambda t: export.sft(t, tok), "pairs": lambda t: export.preference_pairs(t, tok),
               "token_level": lambda t: export.token_level(t, tok), "corrections": lambda t: export.corrections(t, tok)}
        if kind not in fns:
            raise InvalidArgument(f"unknown export {kind!r}; choose from {sorted(fns)}")
        rows = fns[kind](store.trees())
        return PlainTextResponse("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                                 media_type="application/jsonl")

    def _tree(item_id: str) -> Tree:
        t = store.tree(item_id)
        if t is None:
            raise NotFound(f"item {item_id!r} has no annotation tree yet: start it first")
        return t

    return app


def _script_json(v: object) -> str:
    """JSON to embed in a <script>: `</script>` or `<!--` in an item id (the data file's to choose)
    cannot end the script or open a comment."""
    return json.dumps(v).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _esc(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


QUEUE_HTML = """<!doctype html><html><head><meta charset="utf-8"><title>shoal annotate: queue</title>
<style>body{font:15px system-ui,sans-serif;margin:2em;max-width:50em}li{margin:.3em 0}.done a{color:#777}
.kind{font-size:12px;color:#888;border:1px solid #ccc;border-radius:3px;padding:0 4px}</style></head>
<body><h1>Queue of {name}</h1><p>Open an item; <kbd>n</kbd> on an item goes to the next one.</p>
<ol id="queue">{rows}</ol><p>Export: <a href="/api/export/sft">SFT</a> · <a href="/api/export/pairs">preference
pairs</a> · <a href="/api/export/token_level">token-level</a> · <a href="/api/export/corrections">corrections</a>
</p></body></html>"""
