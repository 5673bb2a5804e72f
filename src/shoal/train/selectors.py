"""Named token selectors for OPD: which response tokens keep their loss (see docs/training.md).

`select(name, budget, ...)` returns a boolean loss mask over the flattened response tokens.
Names: full, random, ier, tip, tip+ier-and, ta-opd+ier-and, tip+ier-or.
"""
from __future__ import annotations

import torch

from . import signals as S

SELECTORS = ("full", "random", "ier", "tip", "tip+ier-and", "tip+ier-or", "ta-opd+ier-and")


@torch.no_grad()
def select(name: str, budget: float, student_logits: torch.Tensor, teacher_logits: torch.Tensor,
           sampled: torch.Tensor, valid: torch.Tensor, response_ids: torch.Tensor, *, k: int = S.DEFAULT_K,
           generator: torch.Generator | None = None) -> torch.Tensor:
    if name not in SELECTORS:
        raise ValueError(f"unknown selector {name!r}; choose one of {', '.join(SELECTORS)}")
    if name == "full" or budget >= 1.0:
        return valid.clone()
    n = valid.shape[0]
    if name == "random":
        score = torch.rand(n, generator=generator)
        return S.select_budget(score, torch.zeros(n), valid, response_ids, budget)
    stats = S.TokenStats(student_logits, teacher_logits, k)  # one log-softmax and top-k for every signal
    ier = S.ier_candidates(student_logits, teacher_logits, sampled, k=k, stats=stats).float()
    ier = torch.where(valid, ier, torch.zeros_like(ier))
    rank = S.ier_rank(ier, valid)
    if name == "ier":
        return S.select_budget(rank, ier, valid, response_ids, budget)
    kl = S.forward_kl_topk_union(student_logits, teacher_logits, k, stats=stats)
    if name.startswith("tip"):
        u = S.tip_score(S.student_topk_entropy(student_logits, k, stats=stats), kl, valid)
        if name == "tip":
            return S.select_budget(u, ier, valid, response_ids, budget)
        return S.select_budget(S.fuse(u, rank, "and" if name.endswith("and") else "or"), ier, valid,
                               response_ids, budget)
    u = S.ta_opd_score(kl, S.teacher_mass_on_student_topk(student_logits, teacher_logits, k, stats=stats), valid)
    return S.select_budget(S.fuse(u, rank, "and"), ier, valid, response_ids, budget)
