"""Chunk read-ahead on first touches, for a lazy layer that has no prefetch list (a never-seen image).

Without a list every miss is a serial round trip: the first exec faults its files in one after
another. The kernel's read-ahead cannot help across them: EROFS reads its backing (FUSE) file
through one `struct file`, whose read-ahead state sees small scattered reads. A layer pushed with
`--relayout` has the data a first run read laid out contiguously, so a demand read that extends a
run of touched chunks, or touches a block where another read was, predicts the next ones. This
module makes that prediction at chunk level:

- It keeps which chunks demand reads have touched. When a read extends a run of `k >= MIN_RUN`
  touched chunks, the window is `2^(k-1)` chunks (capped at `max_chunks`) past the run's end.
- The part of the window not already asked for is fetched in the background (one coalesced Range
  read), *concurrently* with the demand read's own fetch: the demand read never waits for it, but a
  later read of one of those chunks joins the fetch in flight (the cache's single-flight).
- It asks again only when less than half the window is ahead (like the kernel's async marker),
  so a sequential stream is a few growing requests, not one per chunk.
- **Dense blocks**: the relayout orders a layer's hot data by a *recorded* run's first reads, and
  another run reads the same region in another order (threads, the kernel's own read-ahead), so a
  hot region is touched out of order as often as in order. When a second chunk of an aligned block
  of `cluster` chunks (1 MiB) is touched, the rest of that block is fetched in the background.
- An isolated miss (no touched neighbour behind it, alone in its block) fetches only itself:
  scattered reads cost no extra bytes. What a stream costs is at most one window past its end;
  what a dense block costs is its untouched chunks.

- **A budget in bytes**: at most `budget` chunks asked for by read-ahead may be unused (not yet
  touched by a demand read) at any time; a guess that comes true frees its room, a window or block
  that does not fit is cut to the chunks nearest the read. So a layer's read-ahead never costs more
  than `SHOAL_LAZY_MISS_READAHEAD_BUDGET_PCT` (default 0.5) percent of the layer in chunks nobody
  read, however long it is used, and a run of right guesses keeps going.

A layer with a prefetch list does not use it (the list says what to fetch; read-ahead past it
would only add bytes). `SHOAL_LAZY_MISS_READAHEAD_KB` sets the window's cap (default 1024; 0: off),
`SHOAL_LAZY_MISS_CLUSTER_KB` the dense block (default 0: off; 1024 measured). Round 3
(docs/lazy-loading.md) measured both rules without a budget: about a third fewer GETs and a faster
cold start without a list, but 1.5-3.8 points more of the image fetched by the agent and tests
sequences, which took 5 of the 10 benchmark images past the 15 % bytes goal; hence the budget
(round 4), and the dense-block rule stays off.
"""
from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from typing import TYPE_CHECKING

from ..core.errors import ShoalError

if TYPE_CHECKING:
    from .layer import LazyLayer

log = logging.getLogger("shoal.lazy.readahead")

MIN_RUN = 2
DEFAULT_KB = 1024  # the sequential window's cap
DEFAULT_CLUSTER_KB = 0  # the dense-block rule: off (round 3: it cost the most bytes)
DEFAULT_BUDGET_PCT = 0.5  # of the layer: read-ahead chunks not yet used by a demand read


