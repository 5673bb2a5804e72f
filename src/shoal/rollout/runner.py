"""The trainer's side of a rollout: submit episodes, start workers, watch, collect, export.

`Rollout` holds no state of its own: everything is in the queue database, so a trainer that is
killed and restarted makes a new `Rollout` on the same database and finds its episodes done or
still running. Workers are separate processes (own session: a dying trainer does not take them
along); on Ray they are actors (`rollout.ray`).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from .queue import DONE, FAILED, PAUSED, QUEUED, RUNNING, log_beside, open_queue
from .task import Task


class Rollout:
    def __init__(self, db: str | os.PathLike, log: str | os.PathLike | None = None):
        """db: the queue, an SQLite file or a `postgresql://` URL; log: the trajectory log (default:
        next to an SQLite queue)."""
        self.db: str | os.PathLike = db
        self.queue = open_queue(db)
        self.log_path = log_beside(db, log)
        self.workers: list[subprocess.Popen] = []

    def submit(self, tasks: Sequence[Task], policy: dict, repeats: int = 1, prefix: str | None = None) -> list[str]:
        return self.queue.submit([t.id for t in tasks], policy, repeats=repeats,
                                 images={t.id: t.image for t in tasks}, prefix=prefix)

    def start_workers(self, n: int, *, url: str | None = None, root: str | os.PathLike | None = None,
                      suite: str | os.PathLike | None = None, concurrency: int = 2, extra: list[str] | None = None,
                      log_dir: str | os.PathLike | None = None) -> list[subprocess.Popen]:
        """n worker processes; their sandboxes go to shoald at `url` (default: $SHOAL_URL, else the
        host's socket), or in-process at `root` with url="local"."""
        for _ in range(n):
            cmd = [sys.executable, "-m", "shoal.rollout.worker", "--db", str(self.db), "--log", str(self.log_path),
                   "--concurrency", str(concurrency)]
            if url:
                cmd += ["--url", url]
            if root:
                cmd += ["--root", str(root)]
            if suite:
                cmd += ["--suite", str(suite)]
            cmd += extra or []
            out = open(Path(log_dir) / f"worker-{len(self.workers)}.log", "ab") if log_dir else subprocess.DEVNULL
            self.workers.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
        return self.workers

    def counts(self) -> dict:
        return self.queue.counts()

    def wait(self, *, progress: bool = True, timeout: float | None = None, poll_s: float = 0.5,
             title: str = "episodes") -> dict:
        """Until nothing is queued or running (paused and failed episodes do not block)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        bar = None
        if progress:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                           TextColumn("{task.fields[live]}"))
            bar.start()
            job = bar.add_task(title, total=None, live="")
        try:
            while True:
                c = self.counts()
                if bar is not None:
                    bar.update(job, total=c["total"], completed=c[DONE] + c[FAILED] + c[PAUSED],
                               live=f"running {c[RUNNING]}  done {c[DONE]}  failed {c[FAILED]}  paused {c[PAUSED]}  "
                                    f"reward {c['reward']:.0f}")
                if c[QUEUED] + c[RUNNING] == 0:
                    return c
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"rollout not finished after {timeout} s: {c}")
                if self.workers and all(w.poll() is not None for w in self.workers):
                    raise RuntimeError(f"all {len(self.workers)} workers exited with episodes left: {c}")
                time.sleep(poll_s)
        finally:
            if bar is not None:
                bar.stop()

    def records(self) -> list[dict]:
        return self.queue.records(DONE)

    def stop_workers(self) -> None:
        for w in self.workers:
            if w.poll() is None:
                w.terminate()
        for w in self.workers:
            try:
                w.wait(timeout=10)
            except subprocess.TimeoutExpired:
                w.kill()


# ------------------------------------------------------------------------------------------ output
_SCALARS = ("episode_id", "instance_id", "repo", "policy", "reward", "resolved", "steps", "submitted", "sandbox",
            "node", "restored_ops", "unknown_ops", "patch")
_JSON = ("labels", "report", "messages", "actions", "turns", "timings", "layers", "replayed", "executed", "extra")


def write_jsonl(records: list[dict], path: str | os.PathLike) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "w") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return p


def write_parquet(records: list[dict], path: str | os.PathLike) -> Path:
    """One row per episode: scalars as columns, token ids / logprobs as list columns, the nested rest
    (messages, actions, report...) as JSON strings."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:  # an extra: the SDK, CLI and daemon do not need it
        raise ImportError("Parquet export needs pyarrow: pip install 'shoal[rollout]'") from e

    cols: dict[str, list] = {k: [r.get(k) for r in records] for k in _SCALARS}
    for k in _JSON:
        cols[k] = [json.dumps(r.get(k), ensure_ascii=False) for r in records]
    cols["wall_s"] = [r.get("timings", {}).get("wall_s") for r in records]
    cols["bug_type"] = [r.get("labels", {}).get("bug_type") for r in records]
    cols["response_token_ids"] = [[t.get("token_ids") or [] for t in r.get("turns", [])] for r in records]
    cols["response_logprobs"] = [[[x if x is not None else float("nan") for x in (t.get("logprobs") or [])]
                                  for t in r.get("turns", [])] for r in records]
    table = pa.table({**cols,
                      "response_token_ids": pa.array(cols["response_token_ids"], pa.list_(pa.list_(pa.int64()))),
                      "response_logprobs": pa.array(cols["response_logprobs"], pa.list_(pa.list_(pa.float64())))})
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, p)
    return p


def resolve_table(records: list[dict]) -> list[dict]:
    """Per policy: episodes, resolved, resolve rate, partial (some F2P fixed, P2P intact), mean steps."""
    rows: dict[str, dict] = {}
    for r in records:
        row = rows.setdefault(r["policy"], {"policy": r["policy"], "episodes": 0, "resolved": 0, "partial": 0,
                                            "steps": 0, "wall_s": 0.0})
        row["episodes"] += 1
        row["resolved"] += bool(r["resolved"])
        row["partial"] += r["report"].get("status") == "RESOLVED_PARTIAL"
        row["steps"] += r["steps"]
        row["wall_s"] += r["timings"]["wall_s"]
    for row in rows.values():
        n = row["episodes"]
        row["resolve_rate"] = row["resolved"] / n
        row["mean_steps"] = row.pop("steps") / n
        row["mean_episode_s"] = row.pop("wall_s") / n
    return list(rows.values())
