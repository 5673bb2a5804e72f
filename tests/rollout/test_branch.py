"""Branching an episode from any step (rollout.branch): the branch's sandbox must hold exactly the
state the original sandbox had after that step, for every step, whichever way it is restored.

The ground truth is the original sandbox itself: the test's tools take a tree digest of it after
every live step (paths, types, modes, sizes, contents), through an unlogged exec. The episodes mix
appends, a counter, deletions, renames, and random output (seen in a command's output, or not).
"""
from __future__ import annotations

import asyncio
import json

import pytest

from shoal.core.errors import BadBranchStep, BranchNotExact, EpisodeNotFound, InvalidArgument
from shoal.envs.sandboxes import open_sandbox
from shoal.rollout.branch import Episode
from shoal.rollout.episode import run_episode
from shoal.rollout.policy import ScriptPolicy
from shoal.rollout.task import Verdict
from shoal.rollout.tools import Observation
from shoal.sdk.sandbox import Sandbox
from shoal.trajlog import LoggedSandbox, TrajectoryLog, replay

pytestmark = pytest.mark.slow

# the whole file system of the sandbox (one mount: /proc, /dev, /sys are others): paths, types, modes,
# owners, sizes and contents, less what every new sandbox gets anew (its hostname files)
_SKIP = "! -path ./etc/hostname ! -path ./etc/hosts ! -path ./etc/machine-id"
DIGEST = (f"cd / && {{ find . -xdev ! -type d {_SKIP} -exec stat -c '%n %F %a %u %g %s' {{}} +; "
          f"find . -xdev -type d -exec stat -c '%n %F %a %u %g' {{}} +; }} | sort | sha256sum; "
          f"find . -xdev -type f {_SKIP} -exec sha256sum {{}} + | sort | sha256sum")  # a directory's size is the FS's

# non-idempotent steps: appends, a counter, deletions, renames; RAND_SEEN prints its random bytes
# (a fast-forward notices that it cannot reproduce them); RAND_UNSEEN keeps them to itself
COUNT = "n=$(cat /work/count 2>/dev/null || echo 0); echo $((n + 1)) > /work/count"
RAND_SEEN = "head -c 12 /dev/urandom | od -An -tx1 | tee /work/rand"
RAND_UNSEEN = "head -c 16 /dev/urandom > /work/secret; echo -n x >> /work/log"
DETERMINISTIC = [
    ["shell", {"command": "mkdir -p /work/d && echo one >> /work/log"}],
    ["shell", {"command": COUNT}],
    ["shell", {"command": "echo two >> /work/log; " + COUNT}],
    ["create_file", {"path": "/work/d/a.txt", "content": "alpha\n"}],
    ["shell", {"command": "mv /work/d/a.txt /work/d/b.txt && echo three >> /work/log"}],
    ["shell", {"command": COUNT + "; rm -f /etc/motd /bin/yes"}],
    ["shell", {"command": "rm -rf /work/d; " + COUNT}],
    ["shell", {"command": "cat /work/log /work/count"}],  # reads only
]
RANDOM = [
    ["shell", {"command": "echo a >> /work/log"}],
    ["shell", {"command": COUNT}],
    ["shell", {"command": RAND_UNSEEN}],
    ["create_file", {"path": "/tmp/x/y.txt", "content": "y\n"}],
    ["shell", {"command": RAND_SEEN}],
    ["shell", {"command": "rm /tmp/x/y.txt; " + COUNT}],
    ["read", {"path": "/work/log"}],  # changes nothing: keeps the previous step's snapshot
]


class ShellTools:
    specs: list[dict] = []

    def __init__(self, sb: LoggedSandbox, truth: dict[int, str]):
        self.sb, self.truth = sb, truth

    def run(self, name: str, arguments: str | dict) -> Observation:
        args = json.loads(arguments) if isinstance(arguments, str) else arguments
        live = not self.sb.stream.replaying
        if name == "submit":
            return Observation("submitted", submitted=True)
        if name == "shell":
            r = self.sb.exec(["sh", "-c", args["command"]], cwd="/")
            obs = Observation(r.stdout + r.stderr + f"[exit {r.exit_code}]", error=r.exit_code != 0)
        elif name == "create_file":
            self.sb.exec(["mkdir", "-p", args["path"].rsplit("/", 1)[0]])
            self.sb.write(args["path"], args["content"])
            obs = Observation("ok")
        elif name == "read":
            obs = Observation(self.sb.read(args["path"]))
        else:
            return Observation(f"unknown tool {name}", error=True)
        if live:  # the original sandbox's state after this step (one tool call per step)
            self.truth[len(self.truth) + 1] = digest(self.sb.sandbox)
        return obs


