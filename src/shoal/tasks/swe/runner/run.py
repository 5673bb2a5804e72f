"""Shoal's trusted SWE test runner. It runs inside the grading sandbox, from the read-only grader
layer (/opt/shoal-grader), as `python3 -I -S /opt/shoal-grader/run.py` with a JSON config on stdin.

It is not imported on the host: it needs only the standard library and the pytest copy next to it.

- `-I` (isolated: -E -s -P): PYTHON* variables are ignored, there is no user site, and neither the
  script's directory nor the working directory (the repository) goes first on sys.path.
- `-S`: no `site` at start-up, so no `sitecustomize` / `usercustomize` and no `.pth` file runs
  before this file. pytest and its dependencies are imported from the grader layer first, with
  every `_pytest` submodule; only then are the system site directories added (test dependencies
  and the project's editable install, both baked into layers before the patch existed).
- Plugins registered through package metadata (`pytest11`) are not auto-loaded; only those of
  distributions installed outside the repository are passed to pytest with `-p`.
- The result channel: the config carries a per-run random key and the path of a record file.
  Both are read from stdin (then closed) before any code under test runs; the file is opened
  O_EXCL before pytest starts. Every line of the record is chained with HMAC-SHA256 under the key
  and checked on the host; the key never appears in argv, the environment or on disk.
- At session end the plugin compares pytest's runner, report, capture, terminal and hook-calling
  objects (module functions, class attributes, plugin objects, hook implementations) with those
  it saw at start, and checks where every hook implementation, import hook and test function
  comes from. Findings go into the record's `end` line as `tampered`.

- An audit hook installed before any code under test runs refuses, and writes into the record
  at once, what reaching the runner's objects took in the red team's hacks (`_audit_hook`); the
  record writer accepts only the runner's own code as its caller.

Code under test still runs in this process: what CPython does not audit (attribute reads, module
globals, closure cells) it can still reach; see docs/swe.md, "Threat model".
"""
from __future__ import annotations

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SITE = os.path.join(HERE, "site")  # pytest, _pytest, pluggy
DEPS = os.path.join(HERE, "deps")  # pytest's other dependencies: on sys.path only while pytest imports
# bound now, before any code under test can replace them
_dumps = json.dumps
_write = os.write
_stat = os.stat
_realpath = os.path.realpath
_time = time.time

WATCHED_MODULES = (
    "_pytest.runner", "_pytest.reports", "_pytest.python", "_pytest.capture", "_pytest.terminal", "_pytest.main",
    "_pytest.outcomes", "_pytest.skipping", "_pytest.unittest", "_pytest.fixtures", "_pytest.nodes",
    "_pytest.config", "_pytest.logging", "_pytest.assertion.rewrite", "pluggy._hooks", "pluggy._callers",
    "pluggy._manager", "pluggy._result", "builtins", "os", "sys", "json", "hmac", "unittest", "unittest.case",
    "unittest.result", "unittest.runner", "unittest.suite")
WATCHED_PLUGINS = ("capturemanager", "terminalreporter", "runner", "python", "main", "skipping", "unittest",
                   "session", "funcmanage", "logging-plugin", "assertion")
# hooks whose implementations decide or report a test's outcome
OUTCOME_HOOKS = ("pytest_runtest_protocol", "pytest_runtest_setup", "pytest_runtest_call", "pytest_runtest_teardown",
                 "pytest_runtest_makereport", "pytest_runtest_logreport", "pytest_report_teststatus",
                 "pytest_pyfunc_call", "pytest_runtestloop", "pytest_sessionfinish", "pytest_terminal_summary",
                 "pytest_collection_modifyitems", "pytest_collectreport", "pytest_make_collect_report",
                 "pytest_exception_interact", "pytest_unconfigure")


def _encoder():
    """A JSON encoder for the record that depends on nothing code under test can replace: module
    globals (this file's, json's) are writable without an audit event, so everything it uses is
    bound here, before that code runs."""
    from _json import encode_basestring_ascii as quote  # C functions

    def enc(obj, isinstance=isinstance, sorted=sorted, str=str, int_repr=int.__repr__, float_repr=float.__repr__,
            dict=dict, list=list, tuple=tuple, bool=bool, int=int, float=float, join=",".join, quote=quote):
        if obj is None:
            return "null"
        if obj is True or obj is False:
            return "true" if obj is True else "false"
        if isinstance(obj, int) and not isinstance(obj, bool):
            return int_repr(obj)
        if isinstance(obj, float):
            return float_repr(obj)
        if isinstance(obj, dict):
            return "{" + join([quote(str.__str__(str(k))) + ": " + enc(obj[k]) for k in sorted(obj)]) + "}"
        if isinstance(obj, (list, tuple, set, frozenset)):
            return "[" + join([enc(v) for v in obj]) + "]"
        return quote(str.__str__(str(obj)))

    return enc


