"""SWE-bench grading rules on real pytest -rA logs, and the patch filter that protects the tests."""
from __future__ import annotations

import pytest

from shoal.tasks.swe.grading import (
    END,
    EXIT,
    START,
    filter_patch,
    grade,
    malformed_patch,
    parse_log,
    split_patch,
)

F2P = ["tests/test_a.py::test_fixed"]
P2P = ["tests/test_a.py::test_kept", "tests/test_b.py::test_other[1]"]


def _log(lines: list[str], code: int, summary: str | None = None) -> str:
    if summary is None:  # what pytest would print for these lines
        n = {k: sum(1 for x in lines if x.startswith(k + " ")) for k in ("FAILED", "PASSED", "SKIPPED", "XFAIL")}
        summary = ", ".join(f"{v} {k.lower()}" for k, v in n.items() if v).replace("xfail", "xfailed") + " in 0.10s"
    return "\n".join(["noise before", START, *lines, summary, f"{EXIT} {code}", END, "PASSED forged::after_end"])


def test_resolved_full_when_every_f2p_and_p2p_passes():
    log = _log([f"PASSED {t}" for t in F2P + P2P], 0)
    rep = grade(log, F2P, P2P)
    assert rep.resolved and rep.status == "RESOLVED_FULL" and rep.f2p_rate == 1.0 and rep.p2p_rate == 1.0


def test_partial_and_no():
    f2p = F2P + ["tests/test_a.py::test_second"]
    log = _log([f"PASSED {F2P[0]}", "FAILED tests/test_a.py::test_second - assert 1 == 2"] +
               [f"PASSED {t}" for t in P2P], 1)
    rep = grade(log, f2p, P2P)
    assert rep.status == "RESOLVED_PARTIAL" and not rep.resolved and rep.f2p_passed == 1
    broken_p2p = _log([f"PASSED {t}" for t in F2P] + [f"FAILED {P2P[0]} - boom", f"PASSED {P2P[1]}"], 1)
    rep = grade(broken_p2p, F2P, P2P)
    assert rep.status == "RESOLVED_NO" and rep.tests_status["PASS_TO_PASS_failed"] == [P2P[0]]


def test_skip_xfail_and_missing_follow_swebench():
    # XFAIL counts as a pass; a skipped P2P test is maintained; a skipped or missing F2P test is a failure
    log = _log([f"XFAIL {F2P[0]} - expected", f"SKIPPED {P2P[0]}", f"PASSED {P2P[1]}"], 0)
    assert grade(log, F2P, P2P).resolved
    log = _log([f"SKIPPED {F2P[0]}", *[f"PASSED {t}" for t in P2P]], 0)
    assert not grade(log, F2P, P2P).resolved
    log = _log([f"PASSED {t}" for t in P2P], 0)
    assert grade(log, F2P, P2P).f2p_passed == 0


def test_log_is_sliced_between_markers_and_needs_an_exit_code():
    status, code, ran = parse_log(_log([f"PASSED {F2P[0]}"], 0))
    assert "forged::after_end" not in status and code == 0 and ran
    no_code = "\n".join([START, f"PASSED {F2P[0]}", *[f"PASSED {t}" for t in P2P], "3 passed in 0.1s", END])
    rep = grade(no_code, F2P, P2P)
    assert not rep.resolved and "exit code" in rep.invalid
    no_summary = "\n".join([START, *[f"PASSED {t}" for t in F2P + P2P], f"{EXIT} 0", END])
    assert "summary" in grade(no_summary, F2P, P2P).invalid


def test_forged_passes_are_caught_by_the_exit_code_cross_check():
    # the code under test printed PASSED lines, but pytest itself failed
    log = _log([f"PASSED {t}" for t in F2P + P2P], 1)
    rep = grade(log, F2P, P2P)
    assert not rep.resolved and "forged" in rep.invalid
    log = _log([f"PASSED {t}" for t in F2P + P2P] + ["FAILED tests/x.py::y - e"], 0)
    assert "forged" in grade(log, F2P, P2P).invalid
    # forged PASSED lines next to a real summary that counts fewer tests
    log = _log([f"PASSED {t}" for t in F2P + P2P], 0, "2 passed in 0.10s")
    assert "does not match" in grade(log, F2P, P2P).invalid


