"""Only the daemon is root: members of the `shoal` group reach shoald's socket as tenants mapped from
their uid (SO_PEERCRED), never as the admin, and never into another user's sandboxes; users outside
the group cannot connect at all.

Real users (useradd, removed afterwards) run the HTTP backend in their own processes (setpriv), so
the daemon sees their real credentials on the socket."""
from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import site
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from daemonctl import start_daemon

import shoal

# Runs as the test user: one step of the scenario, its outcome as JSON on stdout.
CLIENT = r"""
import json, socket, sys
import httpx
from shoal.backends.http import HttpBackend
from shoal.core.contract import CreateRequest, ExecRequest
from shoal.core.errors import ShoalError

step, url, arg = sys.argv[1], sys.argv[2], sys.argv[3]
path = url[len("unix://"):]
out = {}

def attempt(name, fn):
    try:
        out[name] = ["ok", fn()]
    except ShoalError as e:
        out[name] = [type(e).__name__, str(e)]

if step == "connect":
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        out["connect"] = "connected"
    except OSError as e:
        out["connect"] = type(e).__name__
else:
    be = HttpBackend(url, "")  # no key: the daemon goes by this process's uid
    raw = httpx.Client(transport=httpx.HTTPTransport(uds=path), base_url="http://shoald")
    if step == "create":
        info = be.create(CreateRequest(image=arg, memory_mb=64))
        out["id"] = info.id
        out["echo"] = be.exec(info.id, ExecRequest(argv=["echo", "mine"])).stdout
        out["listed"] = info.id in [i.id for i in be.list()]
    elif step == "intrude":
        attempt("info", lambda: be.info(arg).id)
        attempt("exec", lambda: be.exec(arg, ExecRequest(argv=["echo", "pwned"])).stdout)
        attempt("read", lambda: be.read_file(arg, "/etc/hostname").decode())
        attempt("kill", lambda: be.kill(arg))
        out["listed"] = arg in [i.id for i in be.list()]
        out["status"] = {f"{m} {p}": raw.request(m, p).status_code for m, p in (
            ("GET", f"/v1/sandboxes/{arg}"), ("DELETE", f"/v1/sandboxes/{arg}"), ("GET", "/v1/tenants"),
            ("DELETE", "/v1/tenants/x"), ("GET", "/v1/layers"))}
        attempt("tenants", lambda: be.json("GET", "/tenants"))
        attempt("host_network", lambda: be.create(CreateRequest(image="none", network="host")).id)
    elif step == "sdk":  # the README's quick start, as a normal user: the SDK's default is the daemon
        from shoal import Sandbox
        with Sandbox.create(arg) as sb:
            out["echo"] = sb.commands.run("echo from-sdk; id -u").stdout
            out["backend"] = type(sb.backend).__name__
    elif step == "kill":
        be.kill(arg)
        attempt("after", lambda: be.info(arg).id)
print(json.dumps(out))
"""


def _setpriv(user: str) -> list[str]:
    pw = pwd.getpwnam(user)
    return ["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--init-groups"]


def _python_for(user: str, env: dict) -> str:
    """An interpreter `user` can run (a venv under /root is not), of this Python's version."""
    name = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    candidates = [os.path.realpath(sys.executable), shutil.which(name, path="/usr/local/bin:/usr/bin:/bin")]
    for exe in filter(None, candidates):
        r = subprocess.run([*_setpriv(user), exe, "-c",
                            "import httpx, pydantic, shoal.backends.http"], env=env, capture_output=True)
        if r.returncode == 0:
            return exe
    pytest.fail(f"no Python interpreter that {user} may run finds httpx, pydantic and shoal; tried {candidates}")


class Users:
    def __init__(self):
        self.made: list[str] = []

    def add(self, name: str, groups: list[str]) -> str:
        subprocess.run(["userdel", name], capture_output=True)  # a leftover of an interrupted run
        cmd = ["useradd", "--no-create-home", "--no-user-group", "--shell", "/usr/sbin/nologin"]
        if groups:
            cmd += ["--groups", ",".join(groups)]
        subprocess.run(cmd + [name], check=True, capture_output=True)
        self.made.append(name)
        return name

    def remove_all(self) -> None:
        for name in self.made:
            subprocess.run(["userdel", name], capture_output=True)


