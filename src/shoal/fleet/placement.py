"""Where a new sandbox goes: a score per live host, highest wins. No queue and no scheduler: a
create that no host can take is refused at once (a retryable 429), like a full host refuses it.

    score = W_LOCAL * locality + W_SPREAD * spread + W_FREE * free   (+ a little jitter)

  locality  bytes of the sandbox's layers already on the host (local, or fully in its chunk cache),
            over all its bytes: starting from cached layers saves a pull, the costliest part of a
            cold start, so it weighs most
  spread    1 - (the tenant's live sandboxes in the host's failure domain / all its live sandboxes):
            a tenant's sandboxes go to other domains first, so losing one domain loses fewer
  free      the smaller of the host's free sandbox slots and free memory, as fractions
Hosts that cannot fit the sandbox (slots, memory) are out; hosts that do not know the image are out
unless none knows it (then a host with an image source may pull it, or answers ImageNotFound).
The jitter breaks ties differently per call, so concurrent gateways do not all pick the same host.
"""
from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, field

W_LOCAL, W_SPREAD, W_FREE = 2.0, 1.0, 1.0
JITTER = 0.01


@dataclass
class HostView:
    """What placement knows of one live host: from its heartbeat, plus sandboxes placed on it since."""

    id: str
    address: str
    domain: str
    max_sandboxes: int
    memory_mb: int
    sandboxes: int = 0  # live, as of its last heartbeat plus placements since
    used_memory_mb: int = 0
    images: dict[str, list[str]] = field(default_factory=dict)  # ref -> layer digests, bottom -> top
    cached: dict[str, int] = field(default_factory=dict)  # digest -> bytes, for layers on the host

    def fits(self, memory_mb: int) -> bool:
        return self.sandboxes < self.max_sandboxes and self.used_memory_mb + memory_mb <= self.memory_mb

    def free(self) -> float:
        slots = 1 - self.sandboxes / max(1, self.max_sandboxes)
        mem = 1 - self.used_memory_mb / max(1, self.memory_mb)
        return max(0.0, min(slots, mem))


@dataclass(frozen=True)
class Wanted:
    """A create, as placement sees it: the image refs and digests it names, its memory, who asks."""

    refs: tuple[str, ...] = ()  # image name:tag references (the image, and image-valued layers)
    digests: tuple[str, ...] = ()  # layers named by digest
    memory_mb: int = 512
    domain_counts: dict[str, int] = field(default_factory=dict)  # the tenant's live sandboxes per domain
    pin: str | None = None  # a host it must go to (a snapshot lives there)


def stack_of(want: Wanted, hosts: Iterable[HostView]) -> list[str]:
    """The layer digests the create needs, as any host that knows its images reports them."""
    out = list(want.digests)
    for ref in want.refs:
        for h in hosts:
            if ref in h.images:
                out += h.images[ref]
                break
    return out


def locality(host: HostView, stack: list[str], sizes: dict[str, int]) -> float:
    """Fraction of the stack's bytes the host holds (1.0 for an empty stack)."""
    total = sum(sizes.get(d, 1) for d in stack)
    if not total:
        return 1.0
    return sum(sizes.get(d, 1) for d in stack if d in host.cached) / total


def score(host: HostView, want: Wanted, stack: list[str], sizes: dict[str, int]) -> float:
    return W_LOCAL * locality(host, stack, sizes) + W_SPREAD * spread(host, want) + W_FREE * host.free()


def knows_all(hosts: Iterable[HostView], want: Wanted) -> bool:
    """Whether some host reports every image the create names (else a newer inventory may)."""
    return not want.refs or any(all(r in h.images for r in want.refs) for h in hosts)


def base_scores(hosts: list[HostView], want: Wanted, rng: random.Random | None = None
                ) -> list[tuple[float, HostView]]:
    """The hosts that may take the sandbox, each with its score less the spread term (locality,
    free room, jitter), best first. The directory adds the spread, which depends on the tenant's live
    sandboxes, inside the reservation (directory.py, schema.RESERVE_FN)."""
    rng = rng or random.Random()
    if want.pin is not None:
        return [(0.0, h) for h in hosts if h.id == want.pin and h.fits(want.memory_mb)]
    fitting = [h for h in hosts if h.fits(want.memory_mb)]
    knowing = [h for h in fitting if all(r in h.images for r in want.refs)]
    candidates = knowing or fitting
    stack = stack_of(want, hosts)
    sizes: dict[str, int] = {}
    for h in hosts:
        for d, n in h.cached.items():
            sizes.setdefault(d, max(1, n))
    scored = [(W_LOCAL * locality(h, stack, sizes) + W_FREE * h.free() + rng.uniform(0, JITTER), h)
              for h in candidates]
    return sorted(scored, key=lambda x: -x[0])


def spread(host: HostView, want: Wanted) -> float:
    total = sum(want.domain_counts.values())
    return 1.0 - (want.domain_counts.get(host.domain, 0) / total if total else 0.0)


def rank(hosts: list[HostView], want: Wanted, rng: random.Random | None = None) -> list[HostView]:
    """The hosts that may take the sandbox, best first (empty: none can)."""
    scored = [(b + W_SPREAD * spread(h, want), h) for b, h in base_scores(hosts, want, rng)]
    return [h for _, h in sorted(scored, key=lambda x: -x[0])]
