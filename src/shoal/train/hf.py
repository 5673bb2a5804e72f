"""Hugging Face `transformers` adapters: per-token logits of causal LMs on sampled responses.

Any loop that exposes logits can use shoal.train.signals directly; these helpers cover the common
case of student / teacher / reference `AutoModelForCausalLM`-style models sharing one vocabulary.

Inside TRL's GKD / on-policy distillation trainers, override the loss hook (`compute_loss`) so
that, after the student and teacher forward passes, it flattens the response positions with
`flatten_responses`, builds a mask with `shoal.train.selectors.select(...)` and computes
`signals.opd_loss` (or keeps TRL's loss and multiplies its per-token terms by the mask).
"""
from __future__ import annotations

import torch


def next_token_logits(model, sequences: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Logits predicting sequences[:, 1:], shape [B, T-1, V]."""
    out = model(input_ids=sequences, attention_mask=attention_mask)
    return out.logits[:, :-1, :]


def flatten_responses(logits: torch.Tensor, sequences: torch.Tensor, response_mask: torch.Tensor):
    """Pick the response positions of a batch.

    response_mask [B, T] marks tokens of sequences that the policy generated. Returns
    (logits [N, V], sampled ids [N], response_ids [N]) for those N tokens, in row order."""
    target_mask = response_mask[:, 1:].bool()
    sampled = sequences[:, 1:][target_mask]
    rows = torch.arange(sequences.shape[0], device=sequences.device)[:, None].expand_as(target_mask)
    return logits[target_mask], sampled, rows[target_mask]


def sampled_logprobs(logits: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    """log pi(sampled token) per flattened position: [N]."""
    return torch.log_softmax(logits.float(), -1).gather(-1, sampled[:, None]).squeeze(-1)
