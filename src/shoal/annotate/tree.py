"""The annotation tree: one per item (a prompt or a Shoal episode), every operation a node, saved as made.

A node is one dialog state: the full response as token ids, and per token who wrote it:
  "g" the model generated it, "c" an annotator picked it from the model's top-k candidates,
  "t" an annotator typed it, "e" it came from the episode being annotated (the original policy),
  "o" the environment wrote it (a tool's output, run in a branch of the episode: annotate.agent).
Operations: `root` (the first response), `correct` (parent's tokens up to `pos`, then a replacement;
the model's continuation is appended to the same node by `extend`), `tool` (the parent's pending
tool calls run in a branch of the episode: parent's tokens, then their outputs; the op's data names
the branch), `label` (good / bad), `undo`.

Concurrency: every tree has a version; each write names the version it was made against and fails
with `EditConflict` (HTTP 409) if another annotator wrote first. Nothing is overwritten: undo hides a
node, it never deletes one. SQLite (core.sqlite) by default; PostgreSQL (core.postgres) for a DSN.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..core.errors import InvalidArgument, ShoalError, Unauthorized
from ..core.sqlite import PerThreadDB, is_postgres_url

SOURCES = "gcteo"


class EditConflict(ShoalError):
    """Another annotator changed this tree since you loaded it: reload, then redo the operation."""

    def __init__(self, message: str, current_version: int):
        super().__init__(message)
        self.current_version = current_version


class NotFound(ShoalError, LookupError):
    pass


class NotYourItem(ShoalError, PermissionError):
    """An annotator asked for an item outside their queue (HTTP 403): each annotator sees and edits only
    their own items, and the ones an admin shared with them."""


@dataclass
class Node:
    id: int
    parent: int | None
    op: str  # root | correct | tool
    pos: int  # correct: index of the first replaced token (root: 0)
    tokens: list[int]
    sources: str  # one of SOURCES per token
    annotator: str
    created: float
    label: str | None = None  # "good" | "bad" | None
    hidden: bool = False  # undone

    @property
    def is_good(self) -> bool:
        return self.label == "good" and not self.hidden


@dataclass
class Tree:
    item_id: str
    version: int
    prompt: dict  # {"messages": [...]} or {"text": "..."}
    prompt_ids: list[int]
    nodes: list[Node] = field(default_factory=list)
    ops: list[dict] = field(default_factory=list)

    def node(self, node_id: int) -> Node:
        for n in self.nodes:
            if n.id == node_id:
                return n
        raise NotFound(f"tree {self.item_id!r} has no node {node_id}")

    def visible(self) -> list[Node]:
        return [n for n in self.nodes if not n.hidden]

    def latest(self) -> Node | None:
        vis = self.visible()
        return vis[-1] if vis else None


SCHEMA = """
CREATE TABLE IF NOT EXISTS ann_items (id TEXT PRIMARY KEY, kind TEXT NOT NULL, title TEXT NOT NULL,
    prompt TEXT NOT NULL, response TEXT, meta TEXT NOT NULL, created DOUBLE PRECISION NOT NULL);
CREATE TABLE IF NOT EXISTS ann_annotators (name TEXT PRIMARY KEY, token_hash TEXT NOT NULL,
    created DOUBLE PRECISION NOT NULL);
CREATE TABLE IF NOT EXISTS ann_admins (name TEXT PRIMARY KEY);
CREATE TABLE IF NOT EXISTS ann_queue (annotator TEXT NOT NULL, item_id TEXT NOT NULL, seq INTEGER NOT NULL,
    done INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (annotator, item_id));
