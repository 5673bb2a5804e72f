"""Token-level training signals for on-policy distillation (OPD), framework-agnostic.

Everything here works on plain tensors of log-probabilities (or logits) with a flat token axis:
`[N, V]` for per-token distributions over a vocabulary, `[N]` for per-token scalars, where the N
tokens are all response tokens of a rollout batch. Selection returns a loss mask; the OPD loss
applies it so that unselected tokens contribute exactly zero gradient.

Definitions follow docs/training.md (IER-OPD, TIP, TA-OPD, ExOPD, label-routed MOPD).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

EPS = 1e-8
LOGRATIO_CAP = 30.0
MISSING_LOGPROB = -12.0
DEFAULT_K = 16


# ------------------------------------------------------------------------------------------ IER
def _ier_core(ls: torch.Tensor, lt: torch.Tensor, valid: torch.Tensor, eps: float, cap: float) -> torch.Tensor:
    """IER over the entries `valid` of each row; ls/lt are log-probs already normalised there."""
    p = torch.where(valid, ls.exp(), torch.zeros_like(ls))
    c = torch.where(valid, (ls - lt).clamp(-cap, cap), torch.zeros_like(ls))
    mean_c = (p * c).sum(-1, keepdim=True)
    signal = (p * (c - mean_c) ** 2).sum(-1)  # Var_p[c]
    # p * L with leverage L = 1/p - 1, written as p/max(p, eps) - p so tiny p stays finite
    pl = torch.where(valid, p / p.clamp_min(eps) - p, torch.zeros_like(p))
    e_l = pl.sum(-1, keepdim=True)
    e_cl = (pl * c).sum(-1, keepdim=True)
    b_star = torch.where(e_l.abs() > eps, e_cl / e_l.clamp_min(eps), mean_c)  # optimal scalar baseline
    second = (pl * (c - b_star) ** 2).sum(-1)  # E_p[(c - b*)^2 L]
    noise = (second - signal).clamp_min(0.0)
    return signal / noise.clamp_min(eps)


def ier_exact(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, *, eps: float = EPS,
              cap: float = LOGRATIO_CAP) -> torch.Tensor:
    """Per-token IER over the full vocabulary: Var_p[c] / max(E_p[(c - b*)^2 L] - Var_p[c], eps),
    c = log p - log q, L = 1/p - 1, b* = E_p[cL] / E_p[L]. Inputs [N, V] log-probs (or logits)."""
    _check_pair(student_logprobs, teacher_logprobs)
    ls = torch.log_softmax(student_logprobs.double(), -1)
    lt = torch.log_softmax(teacher_logprobs.double(), -1)
    return _ier_core(ls, lt, torch.ones_like(ls, dtype=torch.bool), eps, cap).to(student_logprobs.dtype)


class TokenStats:
    """Per-token log-probs and top-k of student and teacher, computed once and shared by every signal.

    Log-softmax runs in the input's precision (at least float32): over a real vocabulary a float64
    copy of [N, V] costs more than the whole selector; the small candidate-set math is float64."""

    def __init__(self, student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, k: int = DEFAULT_K):
        _check_pair(student_logprobs, teacher_logprobs)
        dtype = torch.promote_types(student_logprobs.dtype, torch.float32)
        self.ls = torch.log_softmax(student_logprobs.to(dtype), -1)
        self.lt = torch.log_softmax(teacher_logprobs.to(dtype), -1)
        self.k = min(k, self.ls.shape[-1])
        self.s_top, self.s_ids = self.ls.topk(self.k, -1)
        self.t_top, self.t_ids = self.lt.topk(self.k, -1)

    @classmethod
    def of(cls, student_logprobs, teacher_logprobs, k: int, stats: TokenStats | None) -> TokenStats:
        return stats if stats is not None and stats.k == min(k, student_logprobs.shape[-1]) else \
            cls(student_logprobs, teacher_logprobs, k)


def _union(*ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise concatenation of id sets, each unique within its row, and a mask of first occurrences.

    An id is a repeat if an earlier set of the row holds it: k x k comparisons per pair of sets,
    cheaper than sorting the concatenation, and independent of the vocabulary size."""
    cand = torch.cat(ids, -1)
    unique = [torch.ones_like(ids[0], dtype=torch.bool)]
    for i in range(1, len(ids)):
        seen = torch.cat(ids[:i], -1)
        unique.append(~(ids[i][:, :, None] == seen[:, None, :]).any(-1))
    return cand, torch.cat(unique, -1)


