"""Branching an episode from any step (FLARE's breakpoint; docs/flare.md).

`Episode(log, id, backend).branch(step=k)` makes a new episode whose log holds steps 1..k of this
one (its `<ep>/sandbox`, `<ep>/llm` and `<ep>/steps` prefixes, copied in one transaction) and whose
sandbox holds the state after step k. Running the branch (`run_episode` on its id, or `Episode.run`)
fast-forwards those k steps from the log and goes on live from step k+1, where a caller may change
the policy's context (a diagnosis, a fix).

The state after step k comes back one of two ways:

- `snapshot`: the episode was run with `snapshot_every=j` and step k has a pack_diff snapshot: one
  sandbox create from it. Exact whatever the steps did (random output, counters, deletions).
- `fastforward`: from the nearest snapshot at or before k (or the start), the logged effects up to
  step k are re-applied and each result is compared with the logged one; a difference (a command
  whose output is not reproducible) raises `BranchNotExact` rather than handing back a state that
  the log does not describe.

`auto` (the default) takes the snapshot when step k has one, else fast-forwards.

Branches form a tree in the log: each branch's streams carry a parent link (parent stream, step);
`Episode.tree()` walks it, `shoal traj tree` prints it.

When a tree is done with, `Episode.release_snapshots()` removes its snapshot images (and their
layers where the backend can), except those a live sandbox or a live branch still uses; the
released ids are recorded in each episode's `<ep>/steps` metadata, so a later branch at such a step
fast-forwards instead of asking for an image that is gone.
"""
from __future__ import annotations

import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from ..core.contract import CreateRequest, SandboxBackend, SandboxInfo
from ..core.errors import (
    BadBranchStep,
    BranchNotExact,
    EpisodeNotFound,
    ImageNotFound,
    InvalidArgument,
    LayerInUse,
    NotSupported,
    SandboxNotFound,
)
from ..envs.sandboxes import attach, create_request
from ..sdk.sandbox import Sandbox
from ..trajlog import DONE, UNKNOWN, TrajectoryLog, fast_forward
from .episode import SANDBOX_TTL_S, run_episode

if TYPE_CHECKING:
    from .episode import EpisodeRecord
    from .policy import Policy
    from .task import Task

STRATEGIES = ("auto", "snapshot", "fastforward")
MAX_TREE_DEPTH = 200  # branches of branches; far past any real search, well inside the recursion limit
COPIED = ("sandbox", "llm", "steps")  # the streams a branch inherits a prefix of (not the grade: it is redone)


@dataclass
class StepMark:
    """Where an episode's streams stood after one step, and the step's snapshot if one was taken."""

    step: int
    sandbox_seq: int  # entries of <ep>/sandbox the steps 1..step wrote
    llm_seq: int
    snapshot: str | None = None


@dataclass
class BranchInfo:
    """How a branch was made."""

    episode: str
    parent: str
    step: int
    strategy: str  # the one used: snapshot or fastforward
    from_step: int  # the snapshot the state came from (0: the episode's start)
    replayed_ops: int  # effects re-applied on top of it
    sandbox: str
    seconds: float
    entries: int  # log entries copied

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class BranchNode:
    episode: str
    steps: int
    step: int | None = None  # where it branched from its parent
    children: list[BranchNode] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"episode": self.episode, "steps": self.steps, "step": self.step,
                "children": [c.to_dict() for c in self.children]}


@dataclass
class SnapshotRelease:
    """What `Episode.release_snapshots` did to a tree's snapshots."""

    root: str
    episodes: list[str]
    removed: list[str] = field(default_factory=list)  # snapshot ids whose images were removed
    kept: dict[str, str] = field(default_factory=dict)  # snapshot id -> why it stays
    missing: list[str] = field(default_factory=list)  # images gone already, or not this caller's to see
    layers_removed: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _snapshot_ref(snap: str) -> str:
    return f"snapshots/{snap}:latest"


def check_step(step: object, length: int, episode: str) -> int:
    """`step` as a branch point of an episode of `length` steps, or BadBranchStep."""
    if isinstance(step, bool) or not isinstance(step, int):
        raise BadBranchStep(f"a branch step is a whole number, got {step!r}")
    if length == 0:
        raise BadBranchStep(f"episode {episode!r} has no step marks to branch from (it ran no step, or was "
                            "recorded before branching existed)")
    if not 1 <= step <= length:
        raise BadBranchStep(f"episode {episode!r} has steps 1..{length}; cannot branch at step {step}")
    return step