CREATE TABLE IF NOT EXISTS ann_trees (item_id TEXT PRIMARY KEY, version INTEGER NOT NULL, prompt_ids TEXT NOT NULL,
    model TEXT NOT NULL, next_node INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS ann_nodes (item_id TEXT NOT NULL, id INTEGER NOT NULL, parent INTEGER, op TEXT NOT NULL,
    pos INTEGER NOT NULL, tokens TEXT NOT NULL, sources TEXT NOT NULL, annotator TEXT NOT NULL,
    created DOUBLE PRECISION NOT NULL, label TEXT, hidden INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (item_id, id));
CREATE TABLE IF NOT EXISTS ann_ops (item_id TEXT NOT NULL, version INTEGER NOT NULL, op TEXT NOT NULL,
    node INTEGER, annotator TEXT NOT NULL, data TEXT NOT NULL, created DOUBLE PRECISION NOT NULL,
    undone INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (item_id, version));
"""


class _DB:
    """The few statements the store needs, on SQLite or PostgreSQL ('?' placeholders either way)."""

    def __init__(self, where: str | os.PathLike):
        self.pg = is_postgres_url(where)
        if self.pg:
            from ..core.postgres import PerThreadPG

            self._pg = PerThreadPG(str(where))
        else:
            self._lite = PerThreadDB(where)
        for stmt in SCHEMA.split(";"):
            if stmt.strip():
                self.execute(stmt)

    def _sql(self, sql: str) -> str:
        return sql.replace("?", "%s") if self.pg else sql

    def execute(self, sql: str, args: tuple = ()) -> Any:
        if self.pg:
            return self._pg.execute(self._sql(sql), args)
        return self._lite.get().execute(sql, args)

    @contextlib.contextmanager
    def tx(self) -> Iterator[Any]:
        if self.pg:
            with self._pg.transaction() as conn:
                yield _Conn(conn, self)
        else:
            with self._lite.transaction() as conn:
                yield _Conn(conn, self)

    def close(self) -> None:
        (self._pg if self.pg else self._lite).close()


class _Conn:
    def __init__(self, conn: Any, db: _DB):
        self.conn, self.db = conn, db

    def execute(self, sql: str, args: tuple = ()) -> Any:
        return self.conn.execute(self.db._sql(sql), args)


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class AnnotationStore:
    def __init__(self, where: str | os.PathLike):
        self.db = _DB(where)

    def close(self) -> None:
        self.db.close()

    # ---------------------------------------------------------------- accounts and queues
    def add_annotator(self, name: str, admin: bool = False) -> str:
        """Creates (or re-keys) an account; returns its login token (only its hash is stored). An admin
        sees every item and shares items into other annotators' queues."""
        if not name or not name.replace("-", "").replace("_", "").isalnum():
            raise InvalidArgument(f"annotator name {name!r}: letters, digits, - and _ only")
        token = secrets.token_urlsafe(18)
        with self.db.tx() as c:
            c.execute("DELETE FROM ann_annotators WHERE name = ?", (name,))
            c.execute("INSERT INTO ann_annotators VALUES (?, ?, ?)", (name, _hash(token), time.time()))
            c.execute("DELETE FROM ann_admins WHERE name = ?", (name,))
            if admin:
                c.execute("INSERT INTO ann_admins VALUES (?)", (name,))
        return token

    def is_admin(self, name: str) -> bool:
        return self.db.execute("SELECT 1 FROM ann_admins WHERE name = ?", (name,)).fetchone() is not None

    def check_access(self, annotator: str, item_id: str) -> None:
        """NotFound for no such item; NotYourItem unless it is in the annotator's queue (or they are an admin)."""
        self.item(item_id)
        if self.is_admin(annotator):
            return
        row = self.db.execute("SELECT 1 FROM ann_queue WHERE annotator = ? AND item_id = ?",
                              (annotator, item_id)).fetchone()
        if row is None:
            raise NotYourItem(f"item {item_id!r} is not in {annotator}'s queue: an annotator sees and edits only "
                              "their own items (an admin can share this one with you)")

    def share(self, admin: str, item_id: str, annotator: str) -> None:
        """An admin puts an item into another annotator's queue (they may then read and edit it)."""
        if not self.is_admin(admin):
            raise NotYourItem(f"{admin} is not an admin: only an admin shares items")
        self.item(item_id)
        if annotator not in self.annotators():
            raise NotFound(f"no annotator {annotator!r}")
        self.assign(annotator, [item_id])

    def trees_for(self, annotator: str) -> list[Tree]:
        """The trees an annotator may export: their queue's (an admin's: all)."""
        if self.is_admin(annotator):
            return self.trees()
        mine = {q["item_id"] for q in self.queue(annotator)}
        return [t for t in self.trees() if t.item_id in mine]

    def login(self, token: str) -> str:
        row = self.db.execute("SELECT name FROM ann_annotators WHERE token_hash = ?", (_hash(token),)).fetchone()
        if row is None:
            raise Unauthorized("unknown login token")
        return str(row[0])

    def annotators(self) -> list[str]:
        return [r[0] for r in self.db.execute("SELECT name FROM ann_annotators ORDER BY name").fetchall()]

    def add_item(self, item_id: str, prompt: dict, *, kind: str = "prompt", title: str = "",
                 response: list[dict] | None = None, meta: dict | None = None) -> None:
        """`prompt`: {"messages": [...]} or {"text": "..."}; `response`: an episode's assistant turns
        (and tool calls) after the prompt, annotated as the root."""
        if not ({"messages", "text"} & set(prompt)):
            raise InvalidArgument("an item's prompt needs 'messages' or 'text'")
        self.db.execute("INSERT INTO ann_items VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO NOTHING",
                        (item_id, kind, title or item_id, json.dumps(prompt),
                         None if response is None else json.dumps(response), json.dumps(meta or {}), time.time()))

    def item(self, item_id: str) -> dict:
        row = self.db.execute("SELECT id, kind, title, prompt, response, meta FROM ann_items WHERE id = ?",
                              (item_id,)).fetchone()
        if row is None:
            raise NotFound(f"no item {item_id!r}")
        return {"id": row[0], "kind": row[1], "title": row[2], "prompt": json.loads(row[3]),
                "response": None if row[4] is None else json.loads(row[4]), "meta": json.loads(row[5])}

    def items(self) -> list[str]:
        return [r[0] for r in self.db.execute("SELECT id FROM ann_items ORDER BY created, id").fetchall()]

    def assign(self, annotator: str, item_ids: list[str]) -> None:
        with self.db.tx() as c:
            row = c.execute("SELECT COALESCE(MAX(seq), 0) FROM ann_queue WHERE annotator = ?", (annotator,)).fetchone()
            seq = int(row[0])
            for i in item_ids:
                seq += 1
                c.execute("INSERT INTO ann_queue VALUES (?, ?, ?, 0) ON CONFLICT (annotator, item_id) DO NOTHING",
                          (annotator, i, seq))

    def queue(self, annotator: str) -> list[dict]:
        rows = self.db.execute("SELECT q.item_id, q.done, i.title, i.kind FROM ann_queue q JOIN ann_items i "
                               "ON i.id = q.item_id WHERE q.annotator = ? ORDER BY q.seq", (annotator,)).fetchall()
        return [{"item_id": r[0], "done": bool(r[1]), "title": r[2], "kind": r[3]} for r in rows]

    def mark_done(self, annotator: str, item_id: str, done: bool = True) -> None:
        self.db.execute("UPDATE ann_queue SET done = ? WHERE annotator = ? AND item_id = ?",
                        (int(done), annotator, item_id))

    # ---------------------------------------------------------------- the tree
    def tree(self, item_id: str) -> Tree | None:
        row = self.db.execute("SELECT version, prompt_ids FROM ann_trees WHERE item_id = ?", (item_id,)).fetchone()
        if row is None:
            return None
        item = self.item(item_id)
        nodes = [Node(r[0], r[1], r[2], r[3], json.loads(r[4]), r[5], r[6], r[7], r[8], bool(r[9]))
                 for r in self.db.execute(
                     "SELECT id, parent, op, pos, tokens, sources, annotator, created, label, hidden FROM ann_nodes "
                     "WHERE item_id = ? ORDER BY id", (item_id,)).fetchall()]
        ops = [{"version": r[0], "op": r[1], "node": r[2], "annotator": r[3], "data": json.loads(r[4]),
                "undone": bool(r[5])}
               for r in self.db.execute("SELECT version, op, node, annotator, data, undone FROM ann_ops "
                                        "WHERE item_id = ? ORDER BY version", (item_id,)).fetchall()]
        return Tree(item_id, int(row[0]), item["prompt"], json.loads(row[1]), nodes, ops)

    def trees(self) -> list[Tree]:
        ids = [r[0] for r in self.db.execute("SELECT item_id FROM ann_trees ORDER BY item_id").fetchall()]
        return [t for i in ids if (t := self.tree(i)) is not None]

    @contextlib.contextmanager
    def _write(self, item_id: str, expect_version: int, annotator: str, op: str, node: int | None,
               data: dict) -> Iterator[tuple[Any, int]]:
        """A write against `expect_version`: the version moves on by one, or EditConflict."""
        with self.db.tx() as c:
            row = c.execute("SELECT version FROM ann_trees WHERE item_id = ?", (item_id,)).fetchone()
            if row is None:
                raise NotFound(f"item {item_id!r} has no annotation tree yet")
            current = int(row[0])
            if current != expect_version:
                raise EditConflict(f"tree {item_id!r} is at version {current}, not {expect_version}: another "
                                   f"annotator changed it; reload to see their change, then redo yours", current)
            c.execute("UPDATE ann_trees SET version = ? WHERE item_id = ? AND version = ?",
                      (current + 1, item_id, current))
            c.execute("INSERT INTO ann_ops VALUES (?, ?, ?, ?, ?, ?, ?, 0)",
                      (item_id, current + 1, op, node, annotator, json.dumps(data), time.time()))
            yield c, current + 1

    def start(self, item_id: str, prompt_ids: list[int], tokens: list[int], sources: str, annotator: str,
              model: str = "") -> tuple[int, int]:
        """The tree's root (the first response). Returns (node id, version). A tree that already
        exists is an EditConflict (another annotator started it first)."""
        self.item(item_id)
        _check_sources(tokens, sources)
        with self.db.tx() as c:
            row = c.execute("SELECT version FROM ann_trees WHERE item_id = ?", (item_id,)).fetchone()
            if row is not None:
                raise EditConflict(f"tree {item_id!r} was already started; reload", int(row[0]))
            c.execute("INSERT INTO ann_trees VALUES (?, 1, ?, ?, 1)", (item_id, json.dumps(prompt_ids), model))
            c.execute("INSERT INTO ann_nodes VALUES (?, 0, NULL, 'root', 0, ?, ?, ?, ?, NULL, 0)",
                      (item_id, json.dumps(tokens), sources, annotator, time.time()))
            c.execute("INSERT INTO ann_ops VALUES (?, 1, 'root', 0, ?, '{}', ?, 0)", (item_id, annotator, time.time()))
        return 0, 1

    def correct(self, item_id: str, parent: int, pos: int, tokens: list[int], sources: str, annotator: str,
                expect_version: int) -> tuple[int, int]:
        """A new node: parent's tokens before `pos`, then `tokens` (typed "t" or picked "c"). Returns
        (node id, version); the continuation is appended with `extend`."""
        _check_sources(tokens, sources)
        with self._write(item_id, expect_version, annotator, "correct", None,
                         {"parent": parent, "pos": pos}) as (c, version):
            row = c.execute("SELECT tokens, sources, hidden FROM ann_nodes WHERE item_id = ? AND id = ?",
                            (item_id, parent)).fetchone()
            if row is None or row[2]:
                raise NotFound(f"tree {item_id!r} has no node {parent}")
            ptoks = json.loads(row[0])
            if not 0 <= pos <= len(ptoks):
                raise InvalidArgument(f"token position {pos} is outside node {parent}'s response "
                                      f"(0..{len(ptoks)})")
            nid = int(c.execute("SELECT next_node FROM ann_trees WHERE item_id = ?", (item_id,)).fetchone()[0])
            c.execute("UPDATE ann_trees SET next_node = ? WHERE item_id = ?", (nid + 1, item_id))
            c.execute("INSERT INTO ann_nodes VALUES (?, ?, ?, 'correct', ?, ?, ?, ?, ?, NULL, 0)",
                      (item_id, nid, parent, pos, json.dumps(ptoks[:pos] + tokens), row[1][:pos] + sources,
                       annotator, time.time()))
            c.execute("UPDATE ann_ops SET node = ? WHERE item_id = ? AND version = ?", (nid, item_id, version))
        return nid, version

    def tool_step(self, item_id: str, parent: int, tokens: list[int], annotator: str, expect_version: int,
                  data: dict) -> tuple[int, int]:
        """A new node: the parent's tokens, then the tool outputs (source "o"); `data` (the branch that
        ran them) is kept on the op. Returns (node id, version); the model's continuation is appended
        with `extend`."""
        with self._write(item_id, expect_version, annotator, "tool", None, data) as (c, version):
            row = c.execute("SELECT tokens, sources, hidden FROM ann_nodes WHERE item_id = ? AND id = ?",
                            (item_id, parent)).fetchone()
            if row is None or row[2]:
                raise NotFound(f"tree {item_id!r} has no node {parent}")
            ptoks = json.loads(row[0])
            nid = int(c.execute("SELECT next_node FROM ann_trees WHERE item_id = ?", (item_id,)).fetchone()[0])
            c.execute("UPDATE ann_trees SET next_node = ? WHERE item_id = ?", (nid + 1, item_id))
            c.execute("INSERT INTO ann_nodes VALUES (?, ?, ?, 'tool', ?, ?, ?, ?, ?, NULL, 0)",
                      (item_id, nid, parent, len(ptoks), json.dumps(ptoks + tokens), row[1] + "o" * len(tokens),
                       annotator, time.time()))
            c.execute("UPDATE ann_ops SET node = ? WHERE item_id = ? AND version = ?", (nid, item_id, version))
        return nid, version

    def extend(self, item_id: str, node: int, tokens: list[int], sources: str, annotator: str,
               expect_version: int) -> int:
        """Appends (the model's continuation) to a node. Returns the new version."""
        _check_sources(tokens, sources)
        with self._write(item_id, expect_version, annotator, "extend", node, {"n": len(tokens)}) as (c, version):
            row = c.execute("SELECT tokens, sources FROM ann_nodes WHERE item_id = ? AND id = ?",
                            (item_id, node)).fetchone()
            if row is None:
                raise NotFound(f"tree {item_id!r} has no node {node}")
            c.execute("UPDATE ann_nodes SET tokens = ?, sources = ? WHERE item_id = ? AND id = ?",
                      (json.dumps(json.loads(row[0]) + tokens), row[1] + sources, item_id, node))
        return version

    def label(self, item_id: str, node: int, label: str | None, annotator: str, expect_version: int) -> int:
        if label not in ("good", "bad", None):
            raise InvalidArgument(f"label {label!r}: 'good', 'bad' or none")
        with self._write(item_id, expect_version, annotator, "label", node, {"label": label}) as (c, version):
            row = c.execute("SELECT label FROM ann_nodes WHERE item_id = ? AND id = ?", (item_id, node)).fetchone()
            if row is None:
                raise NotFound(f"tree {item_id!r} has no node {node}")
            c.execute("UPDATE ann_ops SET data = ? WHERE item_id = ? AND version = ?",
                      (json.dumps({"label": label, "before": row[0]}), item_id, version))
            c.execute("UPDATE ann_nodes SET label = ? WHERE item_id = ? AND id = ?", (label, item_id, node))
        return version

    def undo(self, item_id: str, annotator: str, expect_version: int) -> int:
        """Reverts this annotator's latest operation still in effect (a correction is hidden, with its
        continuation; a label goes back to what it was). Returns the new version."""
        with self._write(item_id, expect_version, annotator, "undo", None, {}) as (c, version):
            rows = c.execute("SELECT version, op, node, data FROM ann_ops WHERE item_id = ? AND annotator = ? "
                             "AND undone = 0 AND op IN ('correct', 'tool', 'label', 'extend') ORDER BY version DESC",
                             (item_id, annotator)).fetchall()
            if not rows:
                raise InvalidArgument("nothing of yours to undo in this tree")
            v, op, node, data = rows[0][0], rows[0][1], rows[0][2], json.loads(rows[0][3])
            if op == "extend":  # a correction (or tool step) and its continuation are one step for the annotator
                for r in rows[1:]:
                    if r[1] in ("correct", "tool") and r[2] == node:
                        c.execute("UPDATE ann_ops SET undone = 1 WHERE item_id = ? AND version = ?", (item_id, r[0]))
                        op = r[1]
                        break
            if op in ("correct", "tool"):
                c.execute("UPDATE ann_nodes SET hidden = 1 WHERE item_id = ? AND id = ?", (item_id, node))
            elif op == "extend":  # a continuation of the root: its tokens come off again
                row = c.execute("SELECT tokens, sources FROM ann_nodes WHERE item_id = ? AND id = ?",
                                (item_id, node)).fetchone()
                keep = len(json.loads(row[0])) - int(data["n"])
                c.execute("UPDATE ann_nodes SET tokens = ?, sources = ? WHERE item_id = ? AND id = ?",
                          (json.dumps(json.loads(row[0])[:keep]), row[1][:keep], item_id, node))
            else:
                c.execute("UPDATE ann_nodes SET label = ? WHERE item_id = ? AND id = ?",
                          (data.get("before"), item_id, node))
            c.execute("UPDATE ann_ops SET undone = 1 WHERE item_id = ? AND version = ?", (item_id, v))
            c.execute("UPDATE ann_ops SET node = ?, data = ? WHERE item_id = ? AND version = ?",
                      (node, json.dumps({"undid": v}), item_id, version))
        return version


def _check_sources(tokens: list[int], sources: str) -> None:
    if len(tokens) != len(sources) or any(s not in SOURCES for s in sources):
        raise InvalidArgument(f"sources must give one of {SOURCES!r} per token ({len(tokens)} tokens, "
                              f"{len(sources)} sources)")