def _channel(key: bytes, fd: int, callers: dict[int, object] | None = None):
    """emit(kind, **data): one HMAC-chained JSON line to the record file. Only the runner's own code
    (`callers`, code objects by identity) may call it: code under test that reaches the writer
    (pytest's config, then the plugin manager, then this plugin: no audited step) gets a `tamper`
    line instead."""
    from _hashlib import hmac_digest  # a C function: not patchable in place

    chain = [b"shoal-record-v1"]
    enc, write, length, getframe = _encoder(), os.write, len, sys._getframe  # closure cells, not globals

    def emit(kind: str, **data) -> None:
        code = getframe(1).f_code
        if callers and callers.get(id(code)) is not code:
            kind, data = "tamper", {"what": f"the record writer called from {code.co_filename}:{code.co_name}"}
        line = enc({"seq": length(chain), "kind": kind, **data})
        mac = hmac_digest(key, chain[-1] + line.encode(), "sha256")
        chain.append(mac)
        write(fd, (line + "\t" + mac.hex() + "\n").encode())

    return emit


class Provenance:
    """Which files may supply hooks, import hooks and test functions: the grader layer, the
    standard library and site directories (unchanged since the run started), and the files in
    the repository that the patch filter protects (tests, conftest.py). A `<frozen ...>` file name
    is believed only for code objects of the frozen modules loaded at start (`code_ok`): any code
    object can be given that name (red team B5)."""

    def __init__(self, repo: str, protected: str, trusted_dirs: list[str], started: float):
        import re

        self.repo = _realpath(repo) + "/"
        self.protected = re.compile(protected)
        self.trusted = tuple(_realpath(d) + "/" for d in trusted_dirs if d)
        self.started = started
        self._rp, self._st, self._paths = _realpath, _stat, {}
        self.frozen: dict[int, object] = {}
        self.add_frozen()

    def add_frozen(self) -> None:
        """Remember the code objects of every frozen module loaded now (`<frozen os>`, importlib)."""
        import inspect

        def walk(code):
            if id(code) not in self.frozen:
                self.frozen[id(code)] = code  # kept alive: an id is not reused
                for c in code.co_consts:
                    if inspect.iscode(c):
                        walk(c)

        for mod in list(sys.modules.values()):
            if not _is_frozen(mod):
                continue
            for value in list(vars(mod).values()):
                for v in [value, *(vars(value).values() if inspect.isclass(value) else ())]:
                    v = getattr(v, "__func__", v)
                    if isinstance(v, property):
                        v = v.fget
                    code = getattr(v, "__code__", None)
                    if inspect.iscode(code) and code.co_filename.startswith("<frozen "):
                        walk(code)

    def code_ok(self, code) -> bool:
        name = code.co_filename
        if name.startswith("<frozen "):
            return id(code) in self.frozen and self.frozen[id(code)] is code
        return self.ok(name)

    def obj_ok(self, obj) -> bool:
        """Whether a function (or method, partial, property) comes from a trusted file."""
        code = _code_of(obj)
        if code is not None:
            return self.code_ok(code)
        mod = sys.modules.get(getattr(obj, "__module__", "") or "")
        return mod is not None and self.module_ok(mod)

    def class_ok(self, cls) -> bool:
        """A class from a trusted module whose own methods are trusted code (a class can claim any
        __module__)."""
        mod = sys.modules.get(getattr(cls, "__module__", "") or "")
        if mod is None or not self.module_ok(mod):
            return False
        if _is_frozen(mod) and vars(mod).get(getattr(cls, "__qualname__", "")) is not cls:
            return False
        codes = [_code_of(v) for v in list(vars(cls).values())]
        return all(self.code_ok(c) for c in codes if c is not None)

    def any_ok(self, obj) -> bool:
        import inspect

        if inspect.ismodule(obj):
            return self.module_ok(obj)
        if inspect.isclass(obj):
            return self.class_ok(obj)
        return self.obj_ok(obj)

    def module_ok(self, mod) -> bool:
        return _is_frozen(mod) or self.ok(getattr(mod, "__file__", None))

    def ok(self, filename: str | None) -> bool:
        if not filename or filename.startswith("<"):
            return False  # exec'd or generated code (frozen code: `code_ok`)
        path = self._paths.get(filename)
        if path is None:
            path = self._paths[filename] = self._rp(filename)
        try:
            if self._st(path).st_mtime > self.started:
                return False  # written while the run was going on
        except OSError:
            return False
        if path.startswith(self.repo):
            return bool(self.protected.search(path[len(self.repo):]))
        return path.startswith(self.trusted)


def _is_frozen(mod) -> bool:
    spec = getattr(mod, "__spec__", None)
    return spec is not None and (getattr(spec, "origin", None) == "frozen" or
                                 type(getattr(spec, "loader", None)).__name__ == "FrozenImporter")


