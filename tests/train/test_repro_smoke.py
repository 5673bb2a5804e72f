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


def test_step_by_step_answers_compute_the_right_result():
    pytest.importorskip("transformers")
    import random

    from shoal.train import repro

    rng = random.Random(7)
    for cat in repro.CATEGORIES:
        for _ in range(300):
            prompt, answer = repro.problem(rng, cat)
            assert len(prompt) == repro.PROMPT_LEN and len(answer) == repro.RESPONSE_LEN
            a, b = int(prompt[:3]), int(prompt[4:7])
            cols = answer.rstrip(".").split(",")
            digits = [int(c[-1]) for c in cols]
            carry_out = int(cols[-1][-2])
            value = sum(d * 10 ** i for i, d in enumerate(digits))
            if cat == "add":
                assert value + 1000 * carry_out == a + b
            elif cat == "sub":
                assert carry_out == 0 and value == a - b  # a >= b: no borrow out of the top column
            else:
                assert value + 1000 * carry_out == a * b
            assert all(len(repro.encode(c)) == 8 for c in cols)
    with pytest.raises(ValueError, match="unknown category 'div'"):
        repro.problem(rng, "div")


def test_response_mask_stops_after_the_first_eos_and_cached_decoding_matches_full_forwards():
    pytest.importorskip("transformers")
    from shoal.train import repro

    eos, pad = repro.EOS, repro.PAD
    seqs = torch.tensor([[1] * repro.PROMPT_LEN + [2, eos, 3] + [4] * (repro.RESPONSE_LEN - 3)])
    mask = repro.response_mask(seqs)[0]
    assert mask[:repro.PROMPT_LEN].sum() == 0 and mask[repro.PROMPT_LEN:].tolist()[:4] == [True, True, False, False]
    model = repro.make_model(1, 32, seed=3)
    prompts = ["123+456=", "999*009="]
    out = repro.generate(model, prompts, greedy=True)
    ids = torch.tensor([repro.encode(p) for p in prompts])  # greedy decoding without the KV cache
    for _ in range(repro.RESPONSE_LEN):
        logits = model(input_ids=ids).logits[:, -1]
        logits[:, pad] = float("-inf")
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, ids)


def test_reproduction_smoke_config_runs_end_to_end(tmp_path):
    pytest.importorskip("transformers")
    from shoal.train import repro

    result = repro.run(repro.CONFIGS["smoke"], tmp_path, log=lambda *_: None)  # 2 worker processes
    ckpts = sorted(f.name.split("-")[0] for f in (tmp_path / "checkpoints").glob("*.pt"))
    assert ckpts == ["expert", "expert", "expert", "student", "teacher"]
    saved = json.loads((tmp_path / "opd_repro.json").read_text())
    assert saved["runs"] == json.loads(json.dumps(result["runs"]))
    cfg = repro.CONFIGS["smoke"]
    expected = 1 + len(cfg.selectors) * len([b for b in cfg.budgets if b < 1])
    expected_alt = 1 + len(cfg.alt_selectors) * len(cfg.alt_budgets)
    assert len(result["runs"]) == (expected + expected_alt) * len(cfg.seeds)
    assert {r["lr"] for r in result["runs"]} == {cfg.opd_lr, cfg.alt_lr}
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
    assert "| ier | 0.1 |" in text and "routed+exopd-relu" in text and "**lr 0.001**" in text
    assert (tmp_path / "opd_repro.png").stat().st_size > 10_000
    assert [o["student"] for o in result["overhead"]] == [list(s) for s in cfg.overhead_sizes]
    assert all(o["full_step_ms"] > 0 and o["selector_ms"] > 0 for o in result["overhead"])
    # the report rebuilds from the JSON alone, and a second run reuses the cached checkpoints
    stamp = {f: f.stat().st_mtime_ns for f in (tmp_path / "checkpoints").glob("*.pt")}
    again = repro.run(repro.CONFIGS["smoke"], tmp_path, log=lambda *_: None, workers=1)
    assert {f: f.stat().st_mtime_ns for f in (tmp_path / "checkpoints").glob("*.pt")} == stamp
    assert again["baseline"] == result["baseline"]
    assert repro.report(saved, tmp_path).splitlines()[2:] == text.splitlines()[2:]
    # the lr sweep reuses the run's results where they match (runs are deterministic) and runs the rest
    sweep = repro.lr_sweep(cfg, tmp_path, lrs=(cfg.opd_lr, 3e-4), selectors_=("full", "ier"), budget=0.1,
                           log=lambda *_: None, workers=1)
    assert [(r["lr"], r["selector"]) for r in sweep["runs"]] == [(cfg.opd_lr, "full"), (cfg.opd_lr, "ier"),
                                                                  (3e-4, "full"), (3e-4, "ier")]
    reused = next(r for r in again["runs"] if r["selector"] == "ier" and r["budget"] == 0.1 and r["lr"] == cfg.opd_lr)
    assert sweep["runs"][1] == json.loads(json.dumps(reused))
    assert "| ier |" in (tmp_path / "opd_lr_sweep.md").read_text()
    assert (tmp_path / "opd_lr_sweep.png").stat().st_size > 10_000
    with pytest.raises(FileNotFoundError, match="run the reproduction first"):
        repro.lr_sweep(cfg, tmp_path / "elsewhere", log=lambda *_: None)
