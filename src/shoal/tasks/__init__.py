"""Tasks: what an episode asks of an agent and how its work is graded (see `shoal.rollout.task.Task`).

  swe   SWE-style repair tasks: a repository with a bug, hidden tests, a trusted grader
"""