def _unwrap(obj):
    """The plain function behind a partial, bound method, class/static method or property."""
    import functools
    import inspect

    fn = obj
    for _ in range(10):
        if isinstance(fn, functools.partial):
            fn = fn.func
        elif inspect.ismethod(fn) or isinstance(fn, (classmethod, staticmethod)):
            fn = fn.__func__
        elif isinstance(fn, property):
            fn = fn.fget
        else:
            break
    return fn


def _code_of(obj):
    import inspect

    code = getattr(_unwrap(obj), "__code__", None)
    return code if inspect.iscode(code) else None


def _code_file(obj) -> str | None:
    fn = _unwrap(obj)
    code = getattr(fn, "__code__", None)
    if code is not None:
        return code.co_filename
    mod = sys.modules.get(getattr(fn, "__module__", "") or "")
    return getattr(mod, "__file__", None) if mod else None


def _class_file(cls) -> str | None:
    mod = sys.modules.get(getattr(cls, "__module__", "") or "")
    return getattr(mod, "__file__", None) if mod else None


def _snapshot_module(mod) -> dict:
    """name -> object for the module's functions and classes, and class attributes that are code."""
    import inspect

    out = {}
    for name, value in list(vars(mod).items()):
        if callable(value) or inspect.ismodule(value):
            out[name] = value
        if inspect.isclass(value) and getattr(value, "__module__", None) == mod.__name__:
            for attr, v in list(vars(value).items()):
                if callable(v) or isinstance(v, (property, classmethod, staticmethod)):
                    out[f"{name}.{attr}"] = v
    return out


def _lookup(mod, dotted: str):
    obj = mod
    for part in dotted.split("."):
        d = vars(obj) if hasattr(obj, "__dict__") else {}
        if part not in d:
            return _MISSING
        obj = d[part]
    return obj


_MISSING = object()


class Integrity:
    """What the run depends on, captured before code under test runs, checked at the end."""

    def __init__(self, prov: Provenance):
        self.prov = prov
        self.modules = {name: sys.modules[name] for name in WATCHED_MODULES if name in sys.modules}
        self.snap = {name: _snapshot_module(m) for name, m in self.modules.items()}
        self.plugins: dict = {}
        # (live namespace, key, object) for a cheap identity sweep while tests run (`changed`)
        self.flat = []
        for name, mod in self.modules.items():
            for attr, obj in self.snap[name].items():
                owner, _, key = attr.rpartition(".")
                ns = vars(mod) if not owner else vars(_lookup(mod, owner))
                self.flat.append((ns, key, obj))
        self.impls: dict = {}

    def capture_plugins(self, config) -> None:
        pm = config.pluginmanager
        self.pm, self.hook, self.hookexec = pm, pm.hook, pm._inner_hookexec
        self.plugins = {n: pm.get_plugin(n) for n in WATCHED_PLUGINS if pm.get_plugin(n) is not None}
        self.callers = {h: getattr(config.hook, h) for h in OUTCOME_HOOKS}

    def changed(self) -> bool:
        """Whether anything `check` looks at may have changed since the start (cheap: identities
        only; `check` then says what)."""
        modules = sys.modules
        for name, mod in self.modules.items():
            if modules.get(name) is not mod:
                return True
        for ns, key, obj in self.flat:
            if ns.get(key, _MISSING) is not obj:
                return True
        if self.plugins:
            if self.hook is not self.pm.hook or self.pm._inner_hookexec is not self.hookexec:
                return True
            for h, caller in self.callers.items():
                now = [i.function for i in caller.get_hookimpls()]
                if self.impls.get(h) != now:
                    self.impls[h] = now  # impls change (conftests register): `check` vets them
                    return True
        return sys.gettrace() is not None or sys.getprofile() is not None

    def rebase(self) -> None:
        """After a `check` found nothing: what changed is trusted code (pytest's legacypath
        plugin patches a few attributes), so `changed` compares with the objects there now."""
        self.flat = [(ns, key, ns.get(key, _MISSING)) for ns, key, _ in self.flat]

    def check(self, items=(), codes=None) -> list[str]:
        found: list[str] = []
        for name, mod in self.modules.items():
            if sys.modules.get(name) is not mod:
                found.append(f"sys.modules[{name!r}] replaced")
            for attr, obj in self.snap[name].items():
                now = _lookup(mod, attr)
                # pytest's own plugins patch a few of these at configure time (legacypath): a change
                # counts when the new object is not from the grader layer or the standard library
                if now is not obj and (now is _MISSING or not self.prov.any_ok(now)):
                    found.append(f"{name}.{attr} replaced")
        if self.plugins:
            pm = self.pm
            for n, p in self.plugins.items():
                if pm.get_plugin(n) is not p:
                    found.append(f"plugin {n!r} replaced or unregistered")
            if self.hook is not pm.hook or pm._inner_hookexec is not self.hookexec:
                found.append("the plugin manager's hook relay or hook executor replaced")
            for h, caller in self.callers.items():
                if getattr(pm.hook, h) is not caller:
                    found.append(f"hook caller {h} replaced")
                    continue
                for impl in caller.get_hookimpls():
                    f = _code_file(impl.function)
                    if not self.prov.obj_ok(impl.function):
                        found.append(f"hook {h} implemented in {f} ({impl.plugin_name})")
        # import hooks of the library are fine (six installs one); what loaded the test modules is not
        seen_mods: set[int] = set()
        for item in items:
            mod = getattr(item, "module", None)
            if mod is None or id(mod) in seen_mods:
                continue
            seen_mods.add(id(mod))
            spec = getattr(mod, "__spec__", None)
            loader = getattr(spec, "loader", None) or getattr(mod, "__loader__", None)
            f = _class_file(type(loader)) if loader is not None else None
            if loader is None or not self.prov.class_ok(type(loader)):
                found.append(f"test module {mod.__name__} loaded by {type(loader).__name__} from {f}")
        for hookname, getter in (("trace", sys.gettrace), ("profile", sys.getprofile)):
            fn = getter()
            if fn is not None and not self.prov.obj_ok(fn):
                found.append(f"sys.set{hookname} hook from {_code_file(fn)}")
        for item in items:
            fn = getattr(item, "obj", None)
            code = getattr(getattr(fn, "__func__", fn), "__code__", None)
            if codes is not None and item.nodeid in codes and codes[item.nodeid] is not code:
                found.append(f"test function of {item.nodeid} replaced")
            if code is not None and not self.prov.code_ok(code):
                found.append(f"test function of {item.nodeid} comes from {code.co_filename}")
        return sorted(set(found))[:50]