def candidate_set(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, sampled: torch.Tensor,
                  k: int = DEFAULT_K) -> tuple[torch.Tensor, torch.Tensor]:
    """C = student top-k ∪ teacher top-k ∪ {sampled}: ids [N, 2k+1] and a mask of their first occurrences."""
    k = min(k, student_logprobs.shape[-1])
    return _union(student_logprobs.topk(k, -1).indices, teacher_logprobs.topk(k, -1).indices,
                  sampled.long()[:, None])


def ier_candidates(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, sampled: torch.Tensor, *,
                   k: int = DEFAULT_K, missing_logprob: float | None = MISSING_LOGPROB, eps: float = EPS,
                   cap: float = LOGRATIO_CAP, stats: TokenStats | None = None) -> torch.Tensor:
    """IER on the candidate set, as with a serving API that returns only top-k log-probs.

    A candidate outside one side's top-k (and not the sampled token, whose log-prob both sides
    report exactly) has no log-prob there and gets `missing_logprob` (-12); both sides are then
    renormalised over the set and c is clipped to +-cap. missing_logprob=None uses the exact
    log-probs of local logits instead. With k >= V this equals ier_exact. A candidate tied with a
    side's k-th log-prob counts as inside that side's top-k."""
    st = TokenStats.of(student_logprobs, teacher_logprobs, k, stats)
    if sampled.shape != st.ls.shape[:1]:
        raise ValueError(f"sampled must be [N] = {tuple(st.ls.shape[:1])}, got {tuple(sampled.shape)}")
    sampled = sampled.long()[:, None]
    cand, unique = _union(st.s_ids, st.t_ids, sampled)
    ls, lt = st.ls.gather(-1, cand), st.lt.gather(-1, cand)
    if missing_logprob is not None:
        is_sampled = cand == sampled
        ls = torch.where((ls >= st.s_top[:, -1:]) | is_sampled, ls, torch.full_like(ls, missing_logprob))
        lt = torch.where((lt >= st.t_top[:, -1:]) | is_sampled, lt, torch.full_like(lt, missing_logprob))
    neg_inf = torch.full_like(ls, float("-inf"), dtype=torch.float64)
    ls = torch.where(unique, ls.double(), neg_inf)
    lt = torch.where(unique, lt.double(), neg_inf)
    ls = ls - ls.logsumexp(-1, keepdim=True)  # renormalise over C
    lt = lt - lt.logsumexp(-1, keepdim=True)
    return _ier_core(ls, lt, unique, eps, cap).to(student_logprobs.dtype)


# ------------------------------------------------------------------------------------------ usefulness
def student_topk_entropy(student_logprobs: torch.Tensor, k: int = DEFAULT_K, *,
                         stats: TokenStats | None = None) -> torch.Tensor:
    """Entropy of the student's top-k (renormalised), divided by log k: in [0, 1]."""
    st = TokenStats.of(student_logprobs, student_logprobs, k, stats)
    top = st.s_top - st.s_top.logsumexp(-1, keepdim=True)
    h = -(top.exp() * top).sum(-1).float()
    return h / math.log(st.k) if st.k > 1 else torch.zeros_like(h)


def forward_kl_topk_union(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                          k: int = DEFAULT_K, floor: float = 1e-12, *, stats: TokenStats | None = None) -> torch.Tensor:
    """KL(teacher || student) on the union of both top-k ids, each renormalised over the union."""
    st = TokenStats.of(student_logprobs, teacher_logprobs, k, stats)
    ids, unique = _union(st.s_ids, st.t_ids)
    zero = torch.zeros((), dtype=st.ls.dtype)
    p = torch.where(unique, st.ls.gather(-1, ids).exp(), zero)
    q = torch.where(unique, st.lt.gather(-1, ids).exp(), zero)
    p = (p / p.sum(-1, keepdim=True)).clamp_min(floor)
    q = (q / q.sum(-1, keepdim=True)).clamp_min(floor)
    return torch.where(unique, q * (q.log() - p.log()), zero).sum(-1).float()


def teacher_mass_on_student_topk(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                                 k: int = DEFAULT_K, *, stats: TokenStats | None = None) -> torch.Tensor:
    """Teacher probability mass on the student's top-k ids ("teachability")."""
    st = TokenStats.of(student_logprobs, teacher_logprobs, k, stats)
    return st.lt.gather(-1, st.s_ids).exp().sum(-1).float()


