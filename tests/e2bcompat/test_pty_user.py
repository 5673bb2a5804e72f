"""`sandbox.pty` (an interactive login bash on a PTY) and `user=` through the unmodified SDK, sync and async."""
from __future__ import annotations

import asyncio
import time

import pytest


def _until(handle, marker: bytes, seen: bytearray, timeout: float = 20) -> None:
    """Read a sync PTY handle's output into `seen` until `marker` shows up."""
    deadline = time.monotonic() + timeout
    for _, _, pty in handle:
        if pty:
            seen += pty
        if marker in seen:
            return
        assert time.monotonic() < deadline, f"no {marker!r} in {bytes(seen)!r}"
    raise AssertionError(f"the PTY ended before {marker!r}: {bytes(seen)!r}")


def test_pty_interactive_bash_resize_kill(sbx):
    from e2b import CommandExitException, PtySize

    h = sbx.pty.create(PtySize(rows=24, cols=80), timeout=60)
    seen = bytearray()
    # the terminal echoes the input: each marker is spelled differently in the command than in its output
    sbx.pty.send_stdin(h.pid, b"echo A$((6*7)); tty; stty size; id -u; echo $HOME; "
                              b"[[ $- == *i* ]] && echo INTER''ACTIVE\n")
    _until(h, b"INTERACTIVE\r\n", seen)
    out = bytes(seen)
    assert b"A42" in out and b"/dev/pts/" in out and b"24 80" in out
    assert b"1000\r\n" in out and b"/home/user" in out  # E2B's default user, on its own terminal
    sbx.pty.resize(h.pid, PtySize(rows=50, cols=132))
    sbx.pty.send_stdin(h.pid, b"stty size; echo DO''NE\n")
    _until(h, b"DONE\r\n", seen)
    assert b"50 132" in bytes(seen)
    assert h.pid in [p.pid for p in sbx.commands.list()]
    assert sbx.pty.kill(h.pid) is True
    with pytest.raises(CommandExitException):  # killed by the signal
        h.wait()
    assert sbx.pty.kill(h.pid) is False  # gone


def test_pty_exit_code_and_root(sbx):
    from e2b import CommandExitException, PtySize

    h = sbx.pty.create(PtySize(rows=10, cols=40), user="root")
    sbx.pty.send_stdin(h.pid, b"id -u; exit 7\n")
    chunks: list[bytes] = []
    with pytest.raises(CommandExitException) as e:
        h.wait(on_pty=chunks.append)
    assert getattr(e.value, "exit_code", None) == 7
    assert b"0\r\n" in b"".join(chunks)


def test_pty_async(opts):
    from e2b import AsyncSandbox, PtySize

    async def main() -> None:
        s = await AsyncSandbox.create("base", timeout=60, **opts)
        try:
            got = bytearray()
            h = await s.pty.create(PtySize(rows=20, cols=60), on_data=got.extend)
            await s.pty.resize(h.pid, PtySize(rows=33, cols=77))
            await s.pty.send_stdin(h.pid, b"stty size; exit 0\n")
            r = await h.wait()
            assert r.exit_code == 0
            assert b"33 77" in bytes(got)
        finally:
            await s.kill()

    asyncio.run(main())


def test_user_default_root_and_files(sbx):
    r = sbx.commands.run("id -u; id -g; echo $HOME; echo $USER; pwd")
    assert r.stdout == "1000\n1000\n/home/user\nuser\n/home/user\n"
    r = sbx.commands.run("id -u; echo $HOME; pwd", user="root")
    assert r.stdout == "0\n/root\n/root\n"
    # what the files API makes for the user is the user's: their commands can write there
    info = sbx.files.write("made/by/api.txt", "x")
    assert sbx.files.get_info(info.path).owner == "user"
    assert sbx.files.get_info("/home/user/made").owner == "user"
    sbx.commands.run("echo more >> made/by/api.txt && touch made/by/new")
    assert sbx.files.read("made/by/api.txt") == "xmore\n"
    sbx.files.write("/tmp/root-owned", "r", user="root")
    assert sbx.files.get_info("/tmp/root-owned").owner == "root"
    assert [e.owner for e in sbx.files.list("/etc") if e.name == "passwd"] == ["root"]


def test_user_cannot_get_root_back(sbx):
    """Hostile code running as `user`: no capability, no way to root through what root left around."""
    from e2b import CommandExitException

    # root plants a setuid-root shell: exec'd by the user it must not raise privileges (no_new_privs)
    # (tests/security/test_run_as_user.py does the same with a probe that calls setuid(0) itself)
    sbx.commands.run("mkdir /tmp/s && cp /bin/busybox /tmp/s/busybox && chmod 4755 /tmp/s/busybox", user="root")
    r = sbx.commands.run("/tmp/s/busybox id -u; grep -E '^Cap(Eff|Prm|Amb)' /proc/self/status")
    assert r.stdout.splitlines()[0] == "1000"
    assert all(line.split()[1] == "0000000000000000" for line in r.stdout.splitlines()[1:])
    for attempt in ("echo x > /etc/passwd", "kill -9 1", "touch /root/x", "chown user /tmp/root-x; touch /root/y"):
        with pytest.raises(CommandExitException):
            sbx.commands.run(attempt)
    assert "x" not in sbx.files.read("/etc/passwd").splitlines()


def test_upload_metadata_is_kept_as_xattrs(sbx, e2b_server):
    import httpx

    info = sbx.files.write("meta.txt", "m", metadata={"Team": "rl", "run": "42"})
    assert info.metadata == {"team": "rl", "run": "42"}  # keys lowercased, as envd does
    assert sbx.files.get_info("meta.txt").metadata == {"team": "rl", "run": "42"}
    assert sbx.files.get_info("/etc/passwd").metadata is None
    r = httpx.post(e2b_server["url"] + "/files", params={"path": "/tmp/m2"}, content=b"x",
                   headers={"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": sbx._envd_access_token,
                            "Content-Type": "application/octet-stream",
                            **{f"X-Metadata-k{i}": "v" for i in range(65)}})
    assert r.status_code == 400 and "X-Metadata" in r.json()["message"]
