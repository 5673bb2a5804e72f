"""SWE tasks with executable rewards: SWE-bench-compatible instances generated from the real
workspaces by procedural bug injection, graded by SWE-bench's rules (docs/swe.md)."""
from .grading import Report, eval_script, filter_patch, grade, parse_log
from .suite import SUITE_PATH, ensure_task_image, evaluate, load_suite, task_sandbox, validate
from .task import BUG_TYPES, Labels, SWETask

__all__ = ["BUG_TYPES", "SUITE_PATH", "Labels", "Report", "SWETask", "ensure_task_image", "eval_script", "evaluate",
           "filter_patch", "grade", "load_suite", "parse_log", "task_sandbox", "validate"]