def window_chunks(chunk_size: int, var: str = "SHOAL_LAZY_MISS_READAHEAD_KB") -> int:
    """A size in chunks from the environment (SHOAL_LAZY_MISS_READAHEAD_KB / _CLUSTER_KB; 0: off)."""
    kb = int(os.environ.get(var, str(DEFAULT_CLUSTER_KB if var.endswith("CLUSTER_KB") else DEFAULT_KB)))
    return max(0, (kb << 10) // max(1, chunk_size))


class ChunkReadahead:
    """The read-ahead state of one lazy layer of `n` chunks. `submit(chunks)` starts a background
    fetch of those (ascending, consecutive) chunk numbers; `cached(i)` says whether chunk i is
    already in the cache (not fetched again)."""

    def __init__(self, n: int, max_chunks: int, submit: Callable[[list[int]], object],
                 cached: Callable[[int], bool], cluster: int = 0, budget: int | None = None):
        self.n, self.max, self.cluster = n, max_chunks, cluster
        self.submit, self.cached = submit, cached
        self.touched = bytearray(n)  # read by a demand read
        self.asked = bytearray(n)  # touched, or asked for by a read-ahead
        self.unused = bytearray(n)  # asked for by a read-ahead, not (yet) touched by a demand read
        # the most chunks read-ahead may have asked for that no demand read has touched yet: what a
        # wrong guess can cost in bytes is at most this many chunks, however long the layer is read
        self.budget = n if budget is None else max(0, budget)
        self.outstanding = 0  # chunks in `unused`
        self.lock = threading.Lock()
        self.requests = 0  # read-aheads started (tests, traces)
        self.chunks = 0  # chunks they asked for
        self.refused = 0  # chunks a window or block wanted that the budget refused

    def note(self, numbers: range | list[int]) -> list[int]:
        """A demand read spans chunks `numbers`: start the read-ahead it calls for, if any (before the
        demand read waits for its own chunks). Returns the chunk numbers asked for (tests)."""
        if (self.max <= 0 and self.cluster <= 1) or not numbers:
            return []
        with self.lock:
            for i in numbers:
                self.touched[i] = self.asked[i] = 1
                if self.unused[i]:  # a guess that came true: room for the next one
                    self.unused[i] = 0
                    self.outstanding -= 1
            want = sorted(j for j in set(self._dense(numbers) + self._ahead(numbers[-1])) if not self.cached(j))
            room = self.budget - self.outstanding
            if len(want) > room:  # nearest first (a window's start, a block's chunks near the read)
                keep = set(sorted(want, key=lambda j: abs(j - numbers[-1]))[:max(0, room)])
                for j in want:
                    if j not in keep:
                        self.asked[j] = 0  # may be asked for again once the budget has room
                self.refused += len(want) - len(keep)
                want = sorted(keep)
            for j in want:
                self.unused[j] = 1
            self.outstanding += len(want)
        if want:
            self.requests += 1
            self.chunks += len(want)
            self.submit(want)
        return want

    def forget(self, chunks: list[int]) -> None:
        """A read-ahead of `chunks` failed (nothing of it kept): they leave the budget and may be asked
        for again."""
        with self.lock:
            for j in chunks:
                if self.unused[j]:
                    self.unused[j] = 0
                    self.outstanding -= 1
                    self.asked[j] = 0

    def _dense(self, numbers: range | list[int]) -> list[int]:
        """The untouched, unasked chunks of each block `numbers` touches that has another touched chunk."""
        c = self.cluster
        if c <= 1:
            return []
        out: list[int] = []
        for b in sorted({i // c for i in numbers}):
            lo, hi = b * c, min(self.n, (b + 1) * c)
            if sum(self.touched[lo:hi]) >= 2:
                for j in range(lo, hi):
                    if not self.asked[j]:
                        self.asked[j] = 1
                        out.append(j)
        return out

    def _ahead(self, last: int) -> list[int]:
        """The sequential window past `last` (under the lock)."""
        if self.max <= 0:
            return []
        k, j = 0, last
        while j >= 0 and self.touched[j] and k < 2 * self.max:
            k += 1
            j -= 1
        if k < MIN_RUN:
            return []
        w = min(self.max, 1 << min(k - 1, 30))
        ahead, j = 0, last + 1
        while j < self.n and self.asked[j] and ahead < w:
            ahead += 1
            j += 1
        if ahead * 2 >= w:
            return []
        want = []
        for j in range(last + 1 + ahead, min(self.n, last + 1 + w)):
            if self.asked[j]:
                break  # keep it one run (one request); what lies past it is asked for later
            self.asked[j] = 1
            want.append(j)
        return want


def budget_chunks(n: int, chunk_size: int) -> int:
    """SHOAL_LAZY_MISS_READAHEAD_BUDGET_PCT (default 0.5) percent of a layer of `n` chunks, in chunks."""
    pct = float(os.environ.get("SHOAL_LAZY_MISS_READAHEAD_BUDGET_PCT", str(DEFAULT_BUDGET_PCT)))
    return int(n * max(0.0, pct) / 100)


def for_layer(layer: LazyLayer, pool: Executor, max_chunks: int | None = None, name: str = "",
              cluster: int | None = None, budget: int | None = None) -> ChunkReadahead | None:
    """The read-ahead of `layer`, fetching on `pool` (None when the cap is 0). A failed read-ahead is
    only logged: nothing bad is kept (the cache verifies every chunk), and a demand read of those
    chunks fetches (and reports) again."""
    cap = window_chunks(layer.index.chunk_size) if max_chunks is None else max_chunks
    if cluster is None:
        cluster = window_chunks(layer.index.chunk_size, "SHOAL_LAZY_MISS_CLUSTER_KB")
    if cap <= 0 and cluster <= 1:
        return None

    def fetch(chunks: list[int]) -> None:
        try:
            layer.ensure_chunks(chunks)
        except (ShoalError, OSError) as e:
            log.info("%s: read-ahead of chunks %d-%d failed: %s", name, chunks[0], chunks[-1], e)
            ra.forget([j for j in chunks if not layer.cache.has(layer.index.chunks[j])])

    def submit(chunks: list[int]) -> None:
        try:
            pool.submit(fetch, chunks)
        except RuntimeError:  # the pool is shut down (the daemon is exiting): demand reads only
            ra.forget(chunks)

    n = len(layer.index.chunks)
    if budget is None:
        budget = budget_chunks(n, layer.index.chunk_size)
    ra = ChunkReadahead(n, cap, submit, lambda i: layer.cache.has(layer.index.chunks[i]), cluster, budget)
    return ra
