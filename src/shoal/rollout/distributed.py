"""Scale-out on Ray: one rollout actor per Ray node, each driving that node's own shoald.

The queue and the trajectory log are the shared state (here SQLite files on a filesystem every
node sees; the `LogStore` interface is where a shared database goes for real multi-host runs).
Each actor claims episodes, preferring those whose task image its node already holds, and pulls
missing images from `pull_from` (a registry mirror). When a node is lost, its actor dies with it,
its leases run out, and the other actors resume its episodes from the log: a new sandbox from the
same layers, the logged effects re-applied, logged model turns fast-forwarded.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass

try:
    import ray
except ImportError as e:  # an extra: the SDK, CLI and daemon do not need it
    raise ImportError("rollouts on Ray need ray: pip install 'shoal[rollout]'") from e


@ray.remote(num_cpus=0, max_restarts=0)  # the sandboxes use the node's cores; the actor mostly waits
class RolloutActor:
    def __init__(self, db: str, url: str | None = None, root: str | None = None, *, suite: str | None = None,
                 concurrency: int = 2, node: str = "", pull_from: str | None = None, lease_s: float = 10.0,
                 max_steps: int = 30):
        from .worker import Worker

        self.node = node or socket.gethostname()
        self.worker = Worker(db, url=url, root=root, suite=suite, concurrency=concurrency, node=self.node,
                             pull_from=pull_from, lease_s=lease_s, max_steps=max_steps)

    def where(self) -> dict:
        return {"node": self.node, "ray_node": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "backend": self.worker.backend.address}

    async def run(self) -> dict:
        n = await self.worker.run()
        return {"node": self.node, "finished": n}


@dataclass
class NodeSpec:
    resource: str  # a custom Ray resource only that node has, e.g. "shoal-node-1"
    url: str | None = None  # that node's shoald (default: the node's own socket)
    root: str | None = None  # with url="local": that node's Shoal root, sandboxes in the actor's process


def start_actors(db: str, nodes: list[NodeSpec], **kw) -> list:
    """One actor pinned to each node (by its custom resource)."""
    # @ray.remote turns the class into an ActorClass (with .options); its stubs type it as the plain class
    return [RolloutActor.options(resources={n.resource: 0.001}).remote(  # type: ignore[attr-defined]  # see above
                db, n.url, n.root, node=n.resource, **kw)
            for n in nodes]
