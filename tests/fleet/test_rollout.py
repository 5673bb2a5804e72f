"""A rollout on the 3-host fleet survives a host kill: 200 scripted (oracle-style) episodes, their
queue and trajectory log in PostgreSQL, two workers that are clients of the gateways. One host's
shoald is SIGKILLed mid-run and its sandboxes die with it: its episodes move to the other hosts and
resume from the log. None is lost (all done, none failed) and none re-executes a tool call that had
completed: each call appends to a counter file in the sandbox, and the last call reads it back."""
from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
import uuid

from shoal.core.errors import HostUnavailable, SandboxLost, ShoalError, UnknownOutcome
from shoal.envs.sandboxes import open_sandbox
from shoal.rollout.runner import Rollout
from shoal.rollout.task import Verdict
from shoal.rollout.tools import Observation
from shoal.rollout.worker import Worker

IMAGE = "busybox:test"
EPISODES = 200
# each effectful call leaves an `x` in /tmp/counter; the second gives a kill a window to land in
SCRIPT = [["sh", {"command": "echo x >> /tmp/counter"}],
          ["sh", {"command": "sleep 0.3; echo x >> /tmp/counter"}],
          ["sh", {"command": "echo shoal > /answer.txt; echo x >> /tmp/counter"}],
          ["sh", {"command": "cat /tmp/counter"}],
          ["sh", {"command": "cat /tmp/counter"}]]  # twice: a kill may land on one of them