# events code under test raises on the way to the runner's objects (red team B3-B6). ANY_CALLER:
# suspect whatever the immediate caller when untrusted code is anywhere on the stack, or the event
# comes from a thread other than the main one (a worker thread's stack shows only the stdlib).
# CALLER: suspect when the Python code that raised it is untrusted.
ANY_CALLER = frozenset({"gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._current_frames",
                        "sys._current_exceptions", "sys.setprofile", "sys.settrace"})
CALLER = frozenset({"sys._getframe", "code.__new__", "marshal.loads", "marshal.load", "function.__new__"})
FRAME_ATTRS = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame"})  # those 3.11 audits
# stdlib functions that hand their caller a frame: the caller that counts is theirs
FRAME_HELPERS = (("inspect", "currentframe"), ("inspect", "stack"), ("traceback", "walk_stack"),
                 ("logging", "currentframe"), ("traceback", "extract_stack"), ("traceback", "print_stack"))
MAX_FINDINGS = 20


def _audit_hook(prov: Provenance, record: str, fd: int, findings: list[str], emit):
    """The runner's own audit hook, installed before any code under test runs (hooks cannot be
    removed). It refuses further audit hooks, and refuses and records as tampering what the hacks
    that reached the runner's objects needed: the garbage collector, other threads' frames, frames
    and code objects made or read by untrusted code, ctypes, attribute writes on trusted functions
    and classes from untrusted code, opening the record, /proc/*/mem or the record's fd, truncating
    the record. A finding goes into the record at once (a `tamper` line: code that later forges the
    rest of the record cannot take it back) and the operation fails with RuntimeError."""
    import _thread
    import inspect

    getframe, get_ident, main_thread = sys._getframe, _thread.get_ident, _thread.get_ident()
    busy: set[int] = set()
    record_base, fd_suffix = os.path.basename(record), f"/fd/{fd}"
    helpers = {}  # id -> code, by identity (equal code objects need not be the same)
    for mod_name, fn in FRAME_HELPERS:
        code = _code_of(vars(sys.modules[mod_name]).get(fn)) if mod_name in sys.modules else None
        if code is not None:
            helpers[id(code)] = code
    ctypes_dir = None
    code_ok, obj_ok, class_ok = prov.code_ok, prov.obj_ok, prov.class_ok
    isclass, ismodule, append, _len, _str, _isinstance = inspect.isclass, inspect.ismodule, findings.append, len, str, \
        isinstance

    refused: list[str] = []

    def note(what: str) -> None:
        refused.append(what)
        if _len(findings) < MAX_FINDINGS and what not in findings:
            append(what)
            emit("tamper", what=what)

    def where(frame) -> str:
        return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "?"

    def untrusted_on_stack(frame):
        while frame is not None:
            if not code_ok(frame.f_code):
                return frame
            frame = frame.f_back
        return None

    def hook(event: str, args) -> None:
        if event == "sys.addaudithook":
            note("sys.addaudithook called: code under test tried to add an audit hook")
            raise RuntimeError("audit hooks are reserved for the grader")
        suspect_attr = event == "object.__getattr__" and args[1] in FRAME_ATTRS
        suspect_set = event in ("object.__setattr__", "object.__delattr__")
        if not (event in ANY_CALLER or event in CALLER or suspect_attr or suspect_set or event == "open" or
                event == "compile" or event == "os.truncate" or event.startswith("ctypes.")):
            return
        me = get_ident()
        if me in busy:
            return
        busy.add(me)
        n = _len(refused)
        try:
            check(event, args, me, suspect_attr, suspect_set)
        except Exception as e:  # noqa: BLE001 - a broken check is itself a finding
            note(f"audit check of {event} failed: {type(e).__name__}")
        finally:
            busy.discard(me)
        if _len(refused) > n:
            raise RuntimeError(f"refused by the grader: {refused[n]}")

    def check(event: str, args, me: int, suspect_attr: bool, suspect_set: bool) -> None:
        nonlocal ctypes_dir
        if event == "open" or event == "os.truncate":
            path = args[0]
            if _isinstance(path, (str, bytes)):
                path = path.decode("utf-8", "replace") if _isinstance(path, bytes) else path
                if path.endswith((record_base, fd_suffix)) or (path.startswith("/proc/") and path.endswith("/mem")):
                    note(f"{event}({path!r}) by {where(getframe(2))}")
            elif event == "os.truncate" and path == fd:
                note(f"os.truncate of the record by {where(getframe(2))}")
            return
        try:
            frame = getframe(2)  # the Python code that raised the event (above hook and check)
        except ValueError:
            frame = None  # raised from C with no Python frame (a thread started in C)
        other_thread = me != main_thread
        if event.startswith("ctypes."):
            # ctypes' own module code loading libraries is fine (importing ctypes does it)
            if ctypes_dir is None and "ctypes" in sys.modules:
                ctypes_dir = os.path.dirname(getattr(sys.modules["ctypes"], "__file__", "") or "") + "/"
            if event in ("ctypes.dlopen", "ctypes.dlsym") and ctypes_dir and frame is not None and \
                    frame.f_code.co_filename.startswith(ctypes_dir) and code_ok(frame.f_code):
                return
            bad = untrusted_on_stack(frame)
            if bad is not None or other_thread:
                note(f"{event} with {where(bad or frame)} on the stack{' (not the main thread)' * other_thread}")
            return
        if event in ANY_CALLER:
            bad = untrusted_on_stack(frame)
            if bad is not None or other_thread:
                note(f"{event} with {where(bad or frame)} on the stack{' (not the main thread)' * other_thread}")
            return
        while frame is not None and helpers.get(id(frame.f_code)) is frame.f_code:
            frame = frame.f_back
        if frame is None or code_ok(frame.f_code):
            return
        if event == "compile":
            name = args[1]
            name = name.decode("utf-8", "replace") if _isinstance(name, bytes) else _str(name or "")
            if name.startswith("<frozen ") or prov.ok(name):
                note(f"compile() with the trusted file name {name!r} by {where(frame)}")
        elif suspect_set:
            target = args[0]
            trusted = class_ok(target) if isclass(target) else (not ismodule(target) and obj_ok(target) and
                                                                _code_of(target) is not None)
            if trusted:
                note(f"{event} {getattr(target, '__qualname__', type(target).__name__)}.{args[1]} "
                     f"by {where(frame)}")
        else:
            note(f"{event}{'.' + args[1] if suspect_attr else ''} by {where(frame)}")

    return hook


