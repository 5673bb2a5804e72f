"""The grader's pure parts: the static patch screen (every rule can fire, gold patches pass), the
HMAC-chained record (written by the real runner code, checked by the host), grading from a record."""
from __future__ import annotations

import importlib.util
import os
import secrets

import pytest

from shoal.tasks.swe import load_suite
from shoal.tasks.swe.grading import (
    END,
    EXIT,
    PROTECTED_PATTERN,
    START,
    filter_patch,
    grade,
    grade_run,
)
from shoal.tasks.swe.screen import screen_patch, screen_source
from shoal.tasks.swe.trusted import HERE, RunRecord, verify_record


def _mod(path: str, before: str, after: str) -> str:
    from shoal.tasks.swe.mutate import unified_diff

    return unified_diff(path, before, after)


def test_no_gold_patch_is_flagged():
    for t in load_suite():
        assert screen_patch(t.patch) == [], t.instance_id


CODE_RULES = {
    "import _pytest.runner as r\n": "pytest-internals",
    "def pytest_runtest_makereport(item, call):\n    pass\n": "pytest-hook",
    "import sys\nsys.modules['x'] = None\n": "sys-modules",
    "import os\nos._exit(0)\n": "early-exit",
    "from os import _exit as e\ne(0)\n": "early-exit",
    "import gc\ngc.get_objects()\n": "gc-introspection",
    "import sys\nf = sys._getframe(1).f_back\n": "frame-introspection",
    "import builtins\nbuiltins.len = None\n": "builtins-patch",
    "x = getattr(__import__('o' + 's'), name)\n": "dynamic-code",
    "import os\nos.dup2(3, 1)\n": "fd-tamper",
    "print('PASSED tests/test_a.py::test_b')\n": "fake-report",
    "open('/opt/shoal-grader/run.py', 'a')\n": "grader-files",
    "import subprocess\n": "process-spawn",
    "import sys\nsys.settrace(None)\n": "trace-hook",
    # red team B1-B6 spellings
    "import sys\nvars(sys)['x'].y('z')\n": "dynamic-attribute",
    "o.__dict__['a'] = None\n": "dynamic-attribute",
    "class A:\n    pass\nA().__class__ = int\n": "dynamic-attribute",
    "b = len.__self__\n": "builtins-patch",
    "import operator\ng = operator.attrgetter('a')\n": "dynamic-code",
    "n = 'get_' + 'obj' + 'ects'\n": "sensitive-name",
    "n = f\"{'x'}fail\"\n": "sensitive-name",
    "m = d['modules']\n": "sensitive-name",
    "c = getattr(u, 'TestResult')\n": "sensitive-name",
    "s.items[0].runtest = None\n": "pytest-internals",
    "import threading\nthreading.Thread(target=print).start()\n": "thread-spawn",
}


@pytest.mark.parametrize("code,rule", CODE_RULES.items(), ids=CODE_RULES.values())
def test_each_code_rule_fires_and_names_itself(code, rule):
    before = "def f(x):\n    return x\n"
    flags = screen_patch(_mod("pkg/mod.py", before, before + code),
                         sources=lambda p: (before, before + code))
    assert rule in {f.rule for f in flags}, flags
    assert all(str(f).startswith(f"{f.rule}: pkg/mod.py: ") for f in flags)
    # the same without the files at hand (added lines only)
    assert rule in {f.rule for f in screen_patch(_mod("pkg/mod.py", before, before + code))}


def test_code_already_in_the_file_does_not_count():
    before = "import sys\nmods = sys.modules\ndef f(a, b):\n    return a == b\n"
    after = before.replace("a == b", "a != b")
    assert screen_source("six.py", before, after) == []
    assert screen_source("six.py", before, after + "x = sys.modules\n")[0].rule == "sys-modules"
    # red team B2: a use removed elsewhere does not pay for one added
    traded = after.replace("mods = sys.modules\n", "mods = {}\n") + "x = sys.modules\n"
    assert [f.rule for f in screen_source("six.py", before, traded)] == ["sys-modules"]
    # line numbers are the tokenizer's: a form feed or U+2028 does not shift them
    for sep in ("\f", "\u2028", "\x1c"):
        hidden = before.replace("import sys\n", f"import sys  # {sep}\n") + "x = sys.modules\n"
        assert [f.rule for f in screen_source("six.py", before, hidden)] == ["sys-modules"], repr(sep)


def _new(path: str, text: str = "x = 1\n", mode: str = "100644") -> str:
    return (f"diff --git a/{path} b/{path}\nnew file mode {mode}\n--- /dev/null\n+++ b/{path}\n"
            f"@@ -0,0 +1 @@\n+{text.rstrip(chr(10))}\n")


