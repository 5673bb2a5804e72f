"""The unmodified `e2b` SDK (sync) against `shoal e2b serve` over real container sandboxes."""
from __future__ import annotations

import time

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


def test_background_connect_and_stdin(sbx):
    h = sbx.commands.run("sleep 0.5; echo late", background=True)
    assert h.pid > 0
    assert any(p.pid == h.pid for p in sbx.commands.list())
    again = sbx.commands.connect(h.pid)
    assert again.wait().stdout == "late\n"
    # stdin: a process that reads until EOF
    cat = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.send_stdin(cat.pid, "line one\n")
    sbx.commands.send_stdin(cat.pid, "line two\n")
    sbx.commands.close_stdin(cat.pid)
    assert cat.wait().stdout == "line one\nline two\n"
    # kill by pid; an unknown pid is False
    sleeper = sbx.commands.run("sleep 60", background=True)
    assert sbx.commands.kill(sleeper.pid) is True
    with pytest.raises(CommandExitException):
        sleeper.wait()
    assert sbx.commands.kill(999999) is False


def test_utf8_split_across_writes(sbx):
    # one character whose bytes arrive 0.2 s apart: it must not turn into two replacement characters
    r = sbx.commands.run(r"printf '\303'; sleep 0.2; printf '\251\n'")
    assert r.stdout == "\u00e9\n"


def test_stream_callbacks(sbx):
    seen: list[str] = []
    r = sbx.commands.run("for i in 1 2 3; do echo $i; sleep 0.05; done", on_stdout=seen.append)
    assert "".join(seen) == r.stdout == "1\n2\n3\n"


def test_files(sbx):
    from e2b import FileType

    info = sbx.files.write("notes/a.txt", "hello file")
    assert info.path == "/home/user/notes/a.txt"
    assert sbx.files.read("notes/a.txt") == "hello file"
    sbx.files.write("/tmp/b.bin", b"\x00\x01\xff")
    assert bytes(sbx.files.read("/tmp/b.bin", format="bytes")) == b"\x00\x01\xff"
    assert sbx.commands.run("cat /home/user/notes/a.txt").stdout == "hello file"  # the sandbox sees it
    assert sbx.files.exists("notes/a.txt") and not sbx.files.exists("notes/nope")
    assert sbx.files.make_dir("notes/sub/deep") is True
    assert sbx.files.make_dir("notes/sub/deep") is False  # already_exists
    names = {e.name: e for e in sbx.files.list("notes")}
    assert set(names) == {"a.txt", "sub"} and names["sub"].type == FileType.DIR
    deep = {e.path for e in sbx.files.list("notes", depth=3)}
    assert "/home/user/notes/sub/deep" in deep
    moved = sbx.files.rename("notes/a.txt", "notes/c.txt")
    assert moved.path == "/home/user/notes/c.txt"
    assert sbx.files.read("notes/c.txt") == "hello file" and not sbx.files.exists("notes/a.txt")
    infos = sbx.files.write_files([{"path": "multi/one", "data": "1"}, {"path": "/tmp/two", "data": b"2\r\n--x"}])
    assert [i.path for i in infos] == ["/home/user/multi/one", "/tmp/two"]
    assert sbx.files.read("/tmp/two", format="bytes") == b"2\r\n--x"
    sbx.files.write("/tmp/big.gz", b"z" * 100_000, gzip=True)  # octet-stream + Content-Encoding: gzip
    assert sbx.files.read("/tmp/big.gz", format="bytes") == b"z" * 100_000
    sbx.files.remove("notes/c.txt")
    assert not sbx.files.exists("notes/c.txt")
    from e2b.exceptions import NotFoundException

    with pytest.raises(NotFoundException):
        sbx.files.read("notes/c.txt")


