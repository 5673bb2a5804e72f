"""Process-level desktop tasks (docs/desktop.md, "Process-level evaluation"): the task schema with
ordered, dependent subgoals and their checkers (task.py), agreement metrics and failure modes
(metrics.py), and a small bundled suite (suite.json) with an oracle per task."""