class CounterTools:
    """`sh` and `submit` on a busybox sandbox (through the episode's logged sandbox)."""

    specs = [{"type": "function", "function": {"name": "sh", "parameters": {
                 "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}},
             {"type": "function", "function": {"name": "submit", "parameters": {"type": "object", "properties": {}}}}]

    def __init__(self, sb):
        self.sb = sb

    def run(self, name: str, arguments: str | dict) -> Observation:
        args = json.loads(arguments) if isinstance(arguments, str) else dict(arguments)
        if name == "submit":
            return Observation("submitted", submitted=True)
        try:
            r = self.sb.exec(["/bin/sh", "-c", args["command"]], timeout=10)
        except UnknownOutcome:  # in flight when its host was lost: never re-run
            self.sb.stream.settle({"note": "outcome unknown"})
            return Observation("[shoal] outcome unknown", unknown=True, error=True)
        except (SandboxLost, HostUnavailable):
            raise  # the worker moves the episode to a new sandbox
        except ShoalError as e:
            return Observation(f"error: {e}", error=True)
        return Observation(f"{r.stdout}{r.stderr}[exit code {r.exit_code}]", error=r.exit_code != 0)


class CounterTask:
    """Write `shoal` to /answer.txt; the oracle is SCRIPT (a `script` policy)."""

    id = "counter-1"
    image = IMAGE

    def describe(self) -> dict:
        return {"repo": "", "labels": {"kind": "counter"}}

    def prepare(self, host, source=None) -> None:  # the fleet's hosts hold the image
        pass

    def sandbox(self, backend, **create):
        return open_sandbox(backend, IMAGE, memory_mb=64, disk_mb=16, **create)

    def prompt(self) -> list[dict]:
        return [{"role": "user", "content": "Write the word shoal to /answer.txt, then submit."}]

    def tools(self, sandbox) -> CounterTools:
        return CounterTools(sandbox)

    def answer(self, tools: CounterTools) -> str:
        try:
            return tools.sb.read("/answer.txt")
        except (SandboxLost, HostUnavailable):
            raise
        except ShoalError:
            return ""

    def grade(self, host, answer: str) -> Verdict:
        ok = answer.strip() == "shoal"
        return Verdict(reward=1.0 if ok else 0.0, resolved=ok, report={})


def _live_on(fleet, h) -> set[str]:
    try:
        return fleet.local_ids(h)
    except Exception:
        return set()


def test_rollout_survives_a_host_kill(gw, postgres):
    dsn = postgres.new_database()
    key = gw.tenant(f"ro-{uuid.uuid4().hex[:6]}", sandboxes=40, cpu=64, memory_mb=16384, disk_mb=16384)
    ro = Rollout(dsn)
    ids = ro.submit([CounterTask()], {"kind": "script", "actions": SCRIPT}, repeats=EPISODES)
    # two workers, each a client of both gateways (the SDK falls over to the second)
    workers = [Worker(dsn, url=gw.url, api_key=key, tasks=[CounterTask()], concurrency=6, create_rate=200,
                      lease_s=20, node=f"w{i}") for i in (1, 2)]
    results: dict[int, object] = {}

    def drive(i: int, w: Worker) -> None:
        try:
            results[i] = asyncio.run(w.run())
        except BaseException as e:  # noqa: BLE001 - reported below
            results[i] = e

    threads = [threading.Thread(target=drive, args=(i, w), daemon=True) for i, w in enumerate(workers)]
    t_start = time.monotonic()
    for t in threads:
        t.start()
    victim, killed_at, on_victim = None, None, set()
    try:
        # mid-run: a third of the episodes done, and sandboxes live on the host about to die
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if ro.counts()["done"] >= EPISODES // 3:
                busiest = max(gw.hosts, key=lambda h: len(_live_on(gw, h)))
                on_victim = _live_on(gw, busiest)
                if on_victim:
                    victim = busiest
                    break
            time.sleep(0.05)
        assert victim is not None, f"no host was busy a third of the way in: {ro.counts()}"
        killed_at = time.monotonic()
        gw.stop_host(victim, signal.SIGKILL)  # its shoald...
        from shoal import Host

        lost = Host.get(victim.root)
        for sid in lost.live_ids():  # ...and its sandboxes, as when the machine dies
            try:
                lost.kill(sid)
            except ShoalError:
                pass
        for t in threads:
            t.join(timeout=110 - (time.monotonic() - t_start))
        assert not any(t.is_alive() for t in threads), f"workers still running: {ro.counts()}"
    finally:
        for w in workers:
            w.concurrency = 0
        if victim is not None:
            gw.start_host(victim)  # it reconciles (kills what the directory says it lost) and rejoins
    wall = time.monotonic() - t_start
    for i, r in results.items():
        assert isinstance(r, int), f"worker {i}: {r!r}"
    counts = ro.counts()
    assert counts["done"] == len(ids) == EPISODES and counts["failed"] == 0, counts
    recs = ro.records()
    assert len(recs) == EPISODES
    moved = [r for r in recs if r["extra"].get("moves")]
    assert moved, "no episode was running on the killed host"
    assert all(r["extra"]["attempt"] == 1 for r in recs)  # a move spends no attempt
    for r in recs:
        calls = [a for a in r["actions"] if a["tool"] == "sh"]
        assert len(calls) == len(SCRIPT), r["actions"]
        completed = sum(1 for a in calls[:3] if not a["unknown"])
        cats = [a for a in calls[3:] if not a["unknown"]]
        assert cats, r["actions"]
        # every completed call left exactly one mark: none ran twice, none was dropped
        for cat in cats:
            assert cat["observation"].count("x\n") == completed, (r["episode_id"], r["actions"])
        if not r["extra"].get("moves"):
            assert r["resolved"] and r["restored_ops"] == 0 and r["unknown_ops"] == 0
            assert r["executed"]["sandbox"] >= 5 and r["replayed"]["sandbox"] == 0
    for r in moved:
        assert r["sandbox"].split("-")[1] != victim.name  # it finished off the dead host
        # the new sandbox got the completed effects back from the log (restored), the calls already
        # answered came from the log (replayed); nothing that completed ran again as a new call
        assert r["replayed"]["sandbox"] >= r["restored_ops"], r
        assert r["resolved"] or any(a["unknown"] for a in r["actions"][:3])
    resumed = [r for r in moved if r["restored_ops"] >= 1]
    assert resumed, "no moved episode had completed a call before the kill"
    print(f"{EPISODES} episodes in {wall:.1f} s; host {victim.name} killed with {len(on_victim)} sandboxes "
          f"at {killed_at - t_start:.1f} s; {len(moved)} episodes moved ({len(resumed)} restored from the log, "
          f"{sum(r['unknown_ops'] for r in moved)} calls of unknown outcome); none lost, none re-executed")