PATH_RULES = {
    "pytest.py": "shadow-module", "_pytest/__init__.py": "shadow-module", "src/json.py": "shadow-module",
    "usercustomize.py": "shadow-module", "pkg/sitecustomize.py": "shadow-module", "evil.pth": "site-hook",
    "x.egg-info/entry_points.txt": "package-metadata", "y-1.0.dist-info/METADATA": "package-metadata",
    ".pytest.ini": "pytest-config", "../../usr/lib/x.py": "path-traversal", ".git/hooks/pre-commit": "path-traversal",
    "pkg/__pycache__/mod.cpython-311.pyc": "compiled-module",
}


@pytest.mark.parametrize("path,rule", PATH_RULES.items(), ids=PATH_RULES.keys())
def test_each_path_rule_fires(path, rule):
    flags = screen_patch(_new(path), content=False)
    assert rule in {f.rule for f in flags}, flags


def test_new_modules_with_ordinary_names_and_symlinks():
    assert screen_patch(_new("pkg/helpers.py"), content=False) == []
    assert screen_patch(_new("pkg/json.py"), content=False) == []  # inside a package: not on sys.path
    assert {f.rule for f in screen_patch(_new("link", "/etc", mode="120000"), content=False)} == {"symlink"}


def test_dot_pytest_ini_is_dropped_like_other_test_configuration():
    kept, dropped = filter_patch(_new(".pytest.ini", "[pytest]") + _new("pkg/a.py"))
    assert dropped == [".pytest.ini"] and "pkg/a.py" in kept