class Episode:
    """An episode in a trajectory log, as something to branch from (and run on)."""

    def __init__(self, log: TrajectoryLog, episode_id: str, backend: SandboxBackend | None = None, *,
                 node: str | None = None, info: BranchInfo | None = None):
        if not episode_id or "/" in episode_id:
            raise InvalidArgument(f"an episode id is a non-empty name without '/', got {episode_id!r}")
        self.log, self.id, self.backend = log, episode_id, backend
        self.node = node or socket.gethostname()
        self.info = info  # set on a branch made by `branch`

    def __repr__(self) -> str:
        return f"Episode({self.id!r})"

    def stream(self, kind: str) -> str:
        return f"{self.id}/{kind}"

    def exists(self) -> bool:
        return self.log.info(self.stream("sandbox")) is not None

    def _require(self) -> None:
        if not self.exists():
            raise EpisodeNotFound(f"no episode {self.id!r} in the trajectory log")

    def snapshots(self) -> list[str]:
        """The ids of the snapshots the episode's steps took (what a branch may be restored from)."""
        return [m.snapshot for m in self.marks() if m.snapshot]

    def released(self) -> set[str]:
        """Snapshot ids of this episode's marks whose images `release_snapshots` removed."""
        si = self.log.info(self.stream("steps"))
        got = (si.meta if si else {}).get("released") or []
        return {x for x in got if isinstance(x, str)} if isinstance(got, list) else set()

    def marks(self) -> list[StepMark]:
        """The episode's step marks, in order (the state after step k is described by marks()[k-1]).
        A released snapshot reads as none: that step is restored by fast-forward."""
        gone = self.released()
        out = []
        for e in self.log.history(self.stream("steps")):
            if e.kind != "step" or e.result is None or e.status not in (DONE, UNKNOWN):
                break  # a mark still in flight: the episode's steps end before it
            r, q = e.result, e.request
            try:
                snap = r.get("snapshot")
                out.append(StepMark(step=int(q["step"]), sandbox_seq=int(q["sandbox_seq"]),
                                    llm_seq=int(q["llm_seq"]), snapshot=None if snap in gone else snap))
            except (KeyError, TypeError, ValueError, AttributeError):
                # the log is its writers' to forge: a malformed mark is a typed error, not a crash
                raise InvalidArgument(f"episode {self.id}: step mark {len(out) + 1} is malformed") from None
        return out

    def __len__(self) -> int:
        return len(self.marks())

    @property
    def parent(self) -> tuple[str, int] | None:
        """(parent episode, step it branched at), or None for an episode that is not a branch."""
        si = self.log.info(self.stream("steps"))
        if si is None or si.parent is None:
            return None
        return si.parent.rsplit("/", 1)[0], int(si.parent_step or 0)

    def sandbox(self) -> Sandbox | None:
        """The episode's live sandbox on this episode's backend, if it is still running."""
        si = self.log.info(self.stream("sandbox"))
        sid = (si.meta if si else {}).get("sandbox")
        if not sid or self.backend is None:
            return None
        try:
            sb = attach(self.backend, sid)
        except SandboxNotFound:
            return None
        return sb if sb.is_running() else None

    # ------------------------------------------------------------------ branch
    def branch(self, step: int, *, strategy: str = "auto", episode_id: str | None = None,
               backend: SandboxBackend | None = None, ttl: float | None = SANDBOX_TTL_S,
               from_step: int | None = None,
               creator: Callable[[CreateRequest], SandboxInfo] | None = None, address: str | None = None,
               node: str | None = None) -> Episode:
        """A new episode: this one's log up to step `step`, and a sandbox in the state after it.
        `from_step` (fastforward only): start from that step's snapshot (0: the episode's start)
        instead of the nearest one. `creator`: how the sandbox is made (default `backend.create`;
        shoald passes its create for the calling tenant: image checks, quotas, ownership). `address`,
        `node`: where the branch will be run from, as `run_episode` compares them to reattach its
        sandbox (default: `backend.address` and this episode's node)."""
        t0 = time.perf_counter()
        if strategy not in STRATEGIES:
            raise InvalidArgument(f"branch strategy is one of {', '.join(STRATEGIES)}, got {strategy!r}")
        backend = backend or self.backend
        if backend is None:
            raise InvalidArgument("branching needs a backend to make the branch's sandbox on")
        self._require()
        marks = self.marks()
        check_step(step, len(marks), self.id)
        mark = marks[step - 1]
        if strategy == "snapshot" and mark.snapshot is None:
            raise BranchNotExact(f"episode {self.id!r} has no snapshot after step {step} (run it with "
                                 "snapshot_every=1, or branch with strategy='fastforward')")
        use = "snapshot" if mark.snapshot is not None and strategy != "fastforward" else "fastforward"
        base: StepMark | None = mark
        if use == "fastforward":
            base = next((m for m in reversed(marks[:step]) if m.snapshot is not None), None)
        if from_step is not None:
            if strategy != "fastforward":
                raise InvalidArgument("from_step is for strategy='fastforward'")
            if from_step != 0:
                check_step(from_step, step, self.id)
                if marks[from_step - 1].snapshot is None:
                    raise BranchNotExact(f"episode {self.id!r} has no snapshot after step {from_step}")
            base = marks[from_step - 1] if from_step else None
        new_id = episode_id or f"{self.id}.b{step}.{secrets.token_hex(3)}"
        child = Episode(self.log, new_id, backend, node=node or self.node)
        if child.exists():
            raise InvalidArgument(f"episode {new_id!r} exists already")

        marks_info = self.log.info(self.stream("steps"))
        start = (marks_info.meta.get("start") if marks_info else None) or {}
        sb = _create(backend, start, base.snapshot if base else None, ttl, creator or backend.create)
        replayed = 0
        try:
            if use == "fastforward":
                rep = fast_forward(self.log, self.stream("sandbox"), sb, start=base.sandbox_seq if base else 0,
                                   stop=mark.sandbox_seq)
                if rep.mismatches:
                    m = rep.mismatches[0]
                    raise BranchNotExact(
                        f"fast-forward of episode {self.id!r} to step {step}: seq {m['seq']} ({m['kind']}) gave a "
                        f"different {m['field']} than the log; the step is not reproducible, so only a snapshot "
                        "restores it exactly (run the episode with snapshot_every=1)")
                replayed = rep.ops
            copied = self._copy(new_id, mark, step, sb.id, address or backend.address, child.node)
        except BaseException:
            sb.kill()
            raise
        child.info = BranchInfo(episode=new_id, parent=self.id, step=step, strategy=use,
                                from_step=base.step if base else 0, replayed_ops=replayed, sandbox=sb.id,
                                seconds=time.perf_counter() - t0, entries=copied)
        return child

    def _copy(self, new_id: str, mark: StepMark, step: int, sandbox_id: str, address: str, node: str) -> int:
        upto = {"sandbox": mark.sandbox_seq, "llm": mark.llm_seq, "steps": step}
        where = {"sandbox": sandbox_id, "backend": address, "node": node}  # what run_episode reattaches
        return self.log.store.branch_streams(
            [(self.stream(kind), f"{new_id}/{kind}", upto[kind], where if kind == "sandbox" else None)
             for kind in COPIED], episode=new_id, step=step)

    async def run(self, task: Task, policy: Policy, **kw: Any) -> EpisodeRecord:
        """Run the episode on (a branch: its k logged steps fast-forward, then it goes on live)."""
        if self.backend is None:
            raise InvalidArgument("running an episode needs a backend")
        return await run_episode(task, policy, self.log, self.backend, self.id, node=self.node, **kw)

    def kill(self) -> None:
        sb = self.sandbox()
        if sb is not None:
            sb.kill()

    # ------------------------------------------------------------------ snapshot release
    def release_snapshots(self, *, dry_run: bool = False) -> SnapshotRelease:
        """Remove the snapshot images of this episode's whole tree (from its root down), for when
        the tree is done with. A snapshot is kept while anything may still need it:

        - a live sandbox's layer stack holds the snapshot's top layer (a branch restored from it,
          or a sandbox forked or created from it by anyone on this backend);
        - an episode of the tree whose steps reference it still has a live sandbox (a live branch
          may be branched again at one of those steps).

        Removed ids are recorded in every episode's `<ep>/steps` metadata first (so branching at
        such a step fast-forwards from the start instead), then each image is removed, then its top
        layer where the backend can remove layers (it refuses a layer an image or a live sandbox
        still holds; `shoal gc` removes the rest). Running it again when the live ones are gone
        releases them."""
        backend = self.backend
        if backend is None:
            raise InvalidArgument("releasing snapshots needs the backend that holds them")
        self._require()
        root = self.root()
        episodes: list[str] = []
        todo = [root.tree()]
        while todo:
            n = todo.pop()
            episodes.append(n.episode)
            todo.extend(n.children)
        snaps: dict[str, set[str]] = {}  # snapshot id -> the episodes whose steps reference it
        for e in episodes:
            ep = Episode(self.log, e, backend, node=self.node)
            for m in ep.marks():
                if m.snapshot:
                    snaps.setdefault(m.snapshot, set()).add(e)
        live_layers = {d for sb in backend.list() for d in sb.layers}
        live_eps = {e for e in episodes if Episode(self.log, e, backend, node=self.node).sandbox() is not None}
        tops = {i.ref: (i.layers[-1] if i.layers else None) for i in backend.images()}
        out = SnapshotRelease(root=root.id, episodes=sorted(episodes))
        release: list[str] = []
        for snap in sorted(snaps):
            ref = _snapshot_ref(snap)
            top = tops.get(ref)
            users = sorted(snaps[snap] & live_eps)
            if ref not in tops:
                out.missing.append(snap)
            elif top is not None and top in live_layers:
                out.kept[snap] = "a live sandbox's layers hold it"
            elif users:
                out.kept[snap] = f"live branch {users[0]} references it"
            else:
                release.append(snap)
        if dry_run:
            out.removed = release
            return out
        remove_image = getattr(backend, "remove_image", None) or getattr(getattr(backend, "store", None),
                                                                         "remove_image", None)
        remove_layer = getattr(backend, "remove_layer", None)
        if release and remove_image is None:
            raise NotSupported(f"the {backend.name} backend cannot remove images")
        if release:  # first the log: no branch made from now on asks for these images
            for e in episodes:  # (an image this caller cannot see is not its to mark: it stays "missing")
                ep = Episode(self.log, e, backend, node=self.node)
                gone = sorted(ep.released() | set(release))
                self.log.store.update_stream(ep.stream("steps"), meta={"released": gone})
        for snap in release:
            ref = _snapshot_ref(snap)
            assert remove_image is not None
            try:
                remove_image(ref)
            except ImageNotFound:
                out.missing.append(snap)
                continue
            out.removed.append(snap)
            top = tops.get(ref)
            if top is not None and remove_layer is not None:
                try:
                    remove_layer(top)
                    out.layers_removed.append(top)
                except (LayerInUse, LookupError):
                    pass  # another image or a sandbox started meanwhile holds it: gc takes it later
        return out

    # ------------------------------------------------------------------ the tree
    def tree(self) -> BranchNode:
        """This episode and every branch below it, recursively."""
        self._require()
        parent = self.parent
        return self._node(self.id, parent[1] if parent else None, {self.id}, 0)

    def _node(self, episode: str, step: int | None, seen: set[str], depth: int) -> BranchNode:
        # a log is the clients' to write: a forged parent cycle or an absurd depth ends the walk
        if depth > MAX_TREE_DEPTH:
            raise InvalidArgument(f"episode {self.id}'s branch tree is deeper than {MAX_TREE_DEPTH}")
        node = BranchNode(episode=episode, steps=len(Episode(self.log, episode).marks()), step=step)
        for c in self.log.store.children(f"{episode}/steps"):
            if c.episode and c.episode not in seen:
                seen.add(c.episode)
                node.children.append(self._node(c.episode, c.parent_step, seen, depth + 1))
        return node

    def root(self) -> Episode:
        """The episode at the top of this one's tree."""
        ep: Episode = self
        seen = {ep.id}
        while (p := ep.parent) is not None and p[0] not in seen:
            seen.add(p[0])
            ep = Episode(self.log, p[0], self.backend, node=self.node)
        return ep


def _create(backend: SandboxBackend, start: dict, snapshot: str | None, ttl: float | None,
            creator: Callable[[CreateRequest], SandboxInfo]) -> Sandbox:
    """The branch's sandbox: from a snapshot's image, or from the episode's start layers, with the
    start sandbox's environment and limits."""
    fields = {k: start[k] for k in ("env", "memory_mb", "disk_mb", "cpu", "pids", "upper") if start.get(k)}
    if snapshot is not None:
        req = create_request(None, from_snapshot=snapshot, ttl=ttl, **fields)
    else:
        if not start.get("layers"):
            raise BranchNotExact("the episode recorded no start layers to fast-forward from")
        req = create_request(None, start["layers"], workdir=start.get("workdir"), ttl=ttl, **fields)
    return Sandbox(backend, creator(req))
