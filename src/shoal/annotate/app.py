"""`shoal annotate serve`: the annotation web app (FastAPI; one server-rendered page + plain JS).

Routes (all but /login need the annotator's cookie, set by /login?token=...):
  GET  /                               the annotator's queue
  GET  /item/{id}                      the annotation page
  GET  /api/tree/{id}                  the tree, the current dialog with per-token probabilities + top-k
  POST /api/tree/{id}/start            the first response (prompts: the model's, streamed; episodes: the
                                       episode's own turn)
  POST /api/tree/{id}/correct          {parent, pos, token | text, version}: saved at once, then the
                                       model's continuation from the corrected prefix, streamed (SSE)
  POST /api/tree/{id}/execute          {node, version}: an episode item's pending tool calls run in a
                                       branch of the episode (annotate.agent), saved as a `tool` node,
                                       then the model's continuation after their outputs, streamed
  POST /api/tree/{id}/label|undo       {node, label, version} / {version}
  POST /api/share                      {item, annotator}: an admin puts an item in an annotator's queue
Each annotator reads and writes only the items in their own queue (NotYourItem, 403); an admin all.
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
from .agent import TOOL_CLOSE, TOOL_OPEN, EpisodeEnv, ends_with_call, pending_calls, render_observation
from .model import ModelBackend, TokenInfo
from .tokens import split_text, text_of
from .tree import AnnotationStore, EditConflict, NotFound, NotYourItem, Tree

COOKIE = "shoal_annotator"
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
                               "episode_id": record.get("episode_id"), "instance_id": record.get("instance_id"),
                               "step": len(items)}})
    return items


class Annotator:
    """The app's state: the store, the model, and the scores of dialogs already shown."""

    def __init__(self, store: AnnotationStore, model: ModelBackend, k: int = 20, max_tokens: int = 96,
                 low_confidence: float = 0.3, env: EpisodeEnv | None = None):
        self.store, self.model, self.k, self.max_tokens, self.low = store, model, k, max_tokens, low_confidence
        self.env = env  # runs corrected tool calls of episode items (None: continuations stop at a tool call)
        self._scores: dict[tuple, list[TokenInfo]] = {}
        self._lock = threading.Lock()

    def prompt_ids(self, item: dict) -> list[int]:
        return self.model.encode_prompt(item["prompt"])

    def episode_base(self, item: dict, tree: Tree, node_id: int) -> tuple[str, int]:
        """(episode, step) whose state a node's pending tool calls run after: the branch of the nearest
        `tool` node above it, else the annotated episode after the steps before this item's."""
        ran = {o["node"]: o["data"] for o in tree.ops if o["op"] == "tool" and not o["undone"]}
        n: int | None = node_id
        while n is not None:
            node = tree.node(n)
            if node.op == "tool" and n in ran:
                return str(ran[n]["episode"]), int(ran[n]["step"])
            n = node.parent
        meta = item.get("meta") or {}
        if item.get("kind") != "episode" or not meta.get("episode_id"):
            raise InvalidArgument(f"item {item['id']!r} is not a step of an episode in the trajectory log")
        before = item["prompt"].get("messages", [])
        return str(meta["episode_id"]), sum(1 for m in before if m.get("role") == "assistant")

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
        base: dict[str, Any] = {"item": item, "low_confidence": self.low, "k": self.k, "model": self.model.name,
                                "env": self.env is not None and item.get("kind") == "episode"}
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
                           already: int, lead: list[int] | None = None) -> AsyncIterator[bytes]:
        """The model's continuation streamed as SSE, then saved on the node (what arrived before a
        failure is saved too, and the failure is reported as an `error` event). `lead`: tokens already
        saved on the node that the page has not drawn yet (tool outputs), sent first."""
        tok = self.model.tokenizer
        for j, view in enumerate(self.token_view(lead or [], offset=already - len(lead or []))):
            yield _sse("token", {**view, "src": "o", "first": j == 0})
        # a response that already ends with a whole tool call waits for it to run: nothing to write yet
        calls_done = text_of(tok, prefix[-16:]).rstrip().endswith(TOOL_CLOSE)
        gen = iter(self.model.stream(prefix, 0 if calls_done else self.max_tokens, self.k))
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
                    break  # the call runs when the annotator says so (execute), in a branch of the episode
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
            403 if isinstance(exc, NotYourItem) else 401 if isinstance(exc, Unauthorized) else \
            502 if isinstance(exc, LLMUnavailable) else 400 if isinstance(exc, InvalidArgument) else 500
        body: dict[str, Any] = {"type": type(exc).__name__, "message": str(exc)}
        if isinstance(exc, EditConflict):
            body["current_version"] = exc.current_version
        return JSONResponse({"error": body}, status_code=status)

    def who(request: Request) -> str:
        token = request.cookies.get(COOKIE) or request.headers.get("x-annotator-token")
        if not token:
            raise Unauthorized("log in first: open the /login?token=... link `shoal annotate` printed")
        return store.login(token)

    def may(request: Request, item_id: str) -> str:
        """The annotator, if the item is theirs to read and edit (NotYourItem otherwise)."""
        name = who(request)
        store.check_access(name, item_id)
        return name

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
        name = may(request, item_id)
        html = PAGE.read_text().replace("{{item_id}}", _script_json(item_id)).replace("{{annotator}}", _esc(name))
        return HTMLResponse(html)

    @app.get("/api/queue")
    async def api_queue(request: Request) -> list[dict]:
        return store.queue(who(request))

    @app.get("/api/tree/{item_id}")
    async def api_tree(item_id: str, request: Request, node: int | None = None) -> dict:
        may(request, item_id)
        return await asyncio.to_thread(ann.view, item_id, node)

    @app.post("/api/tree/{item_id}/start")
    async def api_start(item_id: str, request: Request):
        name = may(request, item_id)
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
        name = may(request, item_id)
        body = await request.json()
        try:
            parent, pos, version = int(body["parent"]), int(body["pos"]), int(body["version"])
        except (KeyError, TypeError, ValueError):
            raise InvalidArgument("correct needs integer parent, pos and version") from None
        tree = _tree(item_id)
        ann.prompt_ids(store.item(item_id))  # a chat client maps the prompt's ids back to its messages
        ptoks = tree.node(parent).tokens
        if not 0 <= pos <= len(ptoks):
            raise InvalidArgument(f"token position {pos} is outside node {parent}'s response (0..{len(ptoks)})")
        if tree.node(parent).sources[pos:pos + 1] == "o":
            raise InvalidArgument(f"token {pos} is a tool's output (the environment wrote it), not the model's: "
                                  "correct the tool call before it, or the model's text after it")
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

    @app.post("/api/tree/{item_id}/execute")
    async def api_execute(item_id: str, request: Request):
        name = may(request, item_id)
        body = await request.json()
        try:
            node_id, version = int(body["node"]), int(body["version"])
        except (KeyError, TypeError, ValueError):
            raise InvalidArgument("execute needs integer node and version") from None
        if ann.env is None:
            raise InvalidArgument("this app runs no environment: start it with --trajlog (and the episodes' "
                                  "sandboxes) to run corrected tool calls in a branch of the episode")
        item = store.item(item_id)
        tree = _tree(item_id)
        if tree.version != version:  # before a sandbox is made for nothing
            raise EditConflict(f"tree {item_id!r} is at version {tree.version}, not {version}: another annotator "
                               "changed it; reload to see their change, then redo yours", tree.version)
        node = tree.node(node_id)
        tok = ann.model.tokenizer
        text = text_of(tok, node.tokens)
        if not ends_with_call(text):
            raise InvalidArgument(f"node {node_id} does not end with a tool call that has not run yet")
        calls = pending_calls(text)
        base = ann.episode_base(item, tree, node_id)
        run = await asyncio.to_thread(ann.env.execute, item, base, calls)
        obs = tok.encode("".join(render_observation(o["text"]) for o in run.observations))
        nid, version = await asyncio.to_thread(store.tool_step, item_id, node_id, obs, name, version, run.to_dict())
        ann.prompt_ids(item)
        n = len(node.tokens) + len(obs)
        return StreamingResponse(ann.continuation(item_id, nid, tree.prompt_ids + node.tokens + obs, version, name,
                                                  n, lead=obs),
                                 media_type="text/event-stream",
                                 headers={"x-node": str(nid), "x-branch": run.episode, "x-strategy": run.strategy})

    @app.post("/api/tree/{item_id}/label")
    async def api_label(item_id: str, request: Request) -> dict:
        name = may(request, item_id)
        body = await request.json()
        version = await asyncio.to_thread(store.label, item_id, int(body["node"]), body.get("label"), name,
                                          int(body["version"]))
        if body.get("label") == "good":
            store.mark_done(name, item_id)
        return {"version": version}

    @app.post("/api/tree/{item_id}/undo")
    async def api_undo(item_id: str, request: Request) -> dict:
        name = may(request, item_id)
        body = await request.json()
        return {"version": await asyncio.to_thread(store.undo, item_id, name, int(body["version"]))}

    @app.get("/api/export/{kind}")
    async def api_export(kind: str, request: Request) -> PlainTextResponse:
        name = who(request)
        tok = ann.model.tokenizer
        fns = {"sft": lambda t: export.sft(t, tok), "pairs": lambda t: export.preference_pairs(t, tok),
               "token_level": lambda t: export.token_level(t, tok), "corrections": lambda t: export.corrections(t, tok)}
        if kind not in fns:
            raise InvalidArgument(f"unknown export {kind!r}; choose from {sorted(fns)}")
        rows = fns[kind](store.trees_for(name))  # only the annotator's own items (an admin's: all)
        return PlainTextResponse("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                                 media_type="application/jsonl")

    @app.post("/api/share")
    async def api_share(request: Request) -> dict:
        """An admin puts an item into an annotator's queue: {"item": id, "annotator": name}."""
        name = who(request)
        body = await request.json()
        store.share(name, str(body.get("item")), str(body.get("annotator")))
        return {"shared": body.get("item"), "with": body.get("annotator")}

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
