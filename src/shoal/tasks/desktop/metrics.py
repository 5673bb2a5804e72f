"""Process-level metrics: judge-vs-human agreement and failure modes (issue 18 section 2).

- `one_minus_mae`: 100 * (1 - mean |s_judge - s_human|) over task-level scores in [0, 1] (the
  OSWorld-Pro summary's task-level agreement; the paper's exact definition is unverified).
- `cohen_kappa`: chance-corrected agreement of two labelings (per-subgoal fulfilled yes/no).
- `bootstrap_ci`: a percentile bootstrap interval of any of them, resampling items with a fixed seed.
- `drift`: runs of consecutive steps that advance no subgoal, from per-step labels.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Hashable, Sequence

from ...core.errors import InvalidArgument


def one_minus_mae(judge: Sequence[float], human: Sequence[float]) -> float:
    if len(judge) != len(human) or not judge:
        raise InvalidArgument("1-MAE needs two equally long, non-empty score lists")
    if any(not 0 <= x <= 1 for x in (*judge, *human)):
        raise InvalidArgument("scores must be in [0, 1]")
    return 100 * (1 - sum(abs(a - b) for a, b in zip(judge, human, strict=True)) / len(judge))


def cohen_kappa(a: Sequence[Hashable], b: Sequence[Hashable]) -> float:
    """(p_o - p_e) / (1 - p_e); 1.0 when both labelings are identical and constant (p_e = 1)."""
    if len(a) != len(b) or not a:
        raise InvalidArgument("kappa needs two equally long, non-empty label lists")
    n = len(a)
    po = sum(x == y for x, y in zip(a, b, strict=True)) / n
    cats = set(a) | set(b)
    pe = sum((sum(x == c for x in a) / n) * (sum(y == c for y in b) / n) for c in cats)
    if pe == 1:
        return 1.0 if po == 1 else 0.0
    return (po - pe) / (1 - pe)


def bootstrap_ci(stat: Callable[[Sequence, Sequence], float], a: Sequence, b: Sequence, n: int = 2000,
                 level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of stat(a, b), resampling paired items."""
    if len(a) != len(b) or not a:
        raise InvalidArgument("bootstrap needs paired, non-empty samples")
    rng = random.Random(seed)
    idx = range(len(a))
    vals = []
    for _ in range(n):
        pick = [rng.choice(idx) for _ in idx]
        vals.append(stat([a[i] for i in pick], [b[i] for i in pick]))
    vals.sort()
    lo = vals[int((1 - level) / 2 * n)]
    hi = vals[min(n - 1, int((1 + level) / 2 * n))]
    return lo, hi


def drift(advances: Sequence[bool]) -> dict[str, int]:
    """Runs of steps that advance no subgoal: how many runs, the longest, and the steps in them.
    `advances[i]`: step i fulfilled (or, for labels, was marked as advancing) some subgoal."""
    runs, cur = [], 0
    for adv in advances:
        if adv:
            if cur:
                runs.append(cur)
            cur = 0
        else:
            cur += 1
    if cur:
        runs.append(cur)
    return {"runs": len(runs), "longest": max(runs, default=0), "steps": sum(runs)}