def _status(report, prev: str | None) -> str | None:
    """The per-test status pytest -rA would show, from the setup / call / teardown reports."""
    xfail = hasattr(report, "wasxfail")
    if report.when == "setup":
        if report.failed:
            return "ERROR"
        if report.skipped:
            return "XFAIL" if xfail else "SKIPPED"
        return prev
    if report.when == "call":
        if report.passed:
            return "XPASS" if xfail else "PASSED"
        if report.failed:
            return "FAILED"
        return "XFAIL" if xfail else "SKIPPED"
    if report.failed:  # teardown
        return "ERROR"
    return prev


ITEM_METHODS = ("runtest", "setup", "teardown")  # set on an instance, they replace what the item runs


class GraderPlugin:
    def __init__(self, emit, integrity: Integrity, findings: list[str]):
        self.emit, self.integrity, self.findings = emit, integrity, findings
        self.session = None
        self.report_cls = sys.modules["_pytest.reports"].TestReport
        self.car = _code_of(sys.modules["_pytest.runner"].call_and_report)
        self.pluggy_dir = os.path.dirname(sys.modules["pluggy"].__file__) + "/"
        self.multicall = _code_of(sys.modules["pluggy._callers"]._multicall)
        self.byid: dict[str, object] = {}
        self.shape: dict[int, tuple] = {}
        self.status: dict[str, str] = {}
        self.unittest: set[str] = set()
        self.items: list = []
        self.codes: dict = {}
        self.collect_errors = 0
        self.finished = False

    def pytest_configure(self, config):
        self.integrity.capture_plugins(config)
        self.config = config
        ini = config.inipath
        self.emit("config", inipath=str(ini) if ini else None, rootpath=str(config.rootpath),
                  pytest=sys.modules["pytest"].__file__, plugins=sorted(
                      str(getattr(p, "__file__", type(p).__module__)) for p in config.pluginmanager.get_plugins()))

    def pytest_plugin_registered(self, plugin, manager):
        f = getattr(plugin, "__file__", None)
        if f and os.path.basename(f) == "conftest.py":
            self.emit("conftest", path=f)
        # any hook, not only those that decide outcomes: a plugin's logstart can arm the rest
        for name in dir(plugin):
            if name.startswith("pytest_"):
                fn = getattr(plugin, name, None)
                if callable(fn) and not self.integrity.prov.obj_ok(fn):
                    self._found(f"plugin {manager.get_name(plugin)} registered with {name} from {_code_file(fn)}")

    def pytest_collectreport(self, report):
        if report.failed:
            self.collect_errors += 1
            self.emit("collect-error", nodeid=report.nodeid)

    def pytest_collection_finish(self, session):
        self.items = list(session.items)
        for item in self.items:
            fn = getattr(item, "obj", None)
            self.codes[item.nodeid] = getattr(getattr(fn, "__func__", fn), "__code__", None)
            if type(item).__name__ == "TestCaseFunction":
                self.unittest.add(item.nodeid)
            # what collection set: the item's class and (pytest functions) the object it calls
            self.shape[id(item)] = (type(item), vars(item).get("_obj", _MISSING))
            self.byid[item.nodeid] = item
        self.session = session
        self.emit("collected", n=len(self.items))

    def check_items(self, items) -> list[str]:
        """Items as collection left them: no instance runtest/setup/teardown, same class, same
        function object; Session.items a plain list of the collected items (red team B3)."""
        found = []
        if self.session is not None:
            now = vars(self.session).get("items")
            if type(now) is not list:
                found.append(f"session.items replaced by a {type(now).__name__}")
            elif len(now) != len(self.items) or any(a is not b for a, b in zip(now, self.items)):
                found.append("session.items changed after collection")
        for item in items:
            d = vars(item)
            cls, obj = self.shape.get(id(item), (None, None))
            for k in ITEM_METHODS:
                if k in d:
                    found.append(f"{item.nodeid}: instance attribute {k} set")
            if type(item) is not cls:
                found.append(f"{item.nodeid}: class changed to {type(item).__name__}")
            elif type(item).__name__ == "Function" and d.get("_obj", _MISSING) is not obj:
                found.append(f"{item.nodeid}: test function object replaced")
        return found

    def _vet_running_impls(self, hook: str) -> None:
        """The implementations pluggy is running for this hook call, read from its `_multicall`
        frame: a wrapper that unregisters itself while it runs is not in the registry when the
        session-end or per-test checks look, but it is in that list."""
        frame = sys._getframe(2)  # the wrapper generator's caller
        if frame is None or frame.f_code is not self.multicall:
            self._found(f"{hook} called from outside pluggy's _multicall")
            return
        for impl in list(frame.f_locals.get("hook_impls") or ()):
            if not self.integrity.prov.obj_ok(impl.function):
                self._found(f"hook {hook} implemented in {_code_file(impl.function)} ({impl.plugin_name})")

    def _found(self, what: str) -> None:
        if what not in self.findings:
            self.findings.append(what)
            self.emit("tamper", what=what)

    def pytest_runtest_makereport(self, item, call):
        self._vet_running_impls("pytest_runtest_makereport")
        return (yield)

    def pytest_pyfunc_call(self, pyfuncitem):
        self._vet_running_impls("pytest_pyfunc_call")
        return (yield)

    def pytest_runtest_call(self, item):
        self._vet_running_impls("pytest_runtest_call")
        return (yield)

    def _genuine(self, report) -> bool:
        """A report pytest's runner made and passed here, not one that code under test built or
        sent through the hook."""
        if type(report) is not self.report_cls:
            return False
        frame = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename.startswith(self.pluggy_dir) and \
                self.integrity.prov.code_ok(frame.f_code):
            frame = frame.f_back
        return frame is not None and frame.f_code is self.car

    def pytest_runtest_logreport(self, report):
        if not self._genuine(report):
            self.findings.append(f"a test report for {report.nodeid} that pytest's runner did not make")
            self.emit("tamper", what=self.findings[-1])
            return
        # each phase as it happens: the host derives the status from these (trusted.py), so state
        # kept here between phases (self.status) is not what the verdict rests on
        self.emit("phase", nodeid=report.nodeid, when=report.when, outcome=report.outcome,
                  xfail=hasattr(report, "wasxfail"))
        if report.when == "call" and self.integrity.changed():  # pytest's machinery while tests run
            found = self.integrity.check()
            for f in found:
                if f not in self.findings:
                    self.findings.append(f)
                    self.emit("tamper", what=f)
            if not found:
                self.integrity.rebase()
        st = _status(report, self.status.get(report.nodeid))
        if st is not None:
            self.status[report.nodeid] = st
        item = self.byid.get(report.nodeid)
        if item is not None and report.when != "setup":
            for f in self.check_items([item]):
                if f not in self.findings:
                    self.findings.append(f)
        if report.when == "teardown":
            self.emit("test", nodeid=report.nodeid, status=self.status.get(report.nodeid, "ERROR"),
                      unittest=report.nodeid in self.unittest)

    def pytest_sessionfinish(self, session, exitstatus):
        self.finished = True
        tampered = self.integrity.check(self.items, self.codes) + self.check_items(self.items) + list(self.findings)
        self.emit("end", exitstatus=int(exitstatus), tests=len(self.status), collect_errors=self.collect_errors,
                  tampered=tampered)


