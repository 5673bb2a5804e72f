"""OSWorld task JSON -> a Shoal desktop task, with one subgoal for OSWorld's final check.

OSWorld's task: {"id", "instruction", "snapshot", "related_apps", "config": [setup steps],
"evaluator": {"func", "result", "expected", "options", "conj", "postconfig"}}. Its evaluators are
Python getters and metrics run against a VM; they are not ported. The converted task keeps the
evaluator as the rubric of a single subgoal (for a judge), maps `launch` steps of known apps
onto Shoal's desktop apps, and says what it dropped."""
from __future__ import annotations

import json
from typing import Any

from ...core.errors import InvalidArgument
from .task import DesktopTask, load_task

# OSWorld program / related_apps names -> Shoal desktop apps (envs/desktop.py)
APP_NAMES = {"google-chrome": "browser", "chrome": "browser", "chromium": "browser", "gedit": "editor",
             "vs_code": "editor", "code": "editor", "libreoffice_calc": "spreadsheet", "calc": "spreadsheet",
             "nautilus": "files", "os": "files"}


def _app_of(command: list[str] | str) -> tuple[str | None, list[str]]:
    argv = command.split() if isinstance(command, str) else list(command)
    if not argv:
        return None, []
    prog = argv[0].rsplit("/", 1)[-1]
    if prog == "libreoffice" and "--calc" in argv:
        return "spreadsheet", [a for a in argv[1:] if a != "--calc"]
    # the app's own flags (debugging ports, profiles) are Shoal's launcher's business
    return APP_NAMES.get(prog), [a for a in argv[1:] if not a.startswith("-")]


def from_osworld(d: dict[str, Any]) -> tuple[DesktopTask, list[str]]:
    """(the task, what could not be carried over)."""
    if not isinstance(d, dict) or not isinstance(d.get("instruction"), str) or "evaluator" not in d:
        raise InvalidArgument("not an OSWorld task (needs instruction and evaluator)")
    dropped: list[str] = []
    apps = sorted({APP_NAMES[a] for a in d.get("related_apps", []) if a in APP_NAMES})
    dropped += [f"related app {a!r} (no Shoal app)" for a in d.get("related_apps", []) if a not in APP_NAMES]
    setup: list[dict] = []
    for step in d.get("config", []):
        kind, params = step.get("type"), step.get("parameters", {})
        if kind == "launch":
            app, args = _app_of(params.get("command", []))
            if app:
                setup.append({"type": "launch", "app": app, "args": args})
                if app not in apps:
                    apps.append(app)
                continue
        dropped.append(f"config step {kind!r}: {json.dumps(params)[:120]}")
    ev = d["evaluator"]
    funcs = ev.get("func")
    task = load_task({
        "id": f"osworld-{d.get('id', 'task')}", "instruction": d["instruction"], "category": "Diversity",
        "apps": apps, "setup": setup,
        "subgoals": [{"id": "final", "description": f"OSWorld's final check: {funcs}",
                      "rubric": "Judge whether the end state satisfies OSWorld's evaluator: "
                                + json.dumps(ev, sort_keys=True)}]})
    return task, dropped