class ShellTask:
    """A task on the busybox test image whose tools are a shell and a file writer."""

    def __init__(self, image: str, truth: dict[int, str]):
        self._image, self.truth = image, truth

    id = "shell-task"

    @property
    def image(self) -> str:
        return self._image

    def describe(self) -> dict:
        return {}

    def prepare(self, host, source=None) -> None:
        pass

    def sandbox(self, backend, **create) -> Sandbox:
        return open_sandbox(backend, self._image, memory_mb=128, disk_mb=64, **create)

    def prompt(self) -> list[dict]:
        return [{"role": "user", "content": "do the steps"}]

    def tools(self, sandbox: LoggedSandbox) -> ShellTools:
        return ShellTools(sandbox, self.truth)

    def answer(self, tools) -> str:
        return ""

    def grade(self, backend, answer: str) -> Verdict:
        return Verdict(reward=0.0, resolved=False)


def digest(sb: Sandbox) -> str:
    r = sb.commands.run(["sh", "-c", DIGEST], timeout=60)
    assert r.exit_code == 0, r.stderr
    return r.stdout


def _run(task, actions, log, host, eid, **kw):
    return asyncio.run(run_episode(task, ScriptPolicy(actions), log, host, eid, **kw))


@pytest.fixture
def log(tmp_path):
    return TrajectoryLog(tmp_path / "traj.db")


def _check(ep: Episode, k: int, want: str, strategy: str, used: str, **kw) -> Episode:
    b = ep.branch(step=k, strategy=strategy, **kw)
    try:
        assert b.info is not None and b.info.strategy == used and b.info.step == k
        assert len(b) == k and b.parent == (ep.id, k)
        assert digest(b.sandbox()) == want, f"step {k} via {used}"
    finally:
        b.kill()
    return b


def test_every_step_of_an_episode_with_random_output_branches_exactly(host, base_image, log):
    truth: dict[int, str] = {}
    task = ShellTask(base_image, truth)
    rec = _run(task, RANDOM, log, host, "rnd", snapshot_every=1)
    ep = Episode(log, "rnd", host)
    n = len(RANDOM)
    assert rec.steps == n + 1 and len(ep) == n + 1 and len(truth) == n
    truth[n + 1] = truth[n]  # the submit step changes nothing
    marks = ep.marks()
    assert all(m.snapshot for m in marks)
    assert len(set(truth.values())) == n - 1  # every step changed the file system but the last read
    # a step that ran no exec or write keeps the snapshot before it: same state, no new snapshot taken
    assert len({m.snapshot for m in marks}) == n - 1 and marks[n - 1].snapshot == marks[n - 2].snapshot
    for k in range(1, n + 2):
        b = _check(ep, k, truth[k], "auto", "snapshot")
        # the branch's log is the prefix: its sandbox stream is the parent's up to step k
        parent = [e.req_hash for e in log.history("rnd/sandbox")][:ep.marks()[k - 1].sandbox_seq]
        assert [e.req_hash for e in log.history(f"{b.id}/sandbox")] == parent
        assert len(log.history(f"{b.id}/llm")) == k and log.info(f"{b.id}/eval") is None
    # fast-forward from the start: exact before the unseen random step. From the step that printed
    # random bytes on, it cannot reproduce them and says so instead of returning another state
    for k in (1, 2):
        _check(ep, k, truth[k], "fastforward", "fastforward", from_step=0)
    _check(ep, 6, truth[6], "fastforward", "fastforward", from_step=5)
    with pytest.raises(BranchNotExact, match="not reproducible"):
        ep.branch(step=5, strategy="fastforward", from_step=4)
    assert [c.episode for c in ep.tree().children] and all(
        c.step is not None for c in ep.tree().children)