@pytest.fixture(scope="module")
def peers(root, base_image):
    users = Users()
    run_dir = Path(tempfile.mkdtemp(prefix="shoal-peers-", dir="/tmp"))
    os.chmod(run_dir, 0o755)  # like /run: anyone may look in; the daemon's own directory is 0750 root:shoal
    sock = run_dir / "shoal" / "shoald.sock"
    proc = start_daemon(root, sock=sock)
    try:
        suffix = str(os.getpid() % 100000)
        a = users.add(f"shoalt-a{suffix}", ["shoal"])
        b = users.add(f"shoalt-b{suffix}", ["shoal"])
        c = users.add(f"shoalt-c{suffix}", [])
        # the users import this checkout's shoal and this environment's packages
        paths = [str(Path(shoal.__file__).resolve().parents[1])] + site.getsitepackages()
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": os.pathsep.join(paths), "HOME": "/tmp", "LANG": "C.UTF-8",
               "SHOAL_URL": f"unix://{sock}"}  # where the host daemon's /run/shoal/shoald.sock would be
        python = _python_for(a, env)

        def as_user(user: str, step: str, arg: str = "") -> dict:
            r = subprocess.run([*_setpriv(user), python, "-c", CLIENT,
                                step, f"unix://{sock}", arg], env=env, capture_output=True, text=True, timeout=120,
                               cwd="/tmp")
            assert r.returncode == 0, f"{step} as {user}: {r.stderr[-3000:]}"
            return json.loads(r.stdout.strip().splitlines()[-1])

        def run_as(user: str, argv: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
            return subprocess.run([*_setpriv(user), python, *argv], env=env, capture_output=True, text=True,
                                  timeout=timeout, cwd="/tmp")

        yield {"a": a, "b": b, "c": c, "as_user": as_user, "run_as": run_as, "sock": sock, "image": base_image}
    finally:
        proc.terminate()
        proc.wait(20)
        users.remove_all()
        shutil.rmtree(run_dir, ignore_errors=True)


def test_socket_is_root_shoal_0660_in_a_0750_directory(peers):
    gid = grp.getgrnam("shoal").gr_gid
    for path, mode in ((peers["sock"].parent, 0o750), (peers["sock"], 0o660)):
        st = os.stat(path)
        assert (oct(st.st_mode & 0o7777), st.st_uid, st.st_gid) == (oct(mode), 0, gid), path


def test_group_member_is_a_tenant_that_cannot_reach_another_users_sandbox(peers, root):
    as_user = peers["as_user"]
    mine = as_user(peers["a"], "create", peers["image"])
    sid = mine["id"]
    assert mine["echo"] == "mine\n" and mine["listed"]
    from shoal.server.state import DaemonState

    uid_a = pwd.getpwnam(peers["a"]).pw_uid
    state = DaemonState(root / "shoald.db")
    assert state.owner("sandbox", sid) == f"uid-{uid_a}"  # a tenant mapped from A's uid, not the admin

    other = as_user(peers["b"], "intrude", sid)
    for op in ("info", "exec", "read", "kill"):
        assert other[op][0] == "SandboxNotFound", (op, other[op])  # 404: not even its existence
    assert not other["listed"]
    assert other["status"] == {f"GET /v1/sandboxes/{sid}": 404, f"DELETE /v1/sandboxes/{sid}": 404,
                               "GET /v1/tenants": 401, "DELETE /v1/tenants/x": 401, "GET /v1/layers": 200}
    assert other["tenants"][0] == "Unauthorized"
    assert other["host_network"][0] == "Unauthorized"

    done = as_user(peers["a"], "kill", sid)  # A's sandbox survived B's attempts, and A may end it
    assert done["after"][0] == "SandboxNotFound"


def test_group_member_runs_the_sdk_without_root(peers):
    got = peers["as_user"](peers["b"], "sdk", peers["image"])
    assert got["backend"] == "HttpBackend"
    assert got["echo"].splitlines()[0] == "from-sdk"


def test_user_outside_the_group_cannot_connect(peers):
    assert peers["as_user"](peers["c"], "connect")["connect"] == "PermissionError"
    assert peers["as_user"](peers["a"], "connect")["connect"] == "connected"


def test_group_member_runs_rollout_workers_without_root(peers, host, few_tasks):
    """The operator prepares the task images once (root); a rollout worker then runs as a normal user,
    every sandbox (the agent's and the grader's) through shoald, and grades as it would in-process."""
    from shoal.rollout.runner import Rollout
    from shoal.tasks.swe.suite import save_suite

    task = few_tasks[0]
    task.prepare(host)
    user = peers["b"]
    pw = pwd.getpwnam(user)
    work = Path(tempfile.mkdtemp(prefix="shoal-rollout-", dir="/tmp"))
    try:
        suite = save_suite([task], work / "suite.jsonl")
        ro = Rollout(work / "rollout.db")
        oracle = ro.submit([task], {"kind": "oracle"}, prefix="oracle")
        null = ro.submit([task], {"kind": "null"}, prefix="null")
        for p in [work, *work.iterdir()]:  # the user's run directory, as a trainer's would be
            os.chown(p, pw.pw_uid, pw.pw_gid)
        r = peers["run_as"](user, ["-m", "shoal.rollout.worker", "--db", str(ro.db), "--suite", str(suite),
                                   "--url", f"unix://{peers['sock']}", "--concurrency", "2"])
        assert r.returncode == 0, r.stderr[-3000:]
        recs = {x["episode_id"]: x for x in ro.records()}
        assert ro.counts()["done"] == 2 and ro.counts()["failed"] == 0, (ro.counts(), r.stderr[-3000:])
        assert recs[oracle[0]]["resolved"] and recs[oracle[0]]["reward"] == 1.0
        assert not recs[null[0]]["resolved"] and recs[null[0]]["reward"] == 0.0
        assert recs[oracle[0]]["report"]["f2p_passed"]  # graded by the trusted runner, through the daemon
    finally:
        shutil.rmtree(work, ignore_errors=True)