def _own_code() -> dict[int, object]:
    """id -> code object of every function in this file (the record writer's permitted callers)."""
    import inspect

    out: dict[int, object] = {}

    def walk(code):
        if id(code) not in out:
            out[id(code)] = code
            for c in code.co_consts:
                if inspect.iscode(c):
                    walk(c)

    for value in list(globals().values()):
        for v in [value, *(vars(value).values() if inspect.isclass(value) else ())]:
            code = _code_of(v)
            if code is not None and code.co_filename == __file__:
                walk(code)
    return out


# the outermost wrappers (pluggy reads these options the way @pytest.hookimpl sets them)
for _name in ("pytest_runtest_makereport", "pytest_pyfunc_call", "pytest_runtest_call"):
    vars(GraderPlugin)[_name].pytest_impl = {"wrapper": True, "hookwrapper": False, "optionalhook": False,
                                             "tryfirst": True, "trylast": False, "specname": None}


def _preimport_pytest() -> None:
    sys.path[:0] = [SITE, DEPS]
    import pkgutil

    import _pytest
    import pluggy  # noqa: F401
    import pytest  # noqa: F401

    for info in pkgutil.walk_packages(_pytest.__path__, "_pytest."):
        __import__(info.name)
    for name in ("unittest", "unittest.mock", "doctest", "pdb", "json", "hmac", "inspect", "functools", "re",
                 "importlib.metadata", "pkgutil", "traceback", "warnings", "tempfile", "shlex", "argparse"):
        __import__(name)
    # pytest keeps the copies of its dependencies it has imported (iniconfig, packaging); the tests
    # must import their own: the project under test may be one of them (the iniconfig workspace)
    sys.path.remove(DEPS)
    for name, mod in list(sys.modules.items()):
        if (getattr(mod, "__file__", None) or "").startswith(DEPS + "/"):
            del sys.modules[name]