def test_watch_dir(sbx):
    from e2b import FilesystemEventType

    sbx.files.make_dir("w")
    handle = sbx.files.watch_dir("w")
    sbx.files.write("w/new.txt", "data")
    deadline, events = time.monotonic() + 5, []
    while time.monotonic() < deadline and not any(e.type == FilesystemEventType.WRITE for e in events):
        events += handle.get_new_events()
        time.sleep(0.1)
    kinds = [e.type for e in events if e.name == "new.txt"]
    assert kinds[:1] == [FilesystemEventType.CREATE] and FilesystemEventType.WRITE in kinds
    # inotify through the contract: a rename is a RENAME of the old name and a CREATE of the new one
    # (not a REMOVE + CREATE)
    sbx.files.rename("w/new.txt", "w/renamed.txt")
    sbx.commands.run("echo a >> w/renamed.txt; echo b >> w/renamed.txt")
    deadline, events = time.monotonic() + 5, []
    while time.monotonic() < deadline and not any(e.type == FilesystemEventType.WRITE for e in events):
        events += handle.get_new_events()
        time.sleep(0.05)
    got = [(e.type, e.name) for e in events]
    assert got[:2] == [(FilesystemEventType.RENAME, "new.txt"), (FilesystemEventType.CREATE, "renamed.txt")], got
    assert (FilesystemEventType.WRITE, "renamed.txt") in got, got
    handle.stop()


def test_list_metadata_pagination_and_tenants(opts, e2b_server):
    from e2b import SandboxQuery

    tag = "run-" + str(id(opts))
    made = [Sandbox.create("base", timeout=60, metadata={"suite": tag, "i": str(i)}, **opts) for i in range(3)]
    other = Sandbox.create("base", timeout=60, metadata={"suite": "elsewhere"}, **opts)
    try:
        pager = Sandbox.list(query=SandboxQuery(metadata={"suite": tag}), limit=2, **opts)
        first = pager.next_items()
        assert len(first) == 2 and pager.has_next
        second = pager.next_items()
        assert len(second) == 1 and not pager.has_next
        got = [s.sandbox_id for s in first + second]
        assert got == [s.sandbox_id for s in reversed(made)]  # newest first
        assert all(s.metadata["suite"] == tag for s in first + second)
        # another tenant sees none of them and cannot kill them
        bob = {**opts, "api_key": e2b_server["other_key"]}
        assert Sandbox.list(query=SandboxQuery(metadata={"suite": tag}), **bob).next_items() == []
        assert Sandbox.kill(made[0].sandbox_id, **bob) is False
        assert made[0].is_running()
    finally:
        for s in [*made, other]:
            s.kill()


def test_set_timeout_expiry(opts):
    s = Sandbox.create("base", timeout=60, **opts)
    s.set_timeout(2)
    end = Sandbox.get_info(s.sandbox_id, **opts).end_at.timestamp()
    assert end - time.time() < 3
    deadline = time.monotonic() + 10
    while s.is_running() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not s.is_running()


def test_pause_and_connect(opts):
    s = Sandbox.create("base", timeout=60, **opts)
    try:
        s.files.write("/tmp/kept", "state")
        bg = s.commands.run("i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 0.05; done", background=True)
        assert bg.pid
        assert s.pause() is True
        assert s.is_running() is False  # paused: envd answers 502
        assert s.pause() is False  # 409: already paused
        before = Sandbox.get_info(s.sandbox_id, **opts)
        assert before.state.value == "paused"
        r = Sandbox.connect(s.sandbox_id, timeout=30, **opts)
        assert r.is_running()
        assert r.files.read("/tmp/kept") == "state"  # memory and files kept
        n1 = int(r.commands.run("cat /tmp/count").stdout)
        time.sleep(0.3)
        assert int(r.commands.run("cat /tmp/count").stdout) > n1  # the loop runs again
    finally:
        s.kill()



def test_async_sdk(opts):
    import asyncio

    from e2b import AsyncSandbox

    async def main() -> None:
        s = await AsyncSandbox.create("base", timeout=60, **opts)
        try:
            r = await s.commands.run("echo async; echo err >&2")
            assert (r.stdout, r.stderr, r.exit_code) == ("async\n", "err\n", 0)
            await s.files.write("x.txt", "via async")
            assert await s.files.read("x.txt") == "via async"
            h = await s.commands.run("sleep 0.3; echo bg", background=True)
            assert (await h.wait()).stdout == "bg\n"
            # the WatchDir stream (the async SDK's watcher)
            from e2b import FilesystemEventType

            await s.files.make_dir("aw")
            seen: list = []
            wh = await s.files.watch_dir("aw", on_event=seen.append)
            await s.files.write("aw/f.txt", "1")
            for _ in range(100):
                if any(e.type == FilesystemEventType.WRITE for e in seen):
                    break
                await asyncio.sleep(0.05)
            assert [e.type for e in seen][:1] == [FilesystemEventType.CREATE]
            assert any(e.type == FilesystemEventType.WRITE and e.name == "f.txt" for e in seen)
            await wh.stop()
        finally:
            assert await s.kill() is True
        assert await s.is_running() is False

    asyncio.run(main())