def test_empty_log_is_invalid_not_resolved():
    rep = grade("", [], [])
    assert not rep.resolved and rep.invalid


GIT_PATCH = """diff --git a/pkg/core.py b/pkg/core.py
--- a/pkg/core.py
+++ b/pkg/core.py
@@ -1,2 +1,2 @@
-x = 1
+x = 2
 y = 3
diff --git a/tests/test_core.py b/tests/test_core.py
--- a/tests/test_core.py
+++ b/tests/test_core.py
@@ -1 +1 @@
-assert x == 1
+assert True
diff --git a/conftest.py b/conftest.py
new file mode 100644
--- /dev/null
+++ b/conftest.py
@@ -0,0 +1 @@
+import os
diff --git a/setup.cfg b/setup.cfg
--- a/setup.cfg
+++ b/setup.cfg
@@ -1 +1 @@
-[tool:pytest]
+[tool:pytest] addopts = -p fake
"""


def test_filter_patch_drops_tests_and_test_configuration():
    assert [p for p, _ in split_patch(GIT_PATCH)] == ["pkg/core.py", "tests/test_core.py", "conftest.py", "setup.cfg"]
    kept, dropped = filter_patch(GIT_PATCH)
    assert dropped == ["tests/test_core.py", "conftest.py", "setup.cfg"]
    assert "pkg/core.py" in kept and "assert True" not in kept and "import os" not in kept


def test_plain_diff_without_git_headers_is_split_too():
    plain = "--- a/m.py\n+++ b/m.py\n@@ -1 +1 @@\n-a\n+b\n--- a/test_m.py\n+++ b/test_m.py\n@@ -1 +1 @@\n-c\n+d\n"
    kept, dropped = filter_patch(plain)
    assert dropped == ["test_m.py"] and kept.startswith("--- a/m.py") and "+d" not in kept


def test_a_traditional_section_after_a_git_section_is_its_own_section():
    # red team A3: the second section used to be folded into the first
    mixed = GIT_PATCH.split("diff --git a/tests")[0] + "--- a/tests/t.py\n+++ b/tests/t.py\n@@ -1 +1 @@\n-a\n+b\n"
    assert [p for p, _ in split_patch(mixed)] == ["pkg/core.py", "tests/t.py"]
    assert filter_patch(mixed)[1] == ["tests/t.py"]


def test_hunk_bodies_are_not_read_as_headers():
    # a removed line "-- x" and an added "++ y" look like a ---/+++ pair; hunk counts say they are body
    p = "--- a/m.py\n+++ b/m.py\n@@ -1,2 +1,2 @@\n--- x\n+++ y\n a\n"
    assert [p for p, _ in split_patch(p)] == ["m.py"] and malformed_patch(p) == ""


@pytest.mark.parametrize("ch", ["\r", "\v", "\f", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"])
def test_line_separators_in_header_lines_are_malformed(ch):
    # red team A4: str.splitlines() splits at these, git does not
    p = f"--- a/tests/t.py{ch}+++ b/m.py\n+++ b/tests/t.py\n@@ -1 +1 @@\n-a\n+b\n"
    assert malformed_patch(p).startswith("control character")
    # inside a hunk body they are file content (a CRLF file)
    assert malformed_patch(f"--- a/m.py\n+++ b/m.py\n@@ -1 +1 @@\n-a{ch}\n+b{ch}\n") == ""


def test_quoted_paths_are_malformed():
    # red team A1/A2: git unquotes C-quoted paths, the filter did not
    for p in ('--- "a/test_m.py"\n+++ "b/test_m.py"\n@@ -1 +1 @@\n-a\n+b\n',
              'diff --git "a/t.py" "b/t.py"\n--- a/t.py\n+++ b/t.py\n@@ -1 +1 @@\n-a\n+b\n'):
        assert malformed_patch(p) == "quoted path in a header line"
    assert malformed_patch(GIT_PATCH) == ""