def test_every_step_of_a_deterministic_episode_by_both_strategies(host, base_image, log):
    truth: dict[int, str] = {}
    task = ShellTask(base_image, truth)
    _run(task, DETERMINISTIC, log, host, "det", snapshot_every=3)
    ep = Episode(log, "det", host)
    n = len(DETERMINISTIC)
    truth[n + 1] = truth[n]
    assert [m.snapshot is not None for m in ep.marks()] == [k % 3 == 0 for k in range(1, n + 2)]
    for k in range(1, n + 2):
        b = _check(ep, k, truth[k], "auto", "snapshot" if k % 3 == 0 else "fastforward")
        assert b.info.from_step == k - k % 3  # the nearest snapshot at or before k (0: the start)
        assert b.info.replayed_ops > 0 or k % 3 == 0 or k == 9  # steps 8, 9 change nothing (a read, submit)
        _check(ep, k, truth[k], "fastforward", "fastforward", from_step=0)
    # a fresh replay of a branch's log (a new sandbox from the start layers, every logged op run again)
    # ends in the same state as the branch itself
    for k in (4, 7):
        b = ep.branch(step=k)
        rep, fresh = replay(log, f"{b.id}/sandbox", url="local", root=host.settings.root, keep=True)
        try:
            assert rep.identical and digest(fresh) == digest(b.sandbox()) == truth[k]
        finally:
            fresh.kill()
            b.kill()
    with pytest.raises(BranchNotExact, match="no snapshot after step 2"):
        ep.branch(step=2, strategy="snapshot")


