"""Token selection inside TRL's on-policy distillation trainer (`trl.experimental.gkd.GKDTrainer`).

    from shoal.train.trl_gkd import selective_gkd_trainer
    Trainer = selective_gkd_trainer()                 # a GKDTrainer subclass; needs `pip install trl`
    trainer = Trainer(model=student, teacher_model=teacher, args=GKDConfig(lmbda=1.0, beta=1.0, ...),
                      selector="tip+ier-and", budget=0.01, loss="gkd", ...)
    trainer.train()

GKDTrainer samples completions from the student (with probability `lmbda`), runs student and
teacher on them and calls `compute_loss`. The subclass keeps all of that and only overrides
`compute_loss`: it flattens the completion tokens (`labels != -100`), asks the named selector for
a mask over them, and then either

- `loss="gkd"`: TRL's own generalised-JSD loss, restricted to the kept tokens (their labels stay,
  the others become -100), so beta / temperature mean what TRL says they mean; or
- `loss="opd"`: Shoal's sampled-token reverse-KL OPD loss (`signals.opd_loss`) on the kept tokens,
  the loss the IER paper trains with.

`trainer.selection_log` holds (kept tokens, completion tokens) of every step.
"""
from __future__ import annotations

from typing import Any

import torch

from . import selectors, signals
from .hf import flatten_responses, sampled_logprobs


def selective_gkd_trainer():
    """The GKDTrainer subclass (built on first use, so importing Shoal does not need TRL)."""
    try:
        from trl.experimental.gkd import GKDTrainer
    except ImportError as e:  # pragma: no cover - exercised only without trl
        raise ImportError("selective_gkd_trainer needs TRL >= 1.0: "
                          "pip install 'shoal[train]' or pip install trl") from e

    class SelectiveGKDTrainer(GKDTrainer):
        def __init__(self, *args: Any, selector: str = "tip+ier-and", budget: float = 0.01, k: int = signals.DEFAULT_K,
                     loss: str = "gkd", **kwargs: Any):
            if selector not in selectors.SELECTORS:
                raise ValueError(f"unknown selector {selector!r}; choose one of {', '.join(selectors.SELECTORS)}")
            if not 0 < budget <= 1:
                raise ValueError(f"budget must be in (0, 1], got {budget}")
            if loss not in ("gkd", "opd"):
                raise ValueError("loss must be 'gkd' (TRL's JSD on kept tokens) or 'opd' (sampled reverse KL), "
                                 f"got {loss!r}")
            super().__init__(*args, **kwargs)
            self.selector, self.budget, self.k, self.selection_loss = selector, budget, k, loss
            self.selection_log: list[tuple[int, int]] = []

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            student_out = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
            self.teacher_model.eval()
            with torch.no_grad():
                teacher_out = self.teacher_model(input_ids=inputs["input_ids"],
                                                 attention_mask=inputs["attention_mask"])
            s_logits, t_logits = student_out.logits[:, :-1, :], teacher_out.logits[:, :-1, :]
            # completion tokens are the labelled positions (TRL puts -100 on prompt and padding)
            completion = inputs["labels"] != -100
            s_flat, sampled, rows = flatten_responses(s_logits, inputs["labels"], completion)
            t_flat, _, _ = flatten_responses(t_logits, inputs["labels"], completion)
            mask = selectors.select(self.selector, self.budget, s_flat.detach(), t_flat, sampled,
                                    torch.ones_like(sampled, dtype=torch.bool), rows, k=self.k)
            self.selection_log.append((int(mask.sum()), int(mask.numel())))
            if self.selection_loss == "opd":
                logp = sampled_logprobs(s_flat, sampled)
                loss = signals.opd_loss(logp, logp.detach(), sampled_logprobs(t_flat, sampled), mask)
            else:
                kept = inputs["labels"][:, 1:].clone()
                kept[completion[:, 1:]] = torch.where(mask, sampled, torch.full_like(sampled, -100))
                # TRL's own loss over the kept tokens only; its batchmean divides by their count
                loss = self.generalized_jsd_loss(student_logits=s_logits, teacher_logits=t_logits, labels=kept,
                                                 beta=self.beta)
            return (loss, student_out) if return_outputs else loss

    return SelectiveGKDTrainer
