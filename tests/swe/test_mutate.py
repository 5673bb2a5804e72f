"""Bug injection operators: one-line edits inside functions, every bug type, clean diffs."""
from __future__ import annotations

import ast
import subprocess
import textwrap

from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.tasks.swe.mutate import mutations, unified_diff
from shoal.tasks.swe.task import BUG_TYPES

SRC = textwrap.dedent("""\
    LIMIT = 3  # module level: never mutated


    def clamp(x, lo=0, hi=10):
        if x < lo or x is None:
            return lo
        total = x + 1
        return hi if x >= hi else total - 1


    class Box:
        def has(self, item):
            return item in self.items and not self.closed
    """)


def test_every_operator_fires_and_only_inside_functions():
    ms = list(mutations("pkg/m.py", SRC))
    kinds = {m.bug_type for m in ms}
    assert kinds == set(BUG_TYPES)
    assert all(m.line > 1 for m in ms)  # LIMIT = 3 is module level
    assert {m.symbol for m in ms} == {"clamp", "Box.has"}
    by = {(m.old, m.new) for m in ms}
    assert {("<", "<="), ("or", "and"), ("is", "is not"), ("+", "-"), (">=", ">"), ("in", "not in"),
            ("and", "or"), ("not ", "")} <= by


def test_each_mutation_changes_one_line_and_still_parses():
    for m in mutations("pkg/m.py", SRC):
        out = m.apply(SRC)
        ast.parse(out)
        diff = [(a, b) for a, b in zip(SRC.splitlines(), out.splitlines()) if a != b]
        assert len(diff) == 1 and len(SRC.splitlines()) == len(out.splitlines()), m


def test_bug_and_gold_diffs_apply_with_git(tmp_path):
    m = next(m for m in mutations("pkg/m.py", SRC) if m.bug_type == "comparison-operator")
    buggy = m.apply(SRC)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg/m.py").write_text(SRC)
    (tmp_path / "bug.patch").write_text(unified_diff("pkg/m.py", SRC, buggy))
    (tmp_path / "gold.patch").write_text(unified_diff("pkg/m.py", buggy, SRC))
    run = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, capture_output=True, text=True)  # noqa: E731
    run("init", "-q")
    assert run("apply", "bug.patch").returncode == 0 and (tmp_path / "pkg/m.py").read_text() == buggy
    assert run("apply", "gold.patch").returncode == 0 and (tmp_path / "pkg/m.py").read_text() == SRC


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["<", "<=", ">", ">=", "==", "!="]), st.integers(0, 50), st.sampled_from(["+", "-"]))
def test_generated_functions_mutate_cleanly(op, n, arith):
    src = f"def f(a, b):\n    if a {op} b {arith} {n}:\n        return a\n    return b\n"
    for m in mutations("x.py", src):
        out = m.apply(src)
        ast.parse(out)
        assert out != src and out.count("\n") == src.count("\n")
