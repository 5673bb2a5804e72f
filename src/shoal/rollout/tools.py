"""The agent's tools, as OpenAI function-calling schemas, executed through a logged sandbox.

- `shell`: one bash command in the repo, each in a fresh process (mini-swe-agent's choice: `cd` and
  variables do not persist, which is also what makes a resumed episode exact);
- `view_file` / `edit_file` / `create_file`: file view with line numbers, exact string replace, create;
- `submit`: end the episode; the patch is the repo's diff.

Every call goes through the trajectory log, so a resumed episode gets logged results back.
"""
from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass

from ..core.errors import HostUnavailable, SandboxLost, ShoalError, UnknownOutcome
from ..trajlog import LoggedSandbox

OBS_MAX_CHARS = 8000  # longer observations are cut in the middle: agents drown in long logs
SHELL_TIMEOUT_S = 60.0

TOOLS: list[dict] = [
    {"type": "function", "function": {
        "name": "shell", "description": "Run one bash command in the repository (fresh shell each time).",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}},
    {"type": "function", "function": {
        "name": "view_file", "description": "Show a file with line numbers (optionally a line range).",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string"}, "start": {"type": "integer"}, "end": {"type": "integer"}},
            "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "edit_file", "description": "Replace one exact occurrence of old_str with new_str in a file.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string"}, "old_str": {"type": "string"}, "new_str": {"type": "string"}},
            "required": ["path", "old_str", "new_str"]}}},
    {"type": "function", "function": {
        "name": "create_file", "description": "Create or overwrite a file with the given content.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string"}, "content": {"type": "string"}}, "required": ["path", "content"]}}},
    {"type": "function", "function": {
        "name": "submit", "description": "Finish: your changes to the repository are the answer.",
        "parameters": {"type": "object", "properties": {}}}},
]
TOOL_NAMES = tuple(t["function"]["name"] for t in TOOLS)


@dataclass
class Observation:
    text: str
    submitted: bool = False
    error: bool = False
    unknown: bool = False  # the operation was in flight when a worker died; its outcome is unknown


def clip(text: str, limit: int = OBS_MAX_CHARS) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - limit} characters cut ...]\n{text[-half:]}"


def parse_arguments(arguments: str | dict) -> dict | Observation:
    """A tool call's arguments as a dict, or the error Observation the policy sees for bad JSON."""
    try:
        args = json.loads(arguments) if isinstance(arguments, str) else dict(arguments or {})
        if not isinstance(args, dict):
            raise ValueError("arguments must be a JSON object")
    except ValueError as e:
        return Observation(f"error: tool arguments are not valid JSON ({e})", error=True)
    return args


class ToolBox:
    """Coding tools on a repository (implements `rollout.task.Tools`)."""

    specs = TOOLS

    def __init__(self, sandbox: LoggedSandbox, repo_dir: str = "/work/repo"):
        self.sb, self.repo_dir = sandbox, repo_dir

    def _path(self, path: str) -> str:
        return path if path.startswith("/") else f"{self.repo_dir}/{path}"

    def run(self, name: str, arguments: str | dict) -> Observation:
        args = parse_arguments(arguments)
        if isinstance(args, Observation):
            return args
        fn = getattr(self, f"_{name}", None) if name in TOOL_NAMES else None
        if fn is None:
            return Observation(f"error: unknown tool {name!r}; tools: {', '.join(TOOL_NAMES)}", error=True)
        try:
            return fn(**args)
        except TypeError as e:
            return Observation(f"error: bad arguments for {name}: {e}", error=True)
        except UnknownOutcome as e:
            note = ("the worker running this call crashed, or the sandbox's host was lost, while it was in flight; "
                    "its outcome is unknown. "
                    "Check the state before repeating it.")
            self.sb.stream.settle({"note": note, "kind": e.request and name})
            return Observation(f"[shoal] {note}", unknown=True, error=True)
        except (SandboxLost, HostUnavailable):
            raise  # the sandbox is gone with its host (a fleet): the worker resumes the episode elsewhere
        except ShoalError as e:
            return Observation(f"error: {e}", error=True)

    def _shell(self, command: str) -> Observation:
        r = self.sb.exec(["bash", "-c", command], cwd=self.repo_dir, timeout=SHELL_TIMEOUT_S)
        text = r.stdout + (("\n" if r.stdout and not r.stdout.endswith("\n") else "") + r.stderr if r.stderr else "")
        tail = " (timed out)" if r.timed_out else ""
        return Observation(clip(f"{text}[exit code {r.exit_code}{tail}]"), error=r.exit_code != 0)

    def _view_file(self, path: str, start: int | None = None, end: int | None = None) -> Observation:
        lines = self.sb.read(self._path(path)).splitlines()
        a = max(1, start or 1)
        b = min(len(lines), end or len(lines))
        return Observation(clip("\n".join(f"{i:6d}\t{lines[i - 1]}" for i in range(a, b + 1))))

    def _edit_file(self, path: str, old_str: str, new_str: str) -> Observation:
        p = self._path(path)
        text = self.sb.read(p)
        n = text.count(old_str) if old_str else 0
        if n != 1:
            return Observation(f"error: old_str occurs {n} times in {path}; it must occur exactly once", error=True)
        self.sb.write(p, text.replace(old_str, new_str, 1))
        return Observation(f"edited {path}")

    def _create_file(self, path: str, content: str) -> Observation:
        self.sb.exec(["mkdir", "-p", posixpath.dirname(self._path(path)) or "/"])
        self.sb.write(self._path(path), content)
        return Observation(f"wrote {len(content)} characters to {path}")

    def _submit(self) -> Observation:
        return Observation("submitted", submitted=True)

    def diff(self) -> str:
        """The repo's changes as a patch (new files included), taken through the log."""
        r = self.sb.exec(["bash", "-c", "git add -A >/dev/null 2>&1; git diff --cached --no-color HEAD"],
                         cwd=self.repo_dir, timeout=SHELL_TIMEOUT_S, idempotent=True)
        return r.stdout
