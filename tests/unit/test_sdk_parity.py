"""The sync and async SDK surfaces are the same: names, parameters, kinds and defaults.

AsyncSandbox is generated from the sync classes (shoal.sdk.codegen); these tests fail when the
committed file is stale or when the two surfaces differ in any way a caller could notice."""
from __future__ import annotations

import inspect

import pytest

from shoal.core.contract import ProcessHandle, SessionHandle
from shoal.sdk import async_sandbox as A
from shoal.sdk import codegen
from shoal.sdk.sandbox import Commands, Files, ForkResult, Sandbox, Sessions

PAIRS = [(Sandbox, A.AsyncSandbox), (Commands, A.AsyncCommands), (Files, A.AsyncFiles),
         (Sessions, A.AsyncSessions), (ProcessHandle, A.AsyncProcessHandle), (SessionHandle, A.AsyncSession),
         (ForkResult, A.AsyncForkResult)]

RENAMED = {"__enter__": "__aenter__", "__exit__": "__aexit__"}


def _surface(cls: type) -> dict[str, object]:
    """Public methods, properties and (dataclass) fields, by name."""
    out: dict[str, object] = {}
    for klass in reversed(cls.__mro__[:-1]):
        for name, value in vars(klass).items():
            if not name.startswith("_") or name in RENAMED or name in RENAMED.values():
                out[name] = value
    for name in getattr(cls, "__dataclass_fields__", {}):
        out.setdefault(name, "field")
    for name in getattr(cls, "__annotations__", {}):  # attributes the ABCs declare (id, pid, shell...)
        if not name.startswith("_"):
            out.setdefault(name, "attribute")
    return out


def _params(fn: object) -> list[tuple[str, str, object]]:
    func = fn.__func__ if isinstance(fn, (classmethod, staticmethod)) else fn
    sig = inspect.signature(func)  # type: ignore[arg-type]
    return [(p.name, p.kind.name, p.default) for p in sig.parameters.values() if p.name not in ("self", "cls")]


def differences(sync: type, asyn: type) -> list[str]:
    s, a = _surface(sync), _surface(asyn)
    out = []
    for name, value in s.items():
        twin = RENAMED.get(name, name)
        if twin not in a:
            out.append(f"{asyn.__name__} lacks {twin}")
            continue
        if callable(value) and not isinstance(value, type) or isinstance(value, classmethod):
            other = a[twin]
            if not (callable(other) or isinstance(other, classmethod)):
                out.append(f"{asyn.__name__}.{twin} is not a method")
                continue
            if name not in RENAMED and _params(value) != _params(other):
                out.append(f"{asyn.__name__}.{twin}{_params(other)} != {sync.__name__}.{name}{_params(value)}")
            fn = other.__func__ if isinstance(other, classmethod) else other
            if not (inspect.iscoroutinefunction(fn) or name == "stream"):
                out.append(f"{asyn.__name__}.{twin} is not async")
    for name in a:
        if name not in s and name not in RENAMED.values() and name != "_wrap":
            out.append(f"{asyn.__name__}.{name} has no sync twin")
    return out


@pytest.mark.parametrize("sync,asyn", PAIRS, ids=[p[0].__name__ for p in PAIRS])
def test_async_surface_equals_sync(sync, asyn):
    assert differences(sync, asyn) == []


def test_the_comparison_catches_a_drift():
    """The check above is not vacuous: a twin with a changed default, a missing method or a sync
    method is reported (the drifts the hand-written AsyncSandbox used to have)."""

    class Drifted:
        def __init__(self, sync):
            self._sync = sync

        async def create(self, shell=None, cwd="/", env=None, output_cap=None):  # default differs
            ...

    class Missing:
        pass

    class SyncOnly:
        def kill_all(self):  # not async
            ...

    assert any("create" in d for d in differences(Sessions, Drifted))
    assert any("lacks kill_all" in d for d in differences(ForkResult, Missing))
    assert any("kill_all is not async" in d for d in differences(ForkResult, SyncOnly))


def test_generated_file_is_current(capsys):
    assert codegen.main(["--check"]) == 0, "run `python -m shoal.sdk.codegen`"


def test_a_hand_edit_of_the_generated_file_is_detected(monkeypatch, tmp_path):
    stale = tmp_path / "async_sandbox.py"
    stale.write_text(codegen.generate().replace('cwd: str | None = None', 'cwd: str = "/"', 1))
    monkeypatch.setattr(codegen, "OUT", stale)
    assert codegen.main(["--check"]) == 1