def _add_site_dirs() -> list[str]:
    """The system site directories, with their .pth files (test dependencies, editable installs);
    never sitecustomize / usercustomize."""
    import site

    dirs = [d for d in site.getsitepackages() if os.path.isdir(d)]
    for d in dirs:
        site.addsitedir(d)
    return dirs


def _trusted_entry_points(repo: str) -> list[str]:
    """`-p` arguments for pytest11 plugins of distributions installed outside the repository."""
    import importlib.metadata as md

    out = []
    repo = _realpath(repo) + "/"
    for dist in md.distributions():
        where = _realpath(str(getattr(dist, "_path", "")))
        if not where or where.startswith(repo) or not where.startswith("/usr/"):
            continue
        for ep in dist.entry_points:
            if ep.group == "pytest11" and ep.module not in out:
                out += [ep.module]
    return [a for m in out for a in ("-p", m)]


def _unittest_target(repo: str, nodeid: str):
    """Import a TestCase test the way pytest's default import mode would, without pytest."""
    path, cls_name, method = nodeid.split("::")
    full = os.path.join(repo, path)
    base, parts = os.path.dirname(full), [os.path.splitext(os.path.basename(full))[0]]
    while os.path.isfile(os.path.join(base, "__init__.py")):
        parts.insert(0, os.path.basename(base))
        base = os.path.dirname(base)
    sys.path.insert(0, base)
    import importlib

    mod = importlib.import_module(".".join(parts))
    return getattr(mod, cls_name)(method)


