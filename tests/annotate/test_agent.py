"""Annotating a Shoal episode at step k with the environment in the loop: the corrected tool call runs
in a branch of the episode (rollout.branch) in a real sandbox, the model continues after the real
output, and a second corrected call runs in a branch of that branch. Every operation is a node."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from shoal.annotate.agent import EpisodeEnv, pending_calls
from shoal.annotate.app import episode_items
from shoal.annotate.tree import AnnotationStore
from shoal.core.errors import InvalidArgument
from shoal.envs.sandboxes import open_sandbox
from shoal.rollout.branch import Episode
from shoal.rollout.episode import run_episode
from shoal.rollout.policy import ScriptPolicy
from shoal.rollout.task import Verdict
from shoal.rollout.tools import Observation
from shoal.trajlog import TrajectoryLog

from .conftest import AppServer
from .test_app import client, events

pytestmark = pytest.mark.slow


class ShellTools:
    specs: list[dict] = []

    def __init__(self, sb):
        self.sb = sb

    def run(self, name: str, arguments: str | dict) -> Observation:
        args = json.loads(arguments) if isinstance(arguments, str) else arguments
        if name == "submit":
            return Observation("submitted", submitted=True)
        if name == "shell":
            r = self.sb.exec(["sh", "-c", args["command"]], cwd="/")
            return Observation(r.stdout + r.stderr + f"[exit {r.exit_code}]", error=r.exit_code != 0)
        if name == "create_file":
            self.sb.exec(["mkdir", "-p", args["path"].rsplit("/", 1)[0]])
            self.sb.write(args["path"], args["content"])
            return Observation("ok")
        return Observation(f"unknown tool {name}", error=True)


class ShellTask:
    id = "shell-task"

    def __init__(self, image: str):
        self.image = image

    def describe(self) -> dict:
        return {}

    def prepare(self, host, source=None) -> None:
        pass

    def sandbox(self, backend, **create):
        return open_sandbox(backend, self.image, memory_mb=128, disk_mb=64, **create)

    def prompt(self) -> list[dict]:
        return [{"role": "user", "content": "Write the greeting, then show it."}]

    def tools(self, sandbox) -> ShellTools:
        return ShellTools(sandbox)

    def answer(self, tools) -> str:
        return ""

    def grade(self, backend, answer: str) -> Verdict:
        return Verdict(reward=0.0, resolved=False)


def call_text(command: str) -> str:
    """A shell call as render_turn writes it (the arguments are a JSON string inside the JSON)."""
    return "<tool_call>" + json.dumps({"name": "shell", "arguments": json.dumps({"command": command})}) + "</tool_call>"


def cut_at(tokens: list[dict], text: str, needle: str) -> tuple[int, str]:
    """The last token boundary at or before `needle` in the response, and the text from there to it."""
    at, pos, run = text.index(needle), 0, ""
    for i, t in enumerate(tokens):
        if len(run) + len(t["text"]) > at:
            break
        run += t["text"]
        pos = i + 1
    return pos, text[len(run):at]


def test_a_corrected_tool_call_runs_in_a_branch_and_the_model_continues_after_its_output(host, base_image,
                                                                                       bpe_long_model, tmp_path):
    log = TrajectoryLog(tmp_path / "traj.db")
    task = ShellTask(base_image)
    script = [["create_file", {"path": "/work/a.txt", "content": "hello from step 1\n"}],
              ["shell", {"command": "cat /work/a.txt"}]]
    rec = asyncio.run(run_episode(task, ScriptPolicy(script), log, host, "ep", max_steps=4)).to_dict()
    original = [(e.kind, e.request) for e in log.history("ep/sandbox")]
    store = AnnotationStore(tmp_path / "a.db")
    for it in episode_items(rec, "ep"):
        store.add_item(it["id"], it["prompt"], kind="episode", title=it["title"], response=it["response"],
                       meta=it["meta"])
    store.tokens = {"alice": store.add_annotator("alice")}  # type: ignore[attr-defined]
    store.assign("alice", store.items())
    env = EpisodeEnv(log, host, lambda item: task)
    server = AppServer(store, bpe_long_model, k=5, max_tokens=12, env=env)
    try:
        alice = client(server, "alice")
        # step 2 of the episode (item step1): `cat /work/a.txt`; the annotator changes the command
        assert alice.post("/api/tree/ep-step1/start", json={}).json() == {"version": 1, "node": 0}
        view = alice.get("/api/tree/ep-step1").json()
        assert "current" in view, view
        text = "".join(t["text"] for t in view["current"]["tokens"])
        assert text.endswith(call_text("cat /work/a.txt"))
        pos, lead = cut_at(view["current"]["tokens"], text, "cat /work/a.txt")
        fixed = call_text("ls /work && echo marker-$((6*7))")
        typed = lead + fixed[fixed.index("ls /work"):]
        evs = events(alice.post("/api/tree/ep-step1/correct", json={"parent": 0, "pos": pos, "text": typed,
                                                                    "version": 1}))
        assert evs[-1] == ("done", {"version": 3, "node": 1, "n": 0})  # a whole call: it waits to run
        stale = alice.post("/api/tree/ep-step1/execute", json={"node": 1, "version": 2})  # another wrote first
        assert stale.status_code == 409 and stale.json()["error"]["current_version"] == 3
        assert len(Episode(log, "ep").tree().children) == 0  # refused before any branch was made
        r = alice.post("/api/tree/ep-step1/execute", json={"node": 1, "version": 3})
        assert r.status_code == 200, r.text
        branch, node = r.headers["x-branch"], int(r.headers["x-node"])
        assert branch.startswith("ep.a2.") and r.headers["x-strategy"] == "fastforward"
        evs = events(r)
        out = "".join(d["text"] for e, d in evs if e == "token" and d.get("src") == "o")
        # the state after step 1 came back (a.txt exists), and the new command really ran there
        assert "a.txt" in out and "marker-42" in out and "[exit 0]" in out
        tree = store.tree("ep-step1")
        assert tree is not None
        n2 = tree.node(node)
        assert n2.op == "tool" and n2.parent == 1
        n_o, n_g = n2.sources.count("o"), n2.sources.count("g")
        assert n2.sources == tree.node(1).sources + "o" * n_o + "g" * n_g and n_o > 3
        assert evs[-1][0] == "done" and evs[-1][1]["n"] == n_g
        # the continuation is the model's own after the real output: the same model on the same prefix
        cut = len(n2.tokens) - n_g
        want = [t.id for t in bpe_long_model.stream(tree.prompt_ids + n2.tokens[:cut], 12, k=5)]
        assert n2.tokens[cut:] == want[:n_g] and n_g > 0
        op = next(o for o in tree.ops if o["op"] == "tool")
        assert op["data"]["episode"] == branch and op["data"]["parent"] == "ep" and op["data"]["step"] == 2
        # the page's tokens of a tool output cannot be corrected (the environment wrote them)
        v = tree.version
        bad = alice.post("/api/tree/ep-step1/correct", json={"parent": node, "pos": cut - 2, "token": 5, "version": v})
        assert bad.status_code == 400 and "tool's output" in bad.json()["error"]["message"]
        # a second step: a call written after the output runs in a branch of the branch (its snapshot)
        again = call_text("cat /work/a.txt; echo second")
        events(alice.post("/api/tree/ep-step1/correct", json={"parent": node, "pos": cut, "text": again,
                                                              "version": v}))
        tree = store.tree("ep-step1")
        assert tree is not None
        n3 = max(n.id for n in tree.nodes)
        r = alice.post("/api/tree/ep-step1/execute", json={"node": n3, "version": tree.version})
        assert r.status_code == 200, r.text
        assert r.headers["x-strategy"] == "snapshot" and r.headers["x-branch"].startswith(f"{branch}.a3.")
        out = "".join(d["text"] for e, d in events(r) if e == "token" and d.get("src") == "o")
        assert "hello from step 1" in out and "second" in out
        # a node that ends with no pending call has nothing to run
        tree = store.tree("ep-step1")
        assert tree is not None
        r = alice.post("/api/tree/ep-step1/execute", json={"node": node, "version": tree.version})
        assert r.status_code == 400 and "does not end with a tool call" in r.json()["error"]["message"]
        # the log: ep -> branch at step 1 -> its branch at step 2; the original episode is untouched
        t = Episode(log, "ep").tree().to_dict()
        assert t["children"][0]["episode"] == branch and t["children"][0]["step"] == 1
        assert t["children"][0]["children"][0]["step"] == 2
        assert [(e.kind, e.request) for e in log.history("ep/sandbox")] == original
        assert Episode(log, branch, host).sandbox() is None  # each branch's sandbox is gone after its step
        # the first step has no step before it: its call runs in a fresh sandbox of the task (the start)
        assert alice.post("/api/tree/ep-step0/start", json={}).json()["version"] == 1
        r = alice.post("/api/tree/ep-step0/execute", json={"node": 0, "version": 1})
        assert r.status_code == 200, r.text
        assert r.headers["x-strategy"] == "start" and r.headers["x-branch"].startswith("ep.a1.")
        assert "ok" in "".join(d["text"] for e, d in events(r) if e == "token" and d.get("src") == "o")
        labelled = alice.post("/api/tree/ep-step1/label", json={"node": node, "label": "good",
                                                                "version": tree.version})
        assert labelled.status_code == 200
        sft = [json.loads(x) for x in alice.get("/api/export/sft").text.splitlines()]
        roles = [m["role"] for m in sft[0]["messages"]]
        assert roles[-3:] == ["assistant", "tool", "assistant"] and "marker-42" in sft[0]["messages"][-2]["content"]
    finally:
        server.stop()
        store.close()


def test_pending_calls_are_parsed_or_refused_clearly():
    text = "ok\n" + call_text("ls") + "\n<tool_response>\nx\n</tool_response>\n" + call_text("pwd")
    assert pending_calls(text) == [("shell", json.dumps({"command": "pwd"}))]
    with pytest.raises(InvalidArgument, match="not JSON"):
        pending_calls("<tool_call>{oops</tool_call>")


def test_execute_without_an_environment_or_on_a_prompt_is_a_clear_error(app_server):
    alice = client(app_server, "alice")
    events(alice.post("/api/tree/q3/start", json={}))
    r = alice.post("/api/tree/q3/execute", json={"node": 0, "version": 2})
    assert r.status_code == 400 and "runs no environment" in r.json()["error"]["message"]
    assert httpx.post(f"{app_server.url}/api/tree/q3/execute", json={}).status_code == 401