def test_bad_input(opts, e2b_server):
    import httpx
    from e2b.exceptions import NotFoundException, SandboxException

    with pytest.raises((NotFoundException, SandboxException)):
        Sandbox.create("no-such-template", **opts)
    url = e2b_server["url"]
    key = {"X-API-KEY": e2b_server["key"]}
    # malformed bodies and ids get {code, message}, never a 500
    for r in (httpx.post(url + "/v2/sandboxes", content=b"{not json", headers=key),
              httpx.post(url + "/v2/sandboxes", json={"templateID": "base", "timeout": -5}, headers=key),
              httpx.post(url + "/v2/sandboxes", json={"templateID": "base", "metadata": {"a": 1}}, headers=key),
              httpx.get(url + "/v2/sandboxes?limit=0", headers=key),
              httpx.get(url + "/v2/sandboxes?nextToken=%%%", headers=key),
              httpx.get(url + "/sandboxes/sb-nope", headers=key)):
        assert 400 <= r.status_code < 500, (r.status_code, r.text)
        assert set(r.json()) == {"code", "message"}
    # envd without a token, or with another sandbox's token, is refused
    a = httpx.post(url + "/v2/sandboxes", json={"templateID": "base", "timeout": 30}, headers=key).json()
    b = httpx.post(url + "/v2/sandboxes", json={"templateID": "base", "timeout": 30}, headers=key).json()
    try:
        hdr = {"E2b-Sandbox-Id": a["sandboxID"], "E2b-Sandbox-Port": "49983"}
        assert httpx.get(url + "/health", headers=hdr).status_code == 401
        assert httpx.get(url + "/health", headers={**hdr, "X-Access-Token": b["envdAccessToken"]}).status_code == 401
        ok = {**hdr, "X-Access-Token": a["envdAccessToken"]}
        assert httpx.get(url + "/health", headers=ok).status_code == 204
        # a path cannot leave the sandbox's root: ../ stops at its /
        r = httpx.get(url + "/files", params={"path": "../../../../etc/hostname"}, headers=ok)
        assert r.status_code in (200, 404) and r.content != open("/etc/hostname", "rb").read()
        # a truncated Connect envelope is a clean stream error
        r = httpx.post(url + "/process.Process/Start", content=b"\x00\x00\x00\x10{}",
                       headers={**ok, "Content-Type": "application/connect+json"})
        assert r.status_code == 200 and b"invalid_argument" in r.content
        # an unknown sandbox is 502 (what is_running() reads)
        assert httpx.get(url + "/health", headers={**ok, "E2b-Sandbox-Id": "sb-000000000000"}).status_code == 502
    finally:
        for x in (a, b):
            httpx.delete(url + f"/sandboxes/{x['sandboxID']}", headers=key)


def test_signed_urls(sbx):
    import httpx

    sbx.files.write("/tmp/signed.txt", "signed content")
    url = sbx.download_url("/tmp/signed.txt")
    assert "signature=" in url
    assert httpx.get(url).text == "signed content"  # no headers: the signature finds the sandbox
    up = sbx.upload_url("/tmp/up.txt")
    assert httpx.post(up, files={"file": ("/tmp/up.txt", b"uploaded")}).status_code == 200
    assert sbx.files.read("/tmp/up.txt") == "uploaded"
    tampered = url.replace("signed.txt", "up.txt")
    assert httpx.get(tampered).status_code == 401
    expired = sbx.download_url("/tmp/signed.txt", use_signature_expiration=-10)
    r = httpx.get(expired)
    assert r.status_code == 401 and "expired" in r.json()["message"]


def test_template_without_home(opts):
    """An image with no /home/user (nor bash): relative paths resolve in its workdir."""
    s = Sandbox.create("bare", timeout=30, **opts)
    try:
        info = s.files.write("rel.txt", "x")
        assert info.path == "/rel.txt"
    finally:
        s.kill()


def test_connect_never_shortens_and_metrics(opts):
    s = Sandbox.create("base", timeout=120, **opts)
    try:
        end = Sandbox.get_info(s.sandbox_id, **opts).end_at.timestamp()
        Sandbox.connect(s.sandbox_id, timeout=5, **opts)
        assert Sandbox.get_info(s.sandbox_id, **opts).end_at.timestamp() >= end - 1
        Sandbox.connect(s.sandbox_id, timeout=600, **opts)
        assert Sandbox.get_info(s.sandbox_id, **opts).end_at.timestamp() > time.time() + 500
        m = s.get_metrics()
        assert len(m) == 1 and m[0].mem_total > 0
    finally:
        s.kill()


