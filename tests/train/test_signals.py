"""Closed-form and behavioural checks of the OPD token signals (IER, TIP, TA-OPD, budget, MOPD)."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.train import signals as S


def _logp(p) -> torch.Tensor:
    return torch.tensor(p, dtype=torch.float64).log()[None, :]


def test_ier_closed_form_ten_thirteenths():
    # p = (1/2, 1/3, 1/6), c = log p - log q = (0, 1, 2) + const  ->  IER = 10/13
    p = torch.tensor([1 / 2, 1 / 3, 1 / 6], dtype=torch.float64)
    c = torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64) + 0.7
    lq = p.log() - c
    lq = lq - lq.logsumexp(-1)  # any constant shift of c is absorbed by the normalisation
    ier = S.ier_exact(p.log()[None], lq[None])
    assert ier.item() == pytest.approx(10 / 13, rel=1e-9)


@pytest.mark.parametrize("vocab", [3, 5, 17, 64])
def test_uniform_student_gives_one_over_v_minus_two(vocab):
    g = torch.Generator().manual_seed(vocab)
    ls = torch.full((1, vocab), -math.log(vocab), dtype=torch.float64)
    lt = torch.log_softmax(torch.randn(1, vocab, generator=g, dtype=torch.float64), -1)
    assert S.ier_exact(ls, lt).item() == pytest.approx(1 / (vocab - 2), rel=1e-6)


def test_identical_student_and_teacher_give_zero():
    logits = torch.randn(8, 50, dtype=torch.float64)
    assert torch.equal(S.ier_exact(logits, logits), torch.zeros(8, dtype=torch.float64))
    sampled = logits.argmax(-1)
    assert torch.allclose(S.ier_candidates(logits, logits, sampled, k=4), torch.zeros(8, dtype=torch.float64))


def test_candidate_set_equals_exact_when_k_covers_the_vocabulary():
    torch.manual_seed(0)
    s, t = torch.randn(32, 20, dtype=torch.float64), torch.randn(32, 20, dtype=torch.float64) * 2
    sampled = torch.multinomial(torch.softmax(s, -1), 1).squeeze(-1)
    exact = S.ier_exact(s, t)
    assert torch.allclose(S.ier_candidates(s, t, sampled, k=20), exact, rtol=1e-9)
    assert torch.allclose(S.ier_candidates(s, t, sampled, k=20, missing_logprob=None), exact, rtol=1e-9)
    # with a small k the approximation differs (it sees 2k+1 candidates at most, and floors misses)
    assert not torch.allclose(S.ier_candidates(s, t, sampled, k=2), exact)


def test_candidate_set_floors_missing_logprobs_and_clips_the_ratio():
    # vocab 6; student top-1 = 0, teacher top-1 = 5, sampled = 2: candidates {0, 2, 5}
    s = torch.tensor([[5.0, 0.0, 1.0, 0.0, 0.0, -50.0]], dtype=torch.float64)
    t = torch.tensor([[-50.0, 0.0, 1.0, 0.0, 0.0, 5.0]], dtype=torch.float64)
    sampled = torch.tensor([2])
    cand, unique = S.candidate_set(s, t, sampled, k=1)
    assert sorted(cand[unique].tolist()) == [0, 2, 5]
    floored = S.ier_candidates(s, t, sampled, k=1)
    local = S.ier_candidates(s, t, sampled, k=1, missing_logprob=None)
    assert floored.item() != pytest.approx(local.item())  # -12 replaced the exact -55-ish log-probs
    # by hand: student known on {0, 2}, floor on 5; teacher known on {2, 5}, floor on 0
    ls_full, lt_full = torch.log_softmax(s, -1)[0], torch.log_softmax(t, -1)[0]
    ls = torch.stack([ls_full[0], ls_full[2], torch.tensor(-12.0, dtype=torch.float64)])
    lt = torch.stack([torch.tensor(-12.0, dtype=torch.float64), lt_full[2], lt_full[5]])
    ls, lt = ls - ls.logsumexp(0), lt - lt.logsumexp(0)
    expected = S._ier_core(ls[None], lt[None], torch.ones(1, 3, dtype=torch.bool), S.EPS, S.LOGRATIO_CAP)
    assert floored.item() == pytest.approx(expected.item(), rel=1e-9)


def test_usefulness_scores_on_known_distributions():
    uniform = torch.zeros(1, 16)
    assert S.student_topk_entropy(uniform, k=16).item() == pytest.approx(1.0, abs=1e-6)
    peaked = torch.tensor([[20.0] + [0.0] * 15])
    assert S.student_topk_entropy(peaked, k=16).item() < 1e-4
    same = torch.randn(4, 30)
    assert torch.allclose(S.forward_kl_topk_union(same, same, k=5), torch.zeros(4), atol=1e-6)
    assert (S.forward_kl_topk_union(same, -same, k=5) > 0.1).all()
    # teacher mass on the student's top-1: the teacher puts 0.9 on token 0
    s = torch.tensor([[3.0, 0.0, 0.0]])
    t = torch.tensor([[0.9, 0.05, 0.05]]).log()
    assert S.teacher_mass_on_student_topk(s, t, k=1).item() == pytest.approx(0.9, rel=1e-5)


def test_quantile_normalisation_tip_and_ta_opd_stay_in_unit_interval():
    torch.manual_seed(1)
    v = torch.randn(200) * 10
    valid = torch.rand(200) > 0.2
    n = S.quantile_normalize(v, valid)
    assert n[valid].min() == 0 and n[valid].max() == 1 and (n[~valid] == 0).all()
    assert (S.tip_score(v.abs(), v ** 2, valid) <= 1).all() and (S.ta_opd_score(v.abs(), v ** 2, valid) >= 0).all()
    a, b = torch.rand(50), torch.rand(50)
    assert torch.allclose(S.soft_or(a, b), 1 - (1 - a) * (1 - b))


def test_rank_fusion_and_budget_arithmetic():
    ier = torch.tensor([0.5, 0.1, 0.9, 0.3, 0.7, 0.2, 0.8, 0.4, 0.6, 0.0])
    valid = torch.ones(10, dtype=torch.bool)
    r = S.ier_rank(ier, valid)
    assert r[2] == 1 and r[9] == 0 and torch.allclose(r.sort().values, torch.linspace(0, 1, 10))
    resp = torch.tensor([0] * 5 + [1] * 5)
    for budget, expected in ((0.001, 1), (0.1, 1), (0.25, 3), (0.5, 5), (1.0, 10)):
        mask = S.select_budget(r, ier, valid, resp, budget, min_keep=0)
        assert int(mask.sum()) == expected == math.ceil(budget * 10)
    top3 = S.select_budget(r, ier, valid, resp, 0.25, min_keep=0)
    assert top3.nonzero().flatten().tolist() == [2, 4, 6]  # the three highest IER
    assert torch.allclose(S.fuse(torch.full((10,), 0.5), r, "and"), 0.5 * r)
    assert torch.allclose(S.fuse(torch.zeros(10), r, "or"), r)
    with pytest.raises(ValueError, match="fusion mode"):
        S.fuse(r, r, "xor")


def test_min_one_token_per_response_may_exceed_the_budget():
    ier = torch.tensor([0.9, 0.8, 0.7, 0.1, 0.05, 0.2, 0.01])
    score = ier.clone()
    valid = torch.tensor([True, True, True, True, True, True, False])
    resp = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    mask = S.select_budget(score, ier, valid, resp, budget=0.1)  # ceil(0.6) = 1 token: index 0
    assert mask.nonzero().flatten().tolist() == [0, 3, 5]  # + the best of response 1 and of 2
    assert not mask[6]  # invalid tokens are never selected
    none_valid = S.select_budget(score, ier, torch.zeros(7, dtype=torch.bool), resp, 0.5)
    assert not none_valid.any()


def test_ties_are_broken_by_raw_ier_then_position_stably():
    score = torch.tensor([0.5, 0.5, 0.5, 0.5, 0.9])
    ier = torch.tensor([0.1, 0.3, 0.3, 0.2, 0.0])
    valid = torch.ones(5, dtype=torch.bool)
    resp = torch.zeros(5, dtype=torch.long)
    mask = S.select_budget(score, ier, valid, resp, budget=0.6, min_keep=0)  # 3 tokens
    assert mask.nonzero().flatten().tolist() == [1, 2, 4]  # 4 by score; 1 before 2 by position
    equal = S.ier_rank(torch.zeros(4), torch.ones(4, dtype=torch.bool))
    assert equal.tolist() == pytest.approx([0, 1 / 3, 2 / 3, 1])  # stable: row order on ties


def test_non_finite_input_raises_a_clear_error():
    ier = torch.tensor([0.1, float("nan"), 0.3])
    with pytest.raises(ValueError, match="non-finite IER at token positions \\[1\\]"):
        S.ier_rank(ier, torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="non-finite"):
        S.select_budget(torch.ones(3), ier, torch.ones(3, dtype=torch.bool), torch.zeros(3, dtype=torch.long), 0.5)
    # a non-finite value on an invalid (padding) token is ignored
    assert S.ier_rank(ier, torch.tensor([True, False, True])).tolist() == [0, 0, 1]
    with pytest.raises(ValueError, match="budget"):
        S.select_budget(torch.ones(3), torch.ones(3), torch.ones(3, dtype=torch.bool), torch.zeros(3), 0)
    with pytest.raises(ValueError, match="same vocabulary"):
        S.ier_exact(torch.zeros(2, 5), torch.zeros(2, 6))


def test_masked_tokens_get_exactly_zero_gradient():
    torch.manual_seed(2)
    logits = torch.randn(6, 11, requires_grad=True)
    tokens = torch.randint(0, 11, (6,))
    logp_new = torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    logp_old = logp_new.detach() + 0.01 * torch.randn(6)
    logp_teacher = torch.log_softmax(torch.randn(6, 11), -1).gather(-1, tokens[:, None]).squeeze(-1)
    logp_teacher[4] = float("-inf")  # a masked token with a non-finite advantage must not leak NaN
    mask = torch.tensor([1, 0, 1, 0, 0, 1], dtype=torch.bool)
    S.opd_loss(logp_new, logp_old, logp_teacher, mask).backward()
    grad = logits.grad
    assert torch.isfinite(grad).all()
    assert (grad[~mask] == 0).all() and (grad[mask].abs().sum(-1) > 0).all()


def test_opd_loss_pushes_toward_the_teacher_and_is_clipped():
    logp_old = torch.tensor([-2.0, -2.0])
    teacher = torch.tensor([-0.5, -4.0])  # the teacher likes token 0 more, token 1 less
    new = logp_old.clone().requires_grad_(True)
    S.opd_loss(new, logp_old, teacher, torch.ones(2, dtype=torch.bool)).backward()
    assert new.grad[0] < 0 < new.grad[1]  # descent raises log p of token 0, lowers token 1
    far = (logp_old + 1.0).requires_grad_(True)  # ratio e > 1 + 0.28: clipped for a positive advantage
    S.opd_loss(far, logp_old, teacher, torch.tensor([True, False])).backward()
    assert far.grad[0] == 0


def test_exopd_advantage_and_relu_gate():
    ls, lt, lr = torch.tensor([-1.0, -1.0]), torch.tensor([-0.5, -2.0]), torch.tensor([-1.5, -1.0])
    assert torch.allclose(S.exopd_advantage(ls, lt, lr, lam=1.0), lt - ls)  # lam = 1 is plain OPD
    assert torch.allclose(S.exopd_advantage(ls, lt, lr, lam=1.25), 1.25 * (lt - lr) - (ls - lr))
    gated = S.exopd_advantage(ls, lt, lr, lam=1.25, gate="relu")
    # token 0: teacher above reference -> extrapolated; token 1: below -> plain OPD term only
    assert torch.allclose(gated, torch.tensor([0.5 + 0.25 * 1.0, -1.0]))
    assert S.exopd_advantage(torch.tensor([0.0]), torch.tensor([-50.0]), torch.tensor([0.0])).item() == -5.0
    with pytest.raises(ValueError, match="gate"):
        S.exopd_advantage(ls, lt, lr, gate="sigmoid")


def test_mopd_routes_each_label_to_its_teacher_and_rejects_unknown_labels():
    router = S.TeacherRouter({"add": "teacher-add", "sub": "teacher-sub", "mul": "teacher-mul"})
    assert router.route(["mul", "add", "add"]) == ["teacher-mul", "teacher-add", "teacher-add"]
    logps = {name: torch.full((3, 4), float(i)) for i, name in enumerate(["teacher-add", "teacher-sub",
                                                                           "teacher-mul"])}
    picked = router.gather(["sub", "mul", "add"], logps)
    assert picked[:, 0].tolist() == [1.0, 2.0, 0.0]
    with pytest.raises(KeyError, match="div"):
        router.route(["add", "div"])
    with pytest.raises(KeyError, match="produced no log-probs"):
        router.gather(["add"], {"teacher-sub": torch.zeros(1, 4)})
    new = torch.tensor([-1.0, -1.0], requires_grad=True)
    loss = S.mopd_loss(new, new.detach(), torch.tensor([-0.5, -2.0]), torch.tensor([-1.5, -1.0]),
                       torch.ones(2, dtype=torch.bool), gate="relu")
    loss.backward()
    assert new.grad[0] < 0 < new.grad[1]


def _reference_select(score, ier, valid, response_ids, budget, min_keep):
    """The budget rule written as plainly as possible, to check the vectorised one against."""
    idx = [i for i in range(len(score)) if valid[i]]
    order = sorted(idx, key=lambda i: (-float(score[i]), -float(ier[i]), i))
    n_keep = math.ceil(budget * len(idx) - 1e-9)
    keep = set(order[:n_keep])
    counts: dict[int, int] = {}
    for i in keep:
        counts[int(response_ids[i])] = counts.get(int(response_ids[i]), 0) + 1
    for i in order[n_keep:]:
        rid = int(response_ids[i])
        if counts.get(rid, 0) < min_keep:
            keep.add(i)
            counts[rid] = counts.get(rid, 0) + 1
    return sorted(keep)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 60), st.integers(1, 9), st.sampled_from([0.001, 0.05, 0.3, 1.0]), st.integers(0, 3),
       st.integers(0, 10_000))
def test_vectorised_budget_rule_matches_the_plain_one(n, n_resp, budget, min_keep, seed):
    g = torch.Generator().manual_seed(seed)
    score = torch.randint(0, 4, (n,), generator=g).float() / 4  # coarse values: many ties
    ier = torch.randint(0, 3, (n,), generator=g).float()
    valid = torch.rand(n, generator=g) < 0.8
    resp = torch.randint(0, n_resp, (n,), generator=g)
    mask = S.select_budget(score, ier, valid, resp, budget, min_keep=min_keep)
    assert mask.nonzero().flatten().tolist() == _reference_select(score, ier, valid, resp, budget, min_keep)


def test_selectors_sharing_one_token_stats_equal_the_public_functions():
    from shoal.train import selectors

    torch.manual_seed(3)
    s, t = torch.randn(120, 40) * 2, torch.randn(120, 40) * 2
    sampled = torch.multinomial(torch.softmax(s, -1), 1).squeeze(-1)
    valid, rows = torch.ones(120, dtype=torch.bool), torch.arange(120) // 12
    ier = S.ier_candidates(s, t, sampled, k=8)
    rank = S.ier_rank(ier, valid)
    u = S.tip_score(S.student_topk_entropy(s, 8), S.forward_kl_topk_union(s, t, 8), valid)
    expected = S.select_budget(S.fuse(u, rank, "and"), ier, valid, rows, 0.1)
    assert torch.equal(selectors.select("tip+ier-and", 0.1, s, t, sampled, valid, rows, k=8), expected)
    u = S.ta_opd_score(S.forward_kl_topk_union(s, t, 8), S.teacher_mass_on_student_topk(s, t, 8), valid)
    expected = S.select_budget(S.fuse(u, rank, "and"), ier, valid, rows, 0.1)
    assert torch.equal(selectors.select("ta-opd+ier-and", 0.1, s, t, sampled, valid, rows, k=8), expected)
