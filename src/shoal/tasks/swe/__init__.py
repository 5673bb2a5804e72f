"""SWE tasks with executable rewards: SWE-bench-compatible instances generated from the real
workspaces by procedural bug injection, graded by SWE-bench's rules (docs/swe.md)."""
from .grading import Report, eval_script, filter_patch, grade, grade_run, parse_log
from .screen import Flag, screen_patch
from .suite import (
           SUITE_PATH,
           ensure_task_image,
           evaluate,
           grader_sandbox,
           load_suite,
           task_sandbox,
           validate,
)
from .task import BUG_TYPES, Labels, SWETask

__all__ = ["BUG_TYPES", "SUITE_PATH", "Flag", "Labels", "Report", "SWETask", "ensure_task_image", "eval_script",
           "evaluate", "filter_patch", "grade", "grade_run", "grader_sandbox", "load_suite", "parse_log",
           "screen_patch", "task_sandbox", "validate"]
