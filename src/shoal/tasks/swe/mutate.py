"""Procedural bug injection, SWE-smith style: small AST-located edits inside functions.

Each `Mutation` replaces one single-line span of the source text (so the diff is one line and the
file keeps its formatting). Operators and the bug_type label they produce:

    ==/!=, </<=, >/>=, in/not in, is/is not  swapped   comparison-operator
    and/or swapped                                     boolean-operator
    +/- swapped                                        arithmetic-operator
    integer constant n -> n+1 (or 1 -> 0)              off-by-one-constant
    `not x` -> `x`                                     negation-removed
    `if c:` -> `if not (c):`                           negated-condition

Only code inside functions is mutated: a bug at module level breaks the import and fails every
test, which makes a task that says nothing about where the bug is.
"""
from __future__ import annotations

import ast
import difflib
import re
from collections.abc import Iterator
from dataclasses import dataclass

_CMP = {ast.Eq: ("==", "!="), ast.NotEq: ("!=", "=="), ast.Lt: ("<", "<="), ast.LtE: ("<=", "<"),
        ast.Gt: (">", ">="), ast.GtE: (">=", ">"), ast.In: ("in", "not in"), ast.NotIn: ("not in", "in"),
        ast.Is: ("is", "is not"), ast.IsNot: ("is not", "is")}
_BIN = {ast.Add: ("+", "-"), ast.Sub: ("-", "+")}
_BOOL = {ast.And: ("and", "or"), ast.Or: ("or", "and")}


@dataclass(frozen=True)
class Mutation:
    path: str  # relative to the repo root
    line: int  # 1-based
    col: int  # span [col, end_col) within the line, in characters
    end_col: int
    old: str
    new: str
    bug_type: str
    symbol: str

    def apply(self, source: str) -> str:
        lines = source.splitlines(keepends=True)
        text = lines[self.line - 1]
        if text[self.col:self.end_col] != self.old:
            raise ValueError(f"{self.path}:{self.line}: expected {self.old!r} at col {self.col}")
        lines[self.line - 1] = text[: self.col] + self.new + text[self.end_col:]
        return "".join(lines)

    @property
    def key(self) -> str:
        return f"{self.path}:{self.line}:{self.col}:{self.bug_type}"


def _parents(tree: ast.AST) -> dict[int, ast.AST]:
    parent = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parent[id(child)] = node
    return parent


def _symbol(node: ast.AST, parent: dict[int, ast.AST]) -> str | None:
    names, cur, in_func = [], node, False
    while id(cur) in parent:
        cur = parent[id(cur)]
        if isinstance(cur, (ast.FunctionDef, ast.AsyncFunctionDef)):
            in_func = True
            names.append(cur.name)
        elif isinstance(cur, ast.ClassDef):
            names.append(cur.name)
    return ".".join(reversed(names)) if in_func else None


def _gap_edit(line: str, start: int | None, end: int | None, old: str, new: str, bug_type: str, path: str,
              lineno: int, symbol: str) -> Mutation | None:
    """Swap the operator `old` that sits in line[start:end] (between two operands) for `new`."""
    if start is None or end is None:  # ast gives every parsed expression its offsets; never guess
        return None
    gap = line[start:end]
    m = re.search(r"(?<![\w=!<>])" + re.escape(old).replace(r"\ ", r"\s+") + r"(?![\w=<>])", gap)
    if not m or gap.count(old.split()[0]) != 1:
        return None
    return Mutation(path, lineno, start + m.start(), start + m.end(), m.group(0), new, bug_type, symbol)


def mutations(path: str, source: str) -> Iterator[Mutation]:
    """Every mutation site in one file, in source order."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return
    lines = source.splitlines(keepends=True)
    parent = _parents(tree)
    for node in ast.walk(tree):
        lineno = getattr(node, "lineno", None)
        span = node.test if isinstance(node, (ast.If, ast.While)) else node  # a statement: its condition's line
        if lineno is None or getattr(span, "lineno", None) != lineno or getattr(span, "end_lineno", None) != lineno:
            continue
        symbol = _symbol(node, parent)
        if symbol is None:
            continue
        line = lines[lineno - 1]
        found: Mutation | None = None
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _CMP:
            old, new = _CMP[type(node.ops[0])]
            a, b = node.left, node.comparators[0]
            found = _gap_edit(line, a.end_col_offset, b.col_offset, old, new, "comparison-operator", path, lineno,
                              symbol)
        elif isinstance(node, ast.BoolOp) and len(node.values) == 2:
            old, new = _BOOL[type(node.op)]
            a, b = node.values
            found = _gap_edit(line, a.end_col_offset, b.col_offset, old, new, "boolean-operator", path, lineno,
                              symbol)
        elif isinstance(node, ast.BinOp) and type(node.op) in _BIN:
            old, new = _BIN[type(node.op)]
            found = _gap_edit(line, node.left.end_col_offset, node.right.col_offset, old, new,
                              "arithmetic-operator", path, lineno, symbol)
        elif isinstance(node, ast.Constant) and type(node.value) is int and 0 <= node.value <= 64 \
                and node.end_col_offset is not None:
            text = line[node.col_offset:node.end_col_offset]
            if text == str(node.value) and not isinstance(parent.get(id(node)), (ast.Subscript, ast.Slice)):
                new = "0" if node.value == 1 else str(node.value + 1)
                found = Mutation(path, lineno, node.col_offset, node.end_col_offset, text, new,
                                 "off-by-one-constant", symbol)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            text = line[node.col_offset:node.operand.col_offset]
            if re.fullmatch(r"not\s+", text):
                found = Mutation(path, lineno, node.col_offset, node.operand.col_offset, text, "", "negation-removed",
                                 symbol)
        elif isinstance(node, (ast.If, ast.While)) and node.test.end_col_offset is not None:
            t, end = node.test, node.test.end_col_offset
            text = line[t.col_offset:end]
            if not isinstance(t, ast.UnaryOp):
                found = Mutation(path, lineno, t.col_offset, end, text, f"not ({text})", "negated-condition", symbol)
        if found is not None:
            yield found


def unified_diff(path: str, before: str, after: str) -> str:
    """A git-style diff of one file (`git apply` and `patch -p1` both take it)."""
    body = "".join(difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                        f"a/{path}", f"b/{path}", n=3))
    return f"diff --git a/{path} b/{path}\n{body}" if body else ""
