"""The OPD reproduction end to end in its tiny smoke configuration, and the named selectors."""
from __future__ import annotations

import json
import math

import pytest
import torch

from shoal.train import selectors
from shoal.train.hf import flatten_responses


def test_selectors_respect_the_budget_and_keep_one_token_per_response():
    torch.manual_seed(0)
    n_resp, per = 8, 25
    s, t = torch.randn(n_resp * per, 15), torch.randn(n_resp * per, 15)
    sampled = torch.multinomial(torch.softmax(s, -1), 1).squeeze(-1)
    valid = torch.ones(n_resp * per, dtype=torch.bool)
    rows = torch.arange(n_resp).repeat_interleave(per)
    for name in selectors.SELECTORS:
        mask = selectors.select(name, 0.1, s, t, sampled, valid, rows, k=4, generator=torch.Generator().manual_seed(1))
        if name == "full":
            assert mask.all()
            continue
        assert math.ceil(0.1 * 200) <= int(mask.sum()) <= math.ceil(0.1 * 200) + n_resp, name
        assert set(rows[mask].tolist()) == set(range(n_resp)), name  # every response keeps a token
    with pytest.raises(ValueError, match="unknown selector"):
        selectors.select("loudest", 0.1, s, t, sampled, valid, rows)


def test_flatten_responses_picks_generated_positions_only():
    seqs = torch.tensor([[5, 6, 7, 8], [5, 9, 1, 0]])
    resp = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 0]], dtype=torch.bool)
    logits = torch.arange(2 * 3 * 2, dtype=torch.float32).reshape(2, 3, 2)  # predicts seqs[:, 1:]
    flat, sampled, rows = flatten_responses(logits, seqs, resp)
    assert sampled.tolist() == [7, 8, 9, 1] and rows.tolist() == [0, 0, 1, 1]
    assert flat.tolist() == [[2, 3], [4, 5], [6, 7], [8, 9]]


def test_reproduction_smoke_config_runs_end_to_end(tmp_path):
    pytest.importorskip("transformers")
    from shoal.train import repro

    result = repro.run(repro.CONFIGS["smoke"], tmp_path, log=lambda *_: None)
    saved = json.loads((tmp_path / "opd_repro.json").read_text())
    assert saved["runs"] == json.loads(json.dumps(result["runs"]))
    cfg = repro.CONFIGS["smoke"]
    expected = 1 + len(cfg.selectors) * len([b for b in cfg.budgets if b < 1])
    assert len(result["runs"]) == expected * len(cfg.seeds)
    for r in result["runs"]:
        assert 0 <= r["accuracy"]["all"] <= 1 and r["step_s"] > 0
        if r["selector"] == "full":
            assert r["kept_fraction"] == 1.0
        else:
            assert r["kept_fraction"] < 1.0 and r["selector_s"] > 0
    mopd = result["mopd"]
    assert set(mopd["variants"]) == {"pooled", "routed", "routed+exopd", "routed+exopd-relu"}
    for v in mopd["variants"].values():
        assert set(v["gain"]) == {"add", "sub", "mul"}
        assert v["smallest_gain"] == min(v["gain"].values())
    text = repro.report(result, tmp_path)
    assert "| ier | 0.1 |" in text and "routed+exopd-relu" in text
    assert (tmp_path / "opd_repro.png").stat().st_size > 10_000
