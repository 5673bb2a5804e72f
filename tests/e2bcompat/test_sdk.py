"""The unmodified `e2b` SDK (sync) against `shoal e2b serve` over real container sandboxes."""
from __future__ import annotations

import pytest
from e2b import CommandExitException, Sandbox
from e2b.exceptions import AuthenticationException


def test_create_run_kill(sbx, opts):
    r = sbx.commands.run("echo hello; echo oops >&2")
    assert r.exit_code == 0
    assert r.stdout == "hello\n"
    assert r.stderr == "oops\n"
    assert sbx.is_running()
    info = Sandbox.get_info(sbx.sandbox_id, **opts)
    assert info.sandbox_id == sbx.sandbox_id and info.template_id == "base"
    assert sbx.kill() is True
    assert sbx.is_running() is False  # envd's 502 path
    assert Sandbox.kill(sbx.sandbox_id, **opts) is False  # unknown id


def test_exit_code_env_cwd(sbx):
    with pytest.raises(CommandExitException) as ei:
        sbx.commands.run("exit 3")
    assert ei.value.exit_code == 3
    r = sbx.commands.run("echo $FOO; pwd", envs={"FOO": "bar"}, cwd="/tmp")
    assert r.stdout == "bar\n/tmp\n"
    assert sbx.commands.run("pwd; echo $HOME").stdout == "/home/user\n/home/user\n"


def test_wrong_api_key(opts):
    with pytest.raises(AuthenticationException):
        Sandbox.create("base", **{**opts, "api_key": "e2b_" + "0" * 40})