def run_unittest(cfg: dict, emit, integrity: Integrity, findings: list[str]) -> int:
    """Confirmation under a different runner: one TestCase test through the stdlib unittest runner.
    The result class and its methods are bound before the test module (and the library) is
    imported, and checked after the test ran (red team B4, B6)."""
    import unittest.result

    result_cls = unittest.result.TestResult
    methods = {k: v for k, v in vars(result_cls).items() if callable(v)}
    nodeid = cfg["nodeid"]
    emit("config", runner="unittest", nodeid=nodeid)
    try:
        test = _unittest_target(cfg["repo"], nodeid)
    except Exception as e:  # noqa: BLE001 - the test could not be imported: an error, as pytest would report it
        emit("test", nodeid=nodeid, status="ERROR", unittest=True, why=repr(e)[:300])
        emit("end", exitstatus=2, tests=1, collect_errors=1, tampered=integrity.check() + list(findings))
        return 2
    result = result_cls()
    test.run(result)
    if type(result) is not result_cls:
        findings.append(f"the TestResult's class changed to {type(result).__name__}")
    findings += [f"TestResult.{k} set on the instance" for k in methods if k in vars(result)]
    findings += [f"TestResult.{k} replaced" for k, v in methods.items() if vars(result_cls).get(k) is not v]
    if result.errors:
        st = "ERROR"
    elif result.failures or result.unexpectedSuccesses:
        st = "FAILED"
    elif result.expectedFailures:
        st = "XFAIL"
    elif result.skipped:
        st = "SKIPPED"
    else:
        st = "PASSED" if result.testsRun == 1 else "ERROR"
    for _, tb in result.errors + result.failures:
        sys.stderr.write(tb)
    sys.stdout.write(f"{st} {nodeid}\n")
    emit("test", nodeid=nodeid, status=st, unittest=True)
    code = 0 if st in ("PASSED", "XFAIL", "SKIPPED") else 1
    emit("end", exitstatus=code, tests=1, collect_errors=0, tampered=integrity.check() + list(findings))
    return code


def main() -> int:
    started = _time()
    cfg = json.loads(sys.stdin.buffer.read() or b"{}")
    # stdin is spent: code under test reads /dev/null, never the config
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    key = bytes.fromhex(cfg.pop("key"))
    fd = os.open(cfg["record"], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o600)
    callers: dict[int, object] = {}
    emit = _channel(key, fd, callers)
    del key
    mode = cfg.get("mode", "pytest")
    if mode == "pytest":
        _preimport_pytest()
    else:
        import unittest  # noqa: F401
    site_dirs = _add_site_dirs()
    import builtins
    import sysconfig

    trusted = [HERE, sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"], *site_dirs]
    prov = Provenance(cfg["repo"], cfg["protected"], trusted, started)
    os.chdir(cfg["repo"])
    args = ["-p", "no:cacheprovider", "-o", "addopts=", *_trusted_entry_points(cfg["repo"]), *cfg["args"]]
    integrity = Integrity(prov)
    findings: list[str] = []
    # this file's globals and the builtins: writable by code under test without an audit event,
    # compared at the end with code that looks up none of them
    missing, int_, list_ = object(), int, list
    watched = [(name, d, {k: v for k, v in d.items() if not k.startswith("__")})
               for name, d in (("run.py", globals()), ("builtins", vars(builtins)))]
    callers.update(_own_code())
    # before any code under test runs: hooks cannot be removed, and this one refuses others
    sys.addaudithook(_audit_hook(prov, cfg["record"], fd, findings, emit))
    plugin = None
    if mode == "unittest":
        code = run_unittest(cfg, emit, integrity, findings)
    else:
        import pytest

        os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
        plugin = GraderPlugin(emit, integrity, findings)
        emit("start", args=args, python=sys.version.split()[0])
        code = pytest.main(args, plugins=[plugin])
        if not plugin.finished:
            emit("end", exitstatus=int(code), tests=len(plugin.status), collect_errors=plugin.collect_errors,
                 tampered=["pytest ended without finishing its session"])
    changed = [f"{name}.{k} replaced" for name, live, snap in watched for k in snap
               if live.get(k, missing) is not snap[k]]
    try:
        found = integrity.check(plugin.items, plugin.codes) if plugin is not None else integrity.check()
        if plugin is not None:
            found += plugin.check_items(plugin.items)
    except BaseException as e:  # noqa: BLE001 - a check that cannot run is a finding, not a crash
        found = [f"the integrity check failed: {type(e).__name__}"]
    # the grader requires this line: a run that never gets here is incomplete
    emit("exit", code=int_(code), tampered=changed + list_(findings) + found)
    return int_(code)


if __name__ == "__main__":
    sys.exit(main())
