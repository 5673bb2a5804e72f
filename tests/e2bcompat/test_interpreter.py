"""The unmodified `e2b-code-interpreter` SDK against the `code-interpreter` template: `run_code` (sync
and async) reaches Shoal's execute server on port 49999 inside the sandbox through the front's port
route. The image is built once per session from its recipe (templates.py) on python:3.11."""
from __future__ import annotations

import asyncio
import base64
import time

import httpx
import pytest
from e2b_code_interpreter import AsyncSandbox, Sandbox


@pytest.fixture(scope="module")
def ci(e2b_server, code_interpreter_image):
    s = Sandbox.create(timeout=300, api_url=e2b_server["url"], sandbox_url=e2b_server["url"],
                       api_key=e2b_server["key"])  # the SDK's default template, code-interpreter-v1
    yield s
    s.kill()


def test_run_code_output_results_errors_and_counts(ci):
    seen: list[str] = []
    r = ci.run_code("x = 21\nprint('hello')\nx * 2", on_stdout=lambda m: seen.append(m.line))
    assert r.error is None, r.error
    assert r.logs.stdout == ["hello\n"] and seen == ["hello\n"]
    assert r.text == "42" and r.results[0].is_main_result
    first = r.execution_count
    assert isinstance(first, int) and first >= 1
    r = ci.run_code("import sys; print('oops', file=sys.stderr); x")
    assert r.logs.stderr == ["oops\n"] and r.text == "21"  # state kept between calls
    assert r.execution_count == first + 1
    r = ci.run_code("def f():\n    return 1 / 0\nf()")
    assert r.error is not None and r.error.name == "ZeroDivisionError"
    assert r.error.value == "division by zero" and "f()" in r.error.traceback
    assert r.execution_count == first + 2
    r = ci.run_code("import os; os.environ.get('GREETING')", envs={"GREETING": "hi there"})
    assert r.text == "'hi there'"
    assert ci.run_code("import os; os.environ.get('GREETING')").text is None  # for that execution only


def test_a_matplotlib_figure_comes_back_as_png(ci):
    r = ci.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.title('t')\nplt.show()")
    assert r.error is None, r.error
    pngs = [res.png for res in r.results if res.png]
    assert len(pngs) == 1
    assert base64.b64decode(pngs[0]).startswith(b"\x89PNG\r\n\x1a\n")


def test_contexts_are_separate_kernels(ci):
    ctx = ci.create_code_context(cwd="/tmp")
    assert ctx.language == "python" and ctx.cwd == "/tmp"
    assert ci.run_code("y = 5\nimport os; os.getcwd()", context=ctx).text == "'/tmp'"
    assert ci.run_code("y", context=ctx).text == "5"
    r = ci.run_code("y")  # the default context never saw y
    assert r.error is not None and r.error.name == "NameError"
    assert ctx.id in [c.id for c in ci.list_code_contexts()]
    ci.restart_code_context(ctx)
    assert ci.run_code("'y' in dir()", context=ctx).text == "False"
    ci.remove_code_context(ctx)
    assert ctx.id not in [c.id for c in ci.list_code_contexts()]


def test_another_tenant_cannot_run_code_in_it(ci, e2b_server):
    bob = Sandbox.create(timeout=60, api_url=e2b_server["url"], sandbox_url=e2b_server["url"],
                         api_key=e2b_server["other_key"])
    try:
        for token in ({"E2B-Traffic-Access-Token": bob.traffic_access_token}, {}):
            r = httpx.post(e2b_server["url"] + "/execute", json={"code": "print('pwned')"}, timeout=30,
                           headers={"E2b-Sandbox-Id": ci.sandbox_id, "E2b-Sandbox-Port": "49999", **token})
            assert r.status_code == 401, r.text
    finally:
        bob.kill()


def test_async_run_code(e2b_server, code_interpreter_image):
    async def main() -> None:
        s = await AsyncSandbox.create(timeout=120, api_url=e2b_server["url"], sandbox_url=e2b_server["url"],
                                      api_key=e2b_server["key"])
        try:
            out: list[str] = []
            r = await s.run_code("print('async'); 6 * 7", on_stdout=lambda m: out.append(m.line))
            assert (r.logs.stdout, r.text, out) == (["async\n"], "42", ["async\n"])
            r2 = await s.run_code("raise ValueError('bad')")
            assert r2.error is not None and (r2.error.name, r2.error.value) == ("ValueError", "bad")
            assert r2.execution_count == r.execution_count + 1
        finally:
            await s.kill()

    asyncio.run(main())


def test_a_timed_out_run_code_interrupts_its_cell(ci):
    """The SDK's `timeout` closes the request; the cell must stop (else the kernel stays busy, and the
    next run_code waits behind it)."""
    from e2b import TimeoutException

    with pytest.raises(TimeoutException):
        ci.run_code("import time\nfor i in range(60):\n    time.sleep(0.5)", timeout=2)
    t0 = time.monotonic()
    assert ci.run_code("'free'", timeout=20).text == "'free'"
    assert time.monotonic() - t0 < 10