def test_branch_of_a_branch_and_the_tree(host, base_image, log):
    truth: dict[int, str] = {}
    task = ShellTask(base_image, truth)
    _run(task, DETERMINISTIC[:5], log, host, "root", snapshot_every=1)
    root = Episode(log, "root", host)
    b = root.branch(step=3, episode_id="root.alt")
    # the branch goes on live with other actions after its 3 logged steps
    truth2: dict[int, str] = {}
    alt = DETERMINISTIC[:3] + [["shell", {"command": "echo alt >> /work/log; " + COUNT}],
                               ["shell", {"command": RAND_SEEN}]]
    rec = asyncio.run(b.run(ShellTask(base_image, truth2), ScriptPolicy(alt), snapshot_every=1))
    assert rec.replayed["llm"] == 3 and rec.executed["llm"] == 3 and rec.replayed["sandbox"] == 3
    assert sorted(truth2) == [1, 2]  # only the two live steps ran (steps 4 and 5 of the branch)
    assert len(b) == 6
    bb = _check(b, 5, truth2[2], "auto", "snapshot")  # a step the branch ran itself
    bc = _check(b, 2, truth[2], "auto", "snapshot")  # a step of the shared prefix
    assert bb.parent == ("root.alt", 5) and bb.root().id == "root"
    t = root.tree()
    assert (t.episode, t.steps, t.step) == ("root", 6, None)
    assert [(c.episode, c.step, c.steps) for c in t.children] == [("root.alt", 3, 6)]
    assert sorted((c.episode, c.step) for c in t.children[0].children) == sorted([(bb.id, 5), (bc.id, 2)])
    assert Episode(log, bb.id).tree().step == 5
    # `shoal traj tree` prints the whole tree from any episode in it
    import os
    import subprocess
    import sys

    log.store.flush()
    out = subprocess.run([sys.executable, "-m", "shoal.cli", "traj", "tree", str(log.store.path), bb.id],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("root ") and "6 steps" in lines[0]
    assert any("root.alt from step 3" in ln for ln in lines)
    assert any(f"{bb.id} from step 5" in ln and "<-" in ln for ln in lines)


def test_branches_on_a_postgresql_log(host, base_image, pg_dsn):
    """The same on the log a fleet's workers share: prefixes copied and parent links set in PostgreSQL."""
    log = TrajectoryLog(pg_dsn)
    truth: dict[int, str] = {}
    _run(ShellTask(base_image, truth), DETERMINISTIC[:5], log, host, "pg", snapshot_every=2)
    ep = Episode(log, "pg", host)
    truth[6] = truth[5]
    for k in range(1, 7):
        b = _check(ep, k, truth[k], "auto", "snapshot" if k % 2 == 0 else "fastforward")
        assert log.info(f"{b.id}/sandbox").parent == "pg/sandbox"
    assert sorted(c.step for c in ep.tree().children) == [1, 2, 3, 4, 5, 6]


def test_bad_branch_points_are_typed_errors(host, base_image, log):
    truth: dict[int, str] = {}
    _run(ShellTask(base_image, truth), DETERMINISTIC[:2], log, host, "bad", snapshot_every=1)
    ep = Episode(log, "bad", host)
    assert len(ep) == 3
    for k in (0, -1, 4, 100):
        with pytest.raises(BadBranchStep, match=r"steps 1\.\.3"):
            ep.branch(step=k)
    for k in ("2", 2.0, True, None):
        with pytest.raises(BadBranchStep, match="whole number"):
            ep.branch(step=k)  # type: ignore[arg-type]  # wrong on purpose
    assert isinstance(BadBranchStep("x"), InvalidArgument)
    with pytest.raises(InvalidArgument, match="strategy"):
        ep.branch(step=1, strategy="copy")
    with pytest.raises(EpisodeNotFound):
        Episode(log, "nope", host).branch(step=1)
    with pytest.raises(InvalidArgument, match="exists already"):
        ep.branch(step=1, episode_id="bad")
    assert log.store.children("bad/steps") == []  # nothing was left behind by the refusals
    for every in (0, -2, 1.5, True):
        with pytest.raises(InvalidArgument, match="snapshot_every"):
            _run(ShellTask(base_image, {}), [], log, host, "never", snapshot_every=every)
    assert not Episode(log, "never").exists()


# ------------------------------------------------------------------------------------------ through shoald
@pytest.fixture(scope="module")
def episode_daemon(root, base_image, tmp_path_factory):
    """A shoald whose trajectory log is the one the test's workers write (SHOAL_TRAJLOG), and two tenants."""
    from daemonctl import make_tenants, start_daemon

    path = tmp_path_factory.mktemp("eplog") / "traj.db"
    sock = root / "episodes.sock"
    proc = start_daemon(root, "--socket", str(sock), env={"SHOAL_TRAJLOG": str(path)})
    url = f"unix://{sock}"
    try:
        yield {"url": url, "log": path, "keys": make_tenants(url, names=("ep-a", "ep-b"))}
    finally:
        proc.terminate()
        proc.wait(20)


def test_branch_through_shoald_is_the_owners_only(episode_daemon, base_image):
    from shoal.backends.http import HttpBackend
    from shoal.core.contract import BranchRequest
    from shoal.core.errors import SandboxNotFound

    url, keys = episode_daemon["url"], episode_daemon["keys"]
    a, b = HttpBackend(url, keys["ep-a"]), HttpBackend(url, keys["ep-b"])
    log = TrajectoryLog(episode_daemon["log"])
    truth: dict[int, str] = {}
    task = ShellTask(base_image, truth)
    asyncio.run(run_episode(task, ScriptPolicy(RANDOM[:4]), log, a, "api-ep", snapshot_every=1))
    log.store.flush()  # the daemon reads the log from SQLite
    made = []
    try:
        # tenant b can neither branch a's episode (any way) nor see its tree: 404, as for sandboxes
        for req in (BranchRequest(step=2), BranchRequest(step=2, strategy="fastforward", from_step=0)):
            with pytest.raises(EpisodeNotFound):
                b.branch_episode("api-ep", req)
        with pytest.raises(EpisodeNotFound):
            b.episode_tree("api-ep")
        with pytest.raises(EpisodeNotFound):
            a.branch_episode("no-such-episode", BranchRequest(step=1))
        # a can, by either strategy; the sandbox is a's (b cannot see it) and holds the state after the step
        r = a.branch_episode("api-ep", BranchRequest(step=3))
        made.append(r.sandbox.id)
        assert (r.strategy, r.step, r.parent) == ("snapshot", 3, "api-ep")
        assert digest(Sandbox(a, r.sandbox)) == truth[3]
        with pytest.raises(SandboxNotFound):
            b.info(r.sandbox.id)
        with pytest.raises(EpisodeNotFound):  # nor the branch a made
            b.branch_episode(r.episode, BranchRequest(step=1))
        f = a.branch_episode("api-ep", BranchRequest(step=2, strategy="fastforward", from_step=0))
        made.append(f.sandbox.id)
        assert f.strategy == "fastforward" and f.replayed_ops > 0 and digest(Sandbox(a, f.sandbox)) == truth[2]
        for k in (0, -1, 6):
            with pytest.raises(BadBranchStep):
                a.branch_episode("api-ep", BranchRequest(step=k))
        assert {c["episode"] for c in a.episode_tree("api-ep")["children"]} == {r.episode, f.episode}
        # the client runs the branch on: its sandbox is reattached (through a's backend), not rebuilt
        truth2: dict[int, str] = {}
        rec = asyncio.run(Episode(log, r.episode, a).run(ShellTask(base_image, truth2),
                                                         ScriptPolicy(RANDOM[:3] + [["shell", {"command": COUNT}]])))
        assert rec.sandbox == r.sandbox.id and rec.replayed["llm"] == 3 and sorted(truth2) == [1]
    finally:
        for sid in made:
            try:
                a.kill(sid)
            except SandboxNotFound:
                pass
        a.close()
        b.close()



def test_a_forged_log_cannot_branch_into_another_tenants_image(episode_daemon, base_image):
    """The log is its clients' to write: a branch's start layers are checked like any create's, so a
    tenant who names another tenant's snapshot in its own episode's start gets ImageNotFound."""
    from shoal.backends.http import HttpBackend
    from shoal.core.contract import BranchRequest
    from shoal.core.errors import ImageNotFound, SandboxNotFound

    url, keys = episode_daemon["url"], episode_daemon["keys"]
    a, b = HttpBackend(url, keys["ep-a"]), HttpBackend(url, keys["ep-b"])
    log = TrajectoryLog(episode_daemon["log"])
    asyncio.run(run_episode(ShellTask(base_image, {}), ScriptPolicy(RANDOM[:2]), log, a, "victim-ep",
                            snapshot_every=1))
    asyncio.run(run_episode(ShellTask(base_image, {}), ScriptPolicy(RANDOM[:2]), log, b, "forger-ep",
                            snapshot_every=1))
    victims = Episode(log, "victim-ep").snapshots()
    assert victims
    log.store.update_stream("forger-ep/steps", meta={"start": {"layers": [f"snapshots/{victims[-1]}:latest"]}})
    log.store.flush()
    try:
        before = {s.id for s in b.list()}
        with pytest.raises(ImageNotFound):
            b.branch_episode("forger-ep", BranchRequest(step=1, strategy="fastforward", from_step=0))
        assert {s.id for s in b.list()} == before  # nothing was made from a's snapshot
    finally:
        for be in (a, b):
            for s in be.list():
                try:
                    be.kill(s.id)
                except SandboxNotFound:
                    pass
        a.close()
        b.close()


def test_a_forged_parent_cycle_or_malformed_mark_is_a_typed_error(host, base_image, log, tmp_path):
    import sqlite3

    _run(ShellTask(base_image, {}), RANDOM[:2], log, host, "cyc")
    ep = Episode(log, "cyc", host)
    b1 = ep.branch(1, strategy="snapshot" if ep.snapshots() else "fastforward")
    b1.kill()
    log.store.flush()
    # the root's steps stream made a child of its own branch: a loop in the tree
    with sqlite3.connect(tmp_path / "traj.db") as db:
        db.execute("UPDATE streams SET parent=?, parent_step=1 WHERE stream=?", (f"{b1.id}/steps", "cyc/steps"))
    tree = Episode(TrajectoryLog(tmp_path / "traj.db"), "cyc", host).tree()
    assert [c.episode for c in tree.children] == [b1.id] and tree.children[0].children == []
    # a mark without its step
    with sqlite3.connect(tmp_path / "traj.db") as db:
        db.execute("UPDATE entries SET request='{}' WHERE stream='cyc/steps'")
    with pytest.raises(InvalidArgument, match="malformed"):
        Episode(TrajectoryLog(tmp_path / "traj.db"), "cyc", host).marks()


def test_release_snapshots_spares_what_a_live_branch_or_sandbox_uses(host, base_image, log):
    """Releasing a done tree's snapshots removes their images and layers, but never one that a live
    sandbox's stack holds or that a live branch's steps reference; a released step still branches
    exactly (by fast-forward), and a second release after the live ones end removes the rest."""
    from shoal.envs.sandboxes import create_request

    truth: dict[int, str] = {}
    task = ShellTask(base_image, truth)
    _run(task, DETERMINISTIC[:5], log, host, "rel", snapshot_every=1)
    ep = Episode(log, "rel", host)
    snaps = [m.snapshot for m in ep.marks()]
    assert len(set(snaps)) == 5 and snaps[5] == snaps[4]  # the submit step kept step 5's
    tops = {i.ref: i.layers[-1] for i in host.images()}
    top = {s: tops[f"snapshots/{s}:latest"] for s in snaps}
    live_ff = ep.branch(step=1, strategy="fastforward", from_step=0, episode_id="rel.ff")  # references snap 1
    dead = ep.branch(step=2, episode_id="rel.dead")  # a branch that is done with
    dead.kill()
    # a sandbox outside the tree, made from step 4's snapshot: its layers hold that snapshot's top
    other = Sandbox(host, host.create(create_request(None, from_snapshot=snaps[3], ttl=600)))
    try:
        dry = dead.release_snapshots(dry_run=True)  # from any episode of the tree: the whole tree
        assert dry.root == "rel" and sorted(dry.episodes) == ["rel", "rel.dead", "rel.ff"]
        assert sorted(dry.removed) == sorted([snaps[1], snaps[2], snaps[4]])
        assert {s for s in dry.kept} == {snaps[0], snaps[3]} and "rel.ff" in dry.kept[snaps[0]]
        assert "live sandbox" in dry.kept[snaps[3]]
        assert {f"snapshots/{s}:latest" for s in snaps} <= {i.ref for i in host.images()}  # dry: nothing gone
        rel = ep.release_snapshots()
        assert sorted(rel.removed) == sorted(dry.removed) and sorted(rel.layers_removed) == sorted(
            top[s] for s in dry.removed)
        refs = {i.ref for i in host.images()}
        assert all(f"snapshots/{s}:latest" not in refs for s in rel.removed)
        assert f"snapshots/{snaps[0]}:latest" in refs and f"snapshots/{snaps[3]}:latest" in refs
        # the lower layer refuses too: the live sandbox's snapshot layer cannot be removed under it
        from shoal.core.errors import LayerInUse

        with pytest.raises(LayerInUse):
            host.remove_layer(top[snaps[3]])
        assert digest(other) == truth[4]  # and the sandbox made from it is untouched
        # a released step reads as having no snapshot: branching there fast-forwards, exactly
        assert ep.marks()[4].snapshot is None and Episode(log, "rel.dead").marks()[1].snapshot is None
        b5 = _check(ep, 5, truth[5], "auto", "fastforward")
        assert b5.info.from_step == 4  # from the nearest snapshot still there
        _check(ep, 4, truth[4], "auto", "snapshot")
    finally:
        other.kill()
        live_ff.kill()
    again = ep.release_snapshots()
    assert sorted(again.removed) == sorted([snaps[0], snaps[3]]) and not again.kept
    assert not [i.ref for i in host.images() if i.ref.split(":")[0] in {f"snapshots/{s}" for s in snaps}]
    _check(ep, 3, truth[3], "auto", "fastforward")  # from the start now: nothing left to restore from
    assert ep.release_snapshots().removed == []  # idempotent


def test_release_snapshots_through_shoald_is_the_owners_only(episode_daemon, base_image):
    """Through shoald a tenant sees and removes only its own snapshot images: another tenant's
    release of the same tree removes nothing and marks nothing released."""
    from shoal.backends.http import HttpBackend

    url, keys = episode_daemon["url"], episode_daemon["keys"]
    a, b = HttpBackend(url, keys["ep-a"]), HttpBackend(url, keys["ep-b"])
    log = TrajectoryLog(episode_daemon["log"])
    task = ShellTask(base_image, {})
    asyncio.run(run_episode(task, ScriptPolicy(RANDOM[:3]), log, a, "rel-api", snapshot_every=1))
    snaps = set(Episode(log, "rel-api", a).snapshots())
    refs = {f"snapshots/{s}:latest" for s in snaps}
    assert len(snaps) == 3 and refs <= {i.ref for i in a.images()}
    other = Episode(log, "rel-api", b).release_snapshots()
    assert other.removed == [] and sorted(other.missing) == sorted(snaps)  # not b's to see
    assert refs <= {i.ref for i in a.images()} and set(Episode(log, "rel-api", a).snapshots()) == snaps
    mine = Episode(log, "rel-api", a).release_snapshots()
    assert sorted(mine.removed) == sorted(snaps) and not refs & {i.ref for i in a.images()}
    assert Episode(log, "rel-api", a).snapshots() == []
