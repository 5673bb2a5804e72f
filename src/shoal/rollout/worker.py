"""A rollout worker: claims episodes from the queue and runs them, `concurrency` at a time.

It is its own process (or a Ray actor, `rollout.distributed`) and needs nothing from the trainer:
the queue and the trajectory log are the shared state. Kill it with -9 at any moment: its leases run
out and another worker resumes its episodes through the log.

It is a client of shoald (the default; no root needed) and starts sandboxes from the images the
operator prepared there (`shoal tasks prepare`). `--url local` runs them in this process instead
(root), preparing and pulling missing images itself.

    python -m shoal.rollout.worker --db runs/rollout.db --concurrency 4
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import traceback
import uuid
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from ..backends import open_backend
from ..core.contract import SandboxBackend
from ..core.errors import DatabaseUnavailable, HostUnavailable, InvalidArgument, LLMUnavailable, SandboxLost
from ..host import Host
from ..trajlog import TrajectoryLog
from .episode import run_episode
from .policy import make_policy
from .queue import log_beside, open_queue
from .ratelimit import HostRateLimiter, bucket_path
from .task import Task

log = logging.getLogger("shoal.rollout")
T = TypeVar("T")


class Worker:
    def __init__(self, db: str | os.PathLike, *, url: str | None = None, api_key: str | None = None,
                 root: str | os.PathLike | None = None, backend: SandboxBackend | None = None,
                 suite: str | os.PathLike | None = None, concurrency: int = 2, create_rate: float = 20.0,
                 lease_s: float = 20.0, max_steps: int = 30, node: str | None = None, name: str | None = None,
                 log_db: str | os.PathLike | None = None, pull_from: str | os.PathLike | None = None,
                 tasks: Iterable[Task] | None = None):
        """Sandboxes go to `backend`, else `open_backend(url, api_key, root)`: shoald at `url`
        ($SHOAL_URL, the host's socket), or in this process at `root` with url="local".
        tasks: the episodes' tasks by id (default: the SWE suite at `suite`, or the bundled one)."""
        self.db = db
        self.queue = open_queue(db)
        self.log = TrajectoryLog(log_beside(db, log_db))
        self.backend = backend or open_backend(url, api_key, root)
        # in-process, the worker prepares (builds, pulls) what its tasks need; a client of shoald cannot
        self.host = self.backend if isinstance(self.backend, Host) else None
        if tasks is None:
            from ..tasks.swe import load_suite

            tasks = load_suite(suite)
        self.tasks: dict[str, Task] = {t.id: t for t in tasks}
        self.concurrency, self.lease_s, self.max_steps = concurrency, lease_s, max_steps
        self.move_deadline_s = 120.0  # how long an episode keeps trying to move off a lost host
        self.node = node or socket.gethostname()
        self.name = name or f"{self.node}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.limiter = HostRateLimiter(bucket_path(self.backend.address), create_rate)
        self.running: set[str] = set()
        self.finished = 0
        # where this node gets the images it lacks: another host's root (a path), or an OCI registry
        # ("oci://REGISTRY/PREFIX": image NAME:TAG is pulled from REGISTRY/PREFIX/NAME:TAG)
        if pull_from and self.host is None:
            raise InvalidArgument("pull_from needs an in-process worker (url='local'): through shoald, the "
                                  "operator pulls images on the sandbox host")
        from ..registry.source import open_image_source

        self.source = open_image_source(pull_from) if pull_from else None

    def _local_images(self) -> set[str]:
        return {i.ref for i in self.backend.images()}

    async def _q(self, method: Callable[..., T], *args: Any, **kw: Any) -> T:
        """A queue call, retried while the queue's database is unreachable (a PostgreSQL restart).
        Every queue write is safe to repeat: a finish or fail that did commit is refused the second
        time, and a claim whose answer was lost leaves an episode nobody heartbeats, so its lease runs
        out and it is claimed again (resuming through the log)."""
        delay = 0.2
        while True:
            try:
                return await asyncio.to_thread(method, *args, **kw)
            except DatabaseUnavailable as e:
                log.warning("queue unavailable, retrying in %.1f s: %s", delay, e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 4)
            await self._q(self.queue.heartbeat, list(self.running), self.name, self.lease_s)

    async def _one(self, claim) -> None:
        try:
            task = self.tasks.get(claim.task_id)
            if task is None:
                raise KeyError(f"task {claim.task_id} is not in this worker's suite")
            policy = make_policy(claim.policy, task)
            if self.host is not None:
                await asyncio.to_thread(task.prepare, self.host, self.source)
            try:
                rec, moves = await self._run_moving(task, policy, claim.id)
            finally:
                await policy.aclose()
            rec.extra["attempt"] = claim.attempts
            rec.extra["moves"] = moves
            rec.extra["worker"] = self.name
            await self._q(self.queue.finish, claim.id, self.name, rec.to_dict())
            self.finished += 1
        except LLMUnavailable as e:
            log.warning("episode %s paused: %s", claim.id, e)
            await self._q(self.queue.pause, claim.id, self.name, str(e))
        except Exception as e:  # noqa: BLE001 - the episode fails, the worker goes on
            log.error("episode %s failed: %s", claim.id, e)
            await self._q(self.queue.fail, claim.id, self.name,
                                    f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}")
        finally:
            self.running.discard(claim.id)

    async def _run_moving(self, task: Task, policy: Any, eid: str) -> tuple[Any, int]:
        """run_episode; when its sandbox is lost with its host (a fleet: `SandboxLost`, or
        `HostUnavailable` until the host's lease runs out), the episode goes on in a new sandbox that
        the trajectory log restores, under the same claim (no attempt is spent: the episode did not
        fail). Each try is a new writer, so the call that was in flight becomes UNKNOWN, never re-run.
        Returns (record, how many times the episode moved)."""
        moves, delay, deadline = 0, 0.25, time.monotonic() + self.move_deadline_s
        while True:
            await self.limiter.acquire()
            writer = f"{self.name}/{eid}" + (f"/{moves}" if moves else "")
            try:
                return await run_episode(task, policy, self.log, self.backend, eid, max_steps=self.max_steps,
                                         writer=writer, node=self.node), moves
            except (SandboxLost, HostUnavailable) as e:
                if time.monotonic() > deadline:
                    raise
                log.warning("episode %s: its sandbox's host is gone (%s); resuming in a new sandbox", eid, e)
                moves += 1
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def run(self, forever: bool = False, idle_poll_s: float = 0.2, max_episodes: int | None = None) -> int:
        """Run until the queue has nothing claimable (or forever); returns episodes finished."""
        hb = asyncio.create_task(self._heartbeat())
        tasks: set[asyncio.Task] = set()
        prefer = self._local_images()
        try:
            while True:
                while len(self.running) < self.concurrency and (max_episodes is None or
                                                                self.finished + len(self.running) < max_episodes):
                    claim = await self._q(self.queue.claim, self.name, self.node, lease_s=self.lease_s,
                                                    prefer_images=prefer)
                    if claim is None:
                        break
                    self.running.add(claim.id)
                    t = asyncio.create_task(self._one(claim))
                    tasks.add(t)
                    t.add_done_callback(tasks.discard)
                if not tasks:
                    if max_episodes is not None and self.finished >= max_episodes:
                        return self.finished
                    if not forever and await self._q(self.queue.pending) == 0:
                        return self.finished
                    await asyncio.sleep(idle_poll_s)  # others' leases may still expire: keep polling
                    prefer = self._local_images()
                    continue
                await asyncio.wait(tasks, timeout=idle_poll_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            hb.cancel()


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", required=True, help="the queue: an SQLite file (the log sits next to it) or a "
                                                "postgresql:// URL")
    ap.add_argument("--log", default=None, help="the trajectory log (default: next to an SQLite queue)")
    ap.add_argument("--url", default=None, help="shoald's URL (default: $SHOAL_URL, else this host's socket); "
                                                "`local` runs sandboxes in this process (root)")
    ap.add_argument("--root", default=None, help="with --url local: this node's Shoal root")
    ap.add_argument("--suite", default=None, help="task suite JSONL (default: the bundled one)")
    ap.add_argument("--kind", default="swe", choices=("swe", "desktop"),
                    help="the suite's kind: SWE (JSONL) or desktop tasks (shoal.tasks.desktop JSON)")
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--create-rate", type=float, default=20.0, help="sandbox-creating episode starts per second")
    ap.add_argument("--lease", type=float, default=20.0)
    ap.add_argument("--max-steps", type=int, default=30)
    ap.add_argument("--node", default=None)
    ap.add_argument("--pull-from", default=None, help="a Shoal root to pull missing images from")
    ap.add_argument("--forever", action="store_true", help="keep polling when the queue is empty")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    tasks = None
    if a.kind == "desktop":
        from ..tasks.desktop.runner import load_desktop_tasks

        tasks = load_desktop_tasks(a.suite)
    w = Worker(a.db, log_db=a.log, url=a.url, root=a.root, suite=a.suite, concurrency=a.concurrency,
               create_rate=a.create_rate, lease_s=a.lease, max_steps=a.max_steps, node=a.node, pull_from=a.pull_from,
               tasks=tasks)
    n = asyncio.run(w.run(forever=a.forever))
    log.info("worker %s finished %d episodes", w.name, n)


if __name__ == "__main__":
    main()
