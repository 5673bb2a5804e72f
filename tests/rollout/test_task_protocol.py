"""The rollout loop over the `Task` protocol: a non-SWE task (a one-file task on busybox) runs through
the same episode loop and Gymnasium adapter as the SWE tasks, and that adapter passes Gymnasium's own
`check_env`, malformed actions included."""
from __future__ import annotations

import asyncio
import json

from gymnasium.utils.env_checker import check_env

from shoal.core.errors import ShoalError
from shoal.envs.sandboxes import open_sandbox
from shoal.rollout.adapters import ShoalEnv, in_charset, parse_action
from shoal.rollout.episode import run_episode
from shoal.rollout.policy import NullPolicy, ScriptPolicy
from shoal.rollout.task import Task, Tools, Verdict
from shoal.rollout.tools import Observation
from shoal.tasks.swe import load_suite
from shoal.trajlog import TrajectoryLog


class ShellTools:
    """Two tools on a busybox sandbox (which has no bash): `sh` and `submit`."""

    specs = [{"type": "function", "function": {"name": "sh", "parameters": {
                 "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}},
             {"type": "function", "function": {"name": "submit", "parameters": {"type": "object", "properties": {}}}}]

    def __init__(self, sb):
        self.sb = sb

    def run(self, name: str, arguments: str | dict) -> Observation:
        args = json.loads(arguments) if isinstance(arguments, str) else dict(arguments)
        if name == "submit":
            return Observation("submitted", submitted=True)
        if name != "sh" or not isinstance(args.get("command"), str):
            return Observation(f"error: unknown tool or bad arguments: {name} {args}", error=True)
        r = self.sb.exec(["/bin/sh", "-c", args["command"]], timeout=10)
        return Observation(f"{r.stdout}{r.stderr}[exit code {r.exit_code}]", error=r.exit_code != 0)


class WordTask:
    """Write the word `shoal` to /answer.txt."""

    def __init__(self, image: str):
        self._image = image

    id = "word-1"

    @property
    def image(self) -> str:
        return self._image

    def describe(self) -> dict:
        return {"repo": "", "labels": {"kind": "word"}}

    def prepare(self, host, source=None) -> None:
        host.store.get_image(self._image)

    def sandbox(self, host, **create):
        return open_sandbox(host, self._image, memory_mb=128, disk_mb=32, **create)

    def prompt(self) -> list[dict]:
        return [{"role": "system", "content": "Use the tools."},
                {"role": "user", "content": "Write the word shoal to /answer.txt, then submit."}]

    def tools(self, sandbox) -> ShellTools:
        return ShellTools(sandbox)

    def answer(self, tools: ShellTools) -> str:
        try:
            return tools.sb.read("/answer.txt")
        except ShoalError:
            return ""

    def grade(self, host, answer: str) -> Verdict:
        ok = answer.strip() == "shoal"
        return Verdict(reward=1.0 if ok else 0.0, resolved=ok, report={"answer": answer})


def test_swe_tasks_and_a_new_kind_of_task_implement_the_protocol(base_image):
    assert isinstance(WordTask(base_image), Task)
    swe = load_suite()[0]
    assert isinstance(swe, Task) and swe.id == swe.instance_id
    assert swe.prompt()[-1] == {"role": "user", "content": swe.problem_statement}
    assert isinstance(ShellTools(None), Tools)


def test_parse_action_turns_anything_that_is_not_a_tool_call_into_a_message():
    names = ["sh", "submit"]
    assert parse_action('{"tool": "sh", "arguments": {"command": "ls"}}', names) == ("sh", {"command": "ls"})
    assert parse_action({"tool": "submit"}, names) == ("submit", {})
    for bad in ("not json", "", "[1, 2]", '{"arguments": {}}', '{"tool": 3}', b"\xff", None, 7):
        why = parse_action(bad, names)
        assert isinstance(why, str) and '"tool"' in why and "sh, submit" in why, bad
    assert "must be a JSON object" in parse_action({"tool": "sh", "arguments": [1]}, names)
    assert in_charset("ok\x1b[0m\U0001F600") == "ok\ufffd[0m\ufffd"


def test_episode_loop_runs_a_non_swe_task(host, base_image, tmp_path):
    task, log = WordTask(base_image), TrajectoryLog(tmp_path / "t.db")
    good = asyncio.run(run_episode(task, ScriptPolicy([["sh", {"command": "echo shoal > /answer.txt"}]]), log, host,
                                   "w-good"))
    assert (good.reward, good.resolved, good.submitted, good.instance_id) == (1.0, True, True, "word-1")
    assert [a["tool"] for a in good.actions] == ["sh", "submit"] and good.patch.strip() == "shoal"
    assert good.labels == {"kind": "word"}
    null = asyncio.run(run_episode(task, NullPolicy(), log, host, "w-null"))
    assert (null.reward, null.resolved) == (0.0, False)
    # the finished episode fast-forwards from the log: same verdict, nothing run again
    again = asyncio.run(run_episode(task, ScriptPolicy([["sh", {"command": "echo shoal > /answer.txt"}]]), log, host,
                                    "w-good"))
    assert again.reward == 1.0 and again.executed["eval"] == 0 and again.replayed["eval"] == 1


def test_gymnasium_check_env_passes(root, base_image, tmp_path):
    env = ShoalEnv([WordTask(base_image)], url="local", root=str(root), log_path=tmp_path / "g.db", max_steps=5)
    try:
        check_env(env, skip_render_check=True)
    finally:
        env.close()


def test_malformed_actions_are_observations_and_count_as_steps(root, base_image, tmp_path):
    env = ShoalEnv([WordTask(base_image)], url="local", root=str(root), log_path=tmp_path / "g.db", max_steps=3)
    try:
        obs, info = env.reset(seed=1)
        assert obs.startswith("Write the word") and info["tools"] == ShellTools.specs
        o, r, term, trunc, info = env.step("sh -c 'echo shoal'")  # what a policy emits when it forgets the JSON
        assert o.startswith("error: the action is not JSON") and '"tool"' in o and "sh, submit" in o
        assert (r, term, trunc, info["error"]) == (0.0, False, False, True)
        o, r, term, trunc, info = env.step({"tool": "sh", "arguments": {"command": "echo shoal > /answer.txt"}})
        assert "[exit code 0]" in o and not info["error"]
        o, r, term, trunc, info = env.step(env.action_space.sample())  # random text: the third step
        assert o.startswith("error:") and trunc and not term
        assert r == 1.0 and info["resolved"]  # truncation grades what is there
    finally:
        env.close()