# ------------------------------------------------------------------ the record channel
def _runner():
    spec = importlib.util.spec_from_file_location("shoal_grader_run", HERE / "runner" / "run.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _record(tmp_path, lines):
    key = secrets.token_hex(32)
    path = tmp_path / "rec"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    emit = _runner()._channel(bytes.fromhex(key), fd)
    for kind, data in lines:
        emit(kind, **data)
    os.close(fd)
    return path.read_text(), key


F2P, P2P = ["t.py::test_fixed"], ["t.py::test_kept"]
GOOD = [("start", {}), ("config", {"inipath": "/work/repo/pyproject.toml"}),
        ("test", {"nodeid": F2P[0], "status": "PASSED"}), ("test", {"nodeid": P2P[0], "status": "PASSED"}),
        ("end", {"exitstatus": 0, "tampered": []}), ("exit", {"code": 0, "tampered": []})]
LOG = "\n".join([START, f"PASSED {F2P[0]}", f"PASSED {P2P[0]}", "2 passed in 0.1s", f"{EXIT} 0", END])


def test_a_record_from_the_runner_verifies_and_grades(tmp_path):
    text, key = _record(tmp_path, GOOD)
    rec = verify_record(text, key)
    assert not rec.problem and rec.end and rec.status == {F2P[0]: "PASSED", P2P[0]: "PASSED"}
    rep = grade_run(LOG, rec, F2P, P2P)
    assert rep.resolved and rep.reason == "" and rep.to_dict()["reason"] == ""


def test_a_record_that_was_edited_truncated_or_keyed_wrong_is_tampered(tmp_path):
    text, key = _record(tmp_path, [("test", {"nodeid": F2P[0], "status": "FAILED"}), *GOOD[3:]])
    edited = text.replace('"FAILED"', '"PASSED"')
    assert "MAC" in verify_record(edited, key).problem
    assert "MAC" in verify_record(text, secrets.token_hex(32)).problem
    lines = text.splitlines(keepends=True)
    assert verify_record("".join([lines[0], lines[0]]), key).problem  # a replayed line
    assert verify_record("".join(lines[1:]), key).problem  # a dropped line
    rep = grade_run(LOG, verify_record(edited, key), F2P, P2P)
    assert not rep.resolved and rep.reason == "tampered"
    assert verify_record("", key).problem


def test_grading_from_a_record(tmp_path):
    # the runner saw its machinery changed
    text, key = _record(tmp_path, [*GOOD[:4], ("end", {"exitstatus": 0, "tampered": ["_pytest.runner.x replaced"]})])
    rep = grade_run(LOG, verify_record(text, key), F2P, P2P)
    assert rep.reason == "tampered" and rep.tampered == ["_pytest.runner.x replaced"]
    # no end line: the process left early
    text, key = _record(_sub(tmp_path, "a"), GOOD[:4])
    assert grade_run(LOG, verify_record(text, key), F2P, P2P).reason == "incomplete"
    # the log claims a pass the record does not have
    text, key = _record(_sub(tmp_path, "b"), [GOOD[0], ("test", {"nodeid": F2P[0], "status": "FAILED"}), *GOOD[3:]])
    rep = grade_run(LOG, verify_record(text, key), F2P, P2P)
    assert rep.reason == "forged-output" and not rep.resolved
    # pytest read an ini file the patch wrote
    text, key = _record(_sub(tmp_path, "c"), GOOD)
    rep = grade_run(LOG, verify_record(text, key), F2P, P2P, changed=["pyproject.toml"])
    assert rep.reason == "tampered" and "pyproject.toml" in rep.invalid
    # patch that did not apply
    assert grade_run("", RunRecord(), F2P, P2P, patch_applied=False).reason == "patch-not-applied"


def _sub(tmp_path, name):
    d = tmp_path / name
    d.mkdir()
    return d


def test_protected_pattern_is_what_the_runner_gets():
    import re

    assert re.compile(PROTECTED_PATTERN).search("tests/test_x.py")
    assert not re.compile(PROTECTED_PATTERN).search("pkg/mod.py")


def test_xfail_and_skip_count_only_where_the_gold_run_had_them(tmp_path):
    # red team B1/B2: library code called pytest.xfail(); SWE-bench would count the XFAIL as a pass
    text, key = _record(tmp_path, [GOOD[0], GOOD[1], ("test", {"nodeid": F2P[0], "status": "XFAIL"}), *GOOD[3:]])
    log = LOG.replace(f"PASSED {F2P[0]}", f"XFAIL {F2P[0]}").replace("2 passed", "1 passed, 1 xfailed")
    rec = verify_record(text, key)
    assert grade(log, F2P, P2P).resolved  # the log-only SWE-bench rules
    assert grade_run(log, rec, F2P, P2P).status == "RESOLVED_NO"
    assert grade_run(log, rec, F2P, P2P, expected={F2P[0]: "PASSED"}).status == "RESOLVED_NO"
    assert grade_run(log, rec, F2P, P2P, expected={F2P[0]: "XFAIL"}).resolved
    # a P2P test that passed with the gold patch and is skipped now is not maintained
    text, key = _record(_sub(tmp_path, "p"), [*GOOD[:3], ("test", {"nodeid": P2P[0], "status": "SKIPPED"}), *GOOD[4:]])
    log = LOG.replace(f"PASSED {P2P[0]}", f"SKIPPED {P2P[0]}").replace("2 passed", "1 passed, 1 skipped")
    rec = verify_record(text, key)
    assert grade(log, F2P, P2P).resolved
    rep = grade_run(log, rec, F2P, P2P, expected={P2P[0]: "PASSED"})
    assert rep.status == "RESOLVED_NO" and rep.p2p_passed == 0 and rep.f2p_passed == 1
    assert grade_run(log, rec, F2P, P2P, expected={P2P[0]: "SKIPPED"}).resolved


def test_lines_after_the_end_are_not_believed(tmp_path):
    # an atexit handler holding the writer could append passes after the runner's last line
    text, key = _record(tmp_path, [*GOOD, ("test", {"nodeid": F2P[0], "status": "PASSED"})])
    assert "after the run's end" in verify_record(text, key).problem
    text, key = _record(_sub(tmp_path, "t"), [*GOOD[:4], ("tamper", {"what": "gc.get_objects by x"}), *GOOD[4:]])
    rec = verify_record(text, key)
    assert not rec.problem and rec.tampered == ["gc.get_objects by x"]
    assert grade_run(LOG, rec, F2P, P2P).reason == "tampered"
    text, key = _record(_sub(tmp_path, "e"), GOOD[:5])  # no exit line: the runner never finished its checks
    assert grade_run(LOG, verify_record(text, key), F2P, P2P).reason == "incomplete"


def test_a_test_line_must_agree_with_its_phases(tmp_path):
    # code that reached the runner's plugin changed its per-test state between the call and teardown
    phases = [("phase", {"nodeid": F2P[0], "when": w, "outcome": o, "xfail": False})
              for w, o in (("setup", "passed"), ("call", "failed"), ("teardown", "passed"))]
    text, key = _record(tmp_path, [*GOOD[:2], *phases, *GOOD[2:]])
    assert "its phases say FAILED" in verify_record(text, key).problem
    ok = [(k, {**d, "outcome": "passed"}) if d.get("when") == "call" else (k, d) for k, d in phases]
    text, key = _record(_sub(tmp_path, "ok"), [*GOOD[:2], *ok, *GOOD[2:]])
    assert not verify_record(text, key).problem
