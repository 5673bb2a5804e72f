"""Shoal's token selectors inside TRL's real GKDTrainer (tiny GPT-2 models, character tokenizer)."""
from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("transformers")
trl_gkd = pytest.importorskip("trl.experimental.gkd")

from shoal.train import repro  # noqa: E402
from shoal.train.trl_gkd import selective_gkd_trainer  # noqa: E402


def _tokenizer():
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(repro.CHARS)} | {"<pad>": repro.PAD}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token=".")


def _collate(examples):
    ids = torch.tensor([repro.encode(e["prompt"] + e["completion"]) for e in examples])
    labels = ids.clone()
    labels[:, :repro.PROMPT_LEN] = -100
    prompts = ids[:, :repro.PROMPT_LEN]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels, "prompts": prompts,
            "prompt_attention_mask": torch.ones_like(prompts)}


def _trainer(tmp_path, cls, lmbda=1.0, **kw):
    from datasets import Dataset

    rows = [{"prompt": p, "completion": a} for _, p, a in repro.batch(random.Random(0), 32)]
    args = trl_gkd.GKDConfig(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=8, lmbda=lmbda,
                             beta=1.0, max_new_tokens=repro.RESPONSE_LEN, report_to=[], use_cpu=True,
                             save_strategy="no", learning_rate=1e-3, seed=0)
    return cls(model=repro.make_model(1, 32, 0), teacher_model=repro.make_model(1, 32, 1), args=args,
               train_dataset=Dataset.from_list(rows), processing_class=_tokenizer(), data_collator=_collate, **kw)


@pytest.mark.parametrize("loss", ["gkd", "opd"])
def test_selective_trainer_trains_on_the_selected_tokens_only(tmp_path, loss):
    trainer = _trainer(tmp_path, selective_gkd_trainer(), selector="tip+ier-and", budget=0.1, loss=loss)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert len(trainer.selection_log) == 2
    for kept, total in trainer.selection_log:  # on-policy completions: ceil(10%), plus >= 1 per response
        assert total > 8 and -(-total // 10) <= kept <= -(-total // 10) + 8
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def test_full_budget_gkd_loss_equals_trls_own_loss(tmp_path):
    ours = _trainer(tmp_path, selective_gkd_trainer(), lmbda=0.0, selector="ier", budget=1.0, loss="gkd")
    theirs = _trainer(tmp_path, trl_gkd.GKDTrainer, lmbda=0.0)
    inputs = _collate([{"prompt": p, "completion": a} for _, p, a in repro.batch(random.Random(1), 4)])
    a = ours.compute_loss(ours.model, dict(inputs))
    b = theirs.compute_loss(theirs.model, dict(inputs))
    assert torch.allclose(a, b, rtol=1e-6) and a.item() > 0
    # a budget below 1 changes which tokens count, so the loss differs
    ours.budget = 0.05
    assert not torch.allclose(ours.compute_loss(ours.model, dict(inputs)), b)


def test_bad_selector_settings_are_refused(tmp_path):
    cls = selective_gkd_trainer()
    with pytest.raises(ValueError, match="unknown selector 'loudest'"):
        _trainer(tmp_path, cls, selector="loudest")
    with pytest.raises(ValueError, match="budget must be in"):
        _trainer(tmp_path, cls, budget=0.0)
    with pytest.raises(ValueError, match="loss must be"):
        _trainer(tmp_path, cls, loss="forward")