def quantile_normalize(values: torch.Tensor, valid: torch.Tensor, lo: float = 0.05, hi: float = 0.95) -> torch.Tensor:
    """clip((v - Q_lo) / (Q_hi - Q_lo), 0, 1) with quantiles over the valid tokens of the batch."""
    out = torch.zeros_like(values, dtype=torch.float32)
    v = values[valid].float()
    if v.numel() == 0:
        return out
    q_lo, q_hi = torch.quantile(v, lo), torch.quantile(v, hi)
    span = q_hi - q_lo
    if span <= 0:
        out[valid] = 0.0
        return out
    out[valid] = ((v - q_lo) / span).clamp(0.0, 1.0)
    return out


def soft_or(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a + b - a * b


def tip_score(entropy: torch.Tensor, kl: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """TIP: soft-OR of batch-normalised student entropy and teacher-student KL."""
    return soft_or(quantile_normalize(entropy, valid), quantile_normalize(kl, valid))


def ta_opd_score(kl: torch.Tensor, teacher_mass: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """TA-OPD: normalised KL times normalised teacher mass on the student's top-k."""
    return quantile_normalize(kl, valid) * quantile_normalize(teacher_mass, valid)


# ------------------------------------------------------------------------------------------ fusion and budget
def ier_rank(ier: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Ordinal rank of raw IER over the valid tokens, scaled to [0, 1] (stable on ties; 0 elsewhere)."""
    if not torch.isfinite(ier[valid]).all():
        bad = (~torch.isfinite(ier) & valid).nonzero().flatten()[:5].tolist()
        raise ValueError(f"non-finite IER at token positions {bad}: check the log-probs fed to ier_*()")
    idx = valid.nonzero().flatten()
    r = torch.zeros_like(ier, dtype=torch.float32)
    n = idx.numel()
    if n > 1:
        order = ier[idx].argsort(stable=True)
        r[idx[order]] = torch.arange(n, dtype=torch.float32) / (n - 1)
    return r


def fuse(usefulness: torch.Tensor, rank: torch.Tensor, mode: str = "and") -> torch.Tensor:
    """IER-AND = u * r, IER-OR = u + r - u * r."""
    if mode == "and":
        return usefulness * rank
    if mode == "or":
        return soft_or(usefulness, rank)
    raise ValueError(f"fusion mode must be 'and' or 'or', got {mode!r}")


def select_budget(score: torch.Tensor, ier: torch.Tensor, valid: torch.Tensor, response_ids: torch.Tensor,
                  budget: float, min_keep: int = 1) -> torch.Tensor:
    """Loss mask keeping ceil(budget * N_valid) tokens globally, ordered by (score, raw IER) descending
    and then position; afterwards at least `min_keep` tokens of every response with valid tokens."""
    if not 0 < budget <= 1:
        raise ValueError(f"budget must be in (0, 1], got {budget}")
    if not (score.shape == ier.shape == valid.shape == response_ids.shape) or score.dim() != 1:
        raise ValueError("score, ier, valid and response_ids must be 1-D tensors of the same length")
    if not torch.isfinite(ier[valid]).all() or not torch.isfinite(score[valid]).all():
        raise ValueError("non-finite score or IER among valid tokens")
    idx = valid.nonzero().flatten()
    mask = torch.zeros_like(valid)
    if idx.numel() == 0:
        return mask
    # stable sorts, least significant key first: position, then -IER, then -score
    order = idx  # ascending position
    order = order[torch.argsort(-ier[order].double(), stable=True)]
    order = order[torch.argsort(-score[order].double(), stable=True)]
    n_keep = math.ceil(budget * idx.numel() - 1e-9)
    mask[order[:n_keep]] = True
    if min_keep > 0 and n_keep < order.numel():
        # each response short of min_keep gets its best remaining tokens in the same global order:
        # group the remaining tokens by response (stable, so the order survives) and take each
        # group's first (min_keep - already kept)
        n_resp = int(response_ids.max()) + 1
        kept = torch.zeros(n_resp, dtype=torch.long).index_add_(
            0, response_ids[mask].long(), torch.ones(int(mask.sum()), dtype=torch.long))
        rest = order[n_keep:]
        rid = response_ids[rest].long()
        by_resp = torch.argsort(rid, stable=True)
        rid_sorted = rid[by_resp]
        first = torch.searchsorted(rid_sorted, rid_sorted, right=False)
        rank_in_resp = torch.arange(rid_sorted.numel()) - first
        need = (min_keep - kept).clamp_min(0)
        mask[rest[by_resp][rank_in_resp < need[rid_sorted]]] = True
    return mask


# ------------------------------------------------------------------------------------------ losses
def opd_loss(logp_new: torch.Tensor, logp_old: torch.Tensor, logp_teacher: torch.Tensor, mask: torch.Tensor,
             clip_low: float = 0.2, clip_high: float = 0.28) -> torch.Tensor:
    """Sampled-token reverse-KL OPD with a PPO-clipped surrogate, averaged over the kept tokens.

    Advantage A = -(log pi_s - log pi_T) from the rollout's log-probs (no gradient); masked tokens
    are removed with torch.where, so they contribute exactly zero gradient (no 0 * NaN)."""
    advantage = -(logp_old - logp_teacher).detach()
    return _clipped_surrogate(logp_new, logp_old, advantage, mask, clip_low, clip_high)


def _clipped_surrogate(logp_new, logp_old, advantage, mask, clip_low, clip_high) -> torch.Tensor:
    mask = mask.bool()
    # zero the advantage of dropped tokens first: a where() after the product would still send
    # 0 * inf = NaN back through the ratio of a token whose advantage is not finite
    advantage = torch.where(mask, advantage, torch.zeros_like(advantage))
    ratio = torch.exp(logp_new - logp_old.detach())
    unclipped = ratio * advantage
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * advantage
    per_token = -torch.minimum(unclipped, clipped)
    per_token = torch.where(mask, per_token, torch.zeros_like(per_token))
    return per_token.sum() / mask.sum().clamp_min(1)


def exopd_advantage(logp_student: torch.Tensor, logp_teacher: torch.Tensor, logp_ref: torch.Tensor,
                    lam: float = 1.25, gate: str = "none", clip: float | None = 5.0) -> torch.Tensor:
    """Token advantage with ExOPD reward extrapolation (no gradient).

    gate="none":  A = lam * (log pi_T - log pi_ref) - (log pi_s - log pi_ref)   (ExOPD; lam=1 is OPD)
    gate="relu":  A = (log pi_T - log pi_s) + (lam - 1) * ReLU(log pi_T - log pi_ref)
                  keeps only the teacher's improving direction over the reference. This gated form is
                  a RECONSTRUCTION from the RRE-MOPD paper's wording; its exact equation is unpublished.
    """
    ls, lt, lr = logp_student.detach(), logp_teacher.detach(), logp_ref.detach()
    if gate == "none":
        adv = lam * (lt - lr) - (ls - lr)
    elif gate == "relu":
        adv = (lt - ls) + (lam - 1) * torch.relu(lt - lr)
    else:
        raise ValueError(f"gate must be 'none' or 'relu', got {gate!r}")
    return adv.clamp(-clip, clip) if clip is not None else adv


class TeacherRouter:
    """Label-routed multi-teacher OPD: each task's category label picks its expert teacher."""

    def __init__(self, routing: Mapping[str, str]):
        if not routing:
            raise ValueError("the routing table is empty")
        self.routing = dict(routing)

    def route(self, labels: Sequence[str]) -> list[str]:
        unknown = sorted({label for label in labels if label not in self.routing})
        if unknown:
            raise KeyError(f"no teacher for label(s) {unknown}; routing knows {sorted(self.routing)}")
        return [self.routing[label] for label in labels]

    def gather(self, labels: Sequence[str], teacher_logps: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Per sample, the log-probs of its routed teacher: teacher_logps[name] is [B, T]."""
        names = self.route(labels)
        missing = sorted(set(names) - set(teacher_logps))
        if missing:
            raise KeyError(f"routed teacher(s) {missing} produced no log-probs")
        return torch.stack([teacher_logps[name][i] for i, name in enumerate(names)])


def mopd_loss(logp_new: torch.Tensor, logp_old: torch.Tensor, logp_teacher: torch.Tensor, logp_ref: torch.Tensor,
              mask: torch.Tensor, lam: float = 1.25, gate: str = "none", clip_low: float = 0.2,
              clip_high: float = 0.28, advantage_clip: float | None = 5.0) -> torch.Tensor:
    """OPD loss with the ExOPD (optionally ReLU-gated) advantage against the routed teacher."""
    adv = exopd_advantage(logp_old, logp_teacher, logp_ref, lam=lam, gate=gate, clip=advantage_clip)
    return _clipped_surrogate(logp_new, logp_old, adv, mask, clip_low, clip_high)


def _check_pair(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.shape != b.shape or a.dim() != 2:
        raise ValueError(f"student and teacher must be [N, V] with the same vocabulary, got {tuple(a.shape)} "
                         f"and {tuple(b.shape)}")