def test_base_recipe_and_cli(root):
    """The shipped `base` recipe parses (building it needs debootstrap + apt: `shoal e2b templates --build`)."""
    import subprocess
    import sys

    from shoal.e2b.templates import BASE_RECIPE
    from shoal.envs.recipe import parse_recipe

    recipe = parse_recipe(BASE_RECIPE)
    assert recipe is not None
    out = subprocess.run([sys.executable, "-m", "shoal.cli", "e2b", "templates", "--recipe"], check=True,
                         capture_output=True, text=True).stdout
    assert "useradd" in out and "sudo" in out and "git" in out and "curl" in out and "python3" in out
    listed = subprocess.run([sys.executable, "-m", "shoal.cli", "e2b", "templates", "--template", "x=y:1"],
                            check=True, capture_output=True, text=True).stdout
    assert "base" in listed and "x" in listed


def test_restarted_front_finds_its_sandboxes(root, e2b_image):
    """The index is written through to SQLite: a new front on the same state serves the same sandboxes."""
    import os

    from .conftest import start_front

    env = {**os.environ, "SHOAL_URL": "local", "SHOAL_ROOT": str(root)}
    args = ("--template", f"base={e2b_image}")
    first = start_front(root, env, *args, name="restart")
    opts = {"api_url": first["url"], "sandbox_url": first["url"], "api_key": first["key"]}
    s = Sandbox.create("base", timeout=60, metadata={"who": "restart"}, **opts)
    gone = Sandbox.create("base", timeout=60, **opts)
    s.files.write("kept.txt", "still here")
    snap = s.create_snapshot(name="restart-snap")
    first["proc"].terminate()
    first["proc"].wait(20)
    from shoal import Host

    Host.get(root).kill(gone.sandbox_id)  # ended while no front ran: dropped from the index at start
    second = start_front(root, env, *args, name="restart", keys=(first["key"], first["other_key"]))
    try:
        opts2 = {**opts, "api_url": second["url"], "sandbox_url": second["url"]}
        again = Sandbox.connect(s.sandbox_id, **opts2)
        assert again.files.read("kept.txt") == "still here"
        assert again.commands.run("echo ok").stdout == "ok\n"
        listed = [x.sandbox_id for x in Sandbox.list(**opts2).next_items()]
        assert s.sandbox_id in listed and gone.sandbox_id not in listed
        # its snapshots too
        assert [x.snapshot_id for x in Sandbox.list_snapshots(**opts2).next_items()] == [snap.snapshot_id]
        restored = Sandbox.create(snap.snapshot_id, timeout=60, **opts2)
        assert restored.files.read("kept.txt") == "still here"
        restored.kill()
        assert Sandbox.delete_snapshot(snap.snapshot_id, **opts2) is True
        again.kill()
    finally:
        second["proc"].terminate()
        second["proc"].wait(20)


def test_watchers_left_behind_are_freed_with_their_sandbox(opts, e2b_server):
    """A client that never removes its watchers: killing the sandbox frees their inotify instances in the
    front (each one counts against the host's per-uid inotify limit)."""
    import asyncio
    import os

    def inotify_fds() -> int:
        pid, n = e2b_server["proc"].pid, 0
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                n += os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:inotify"
            except OSError:
                pass
        return n

    before = inotify_fds()
    s = Sandbox.create("base", timeout=60, **opts)
    for d in ("/tmp", "/home/user", "/"):
        s.files.watch_dir(d)
    assert inotify_fds() == before + 3

    async def stream_and_leave() -> None:  # a WatchDir stream whose client stops: freed at once
        from e2b import AsyncSandbox

        a = await AsyncSandbox.connect(s.sandbox_id, **opts)
        w = await a.files.watch_dir("/tmp", on_event=lambda e: None)
        assert inotify_fds() == before + 4
        await w.stop()
        for _ in range(100):
            if inotify_fds() == before + 3:
                break
            await asyncio.sleep(0.02)
        assert inotify_fds() == before + 3

    asyncio.run(stream_and_leave())
    assert s.kill() is True
    assert inotify_fds() == before
