"""Training data from annotation trees.

- `sft`: every good dialog, as TRL's conversational {"messages": [...]} rows.
- `preference_pairs`: TRL DPO rows {"prompt", "chosen", "rejected"} of two kinds:
  fork pairs: each rejected dialog (labelled bad, or superseded by a correction of it) against the
  good dialog sharing the longest token prefix with it (ties: the latest);
  outcome pairs: each good dialog against each dialog labelled bad that no correction connects it
  to (no shared fork), the whole response's outcome.
- `token_level`: per fork pair, the minimal span around the first differing token that round-trips
  through decode/encode, split [prefix: weight 0, patch: weight, suffix: weight 0]. The chosen patch
  gets +1; the rejected patch -1 if it is a single token, else 0 (masked: a multi-token rejected span
  holds good tokens too). `weighted_nll` trains on these rows through shoal.train.hf.
- `corrections`: find-and-replace pairs (the response before a correction, the span replaced, its
  replacement) for a model that corrects responses.
"""
from __future__ import annotations

from typing import Any

from .tokens import Tokenizer, text_of
from .tree import Node, Tree


def prompt_messages(tree: Tree) -> list[dict]:
    p = tree.prompt
    return list(p["messages"]) if "messages" in p else [{"role": "user", "content": p["text"]}]


def prompt_text(tree: Tree, tok: Tokenizer) -> str:
    return text_of(tok, tree.prompt_ids)


def good_nodes(tree: Tree) -> list[Node]:
    return [n for n in tree.nodes if n.is_good]


def sft(trees: list[Tree], tok: Tokenizer, latest_only: bool = False) -> list[dict]:
    rows = []
    for t in trees:
        good = good_nodes(t)
        for n in good[-1:] if latest_only else good:
            rows.append({"messages": prompt_messages(t) + response_messages(text_of(tok, n.tokens)),
                         "item_id": t.item_id, "node": n.id})
    return rows


def response_messages(text: str) -> list[dict]:
    """A response as chat messages: an agent step's tool outputs (run in a branch of the episode,
    annotate.agent) become tool turns between the assistant's."""
    from .agent import render_observation

    head, tail = render_observation("\0").split("\0")
    out: list[dict] = []
    while head in text:
        before, _, rest = text.partition(head)
        obs, sep, text = rest.partition(tail)
        if not sep:  # an unclosed output: not one the app wrote; keep the text as it is
            text = before + head + rest
            break
        out += [{"role": "assistant", "content": before}, {"role": "tool", "content": obs}]
    return out + [{"role": "assistant", "content": text}]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def rejected_nodes(tree: Tree) -> list[Node]:
    """Dialogs labelled bad, and dialogs an annotator corrected (the correction says they went wrong)."""
    corrected = {n.parent for n in tree.nodes if n.op == "correct" and not n.hidden}
    return [n for n in tree.nodes if not n.hidden and n.label != "good" and (n.label == "bad" or n.id in corrected)]


def fork_pairs(tree: Tree) -> list[tuple[Node, Node]]:
    """(chosen, rejected) per rejected dialog: the good dialog with the longest shared prefix."""
    good = good_nodes(tree)
    pairs = []
    for r in rejected_nodes(tree):
        best: Node | None = None
        best_len = -1
        for g in good:  # nodes are in creation order: >= keeps the latest of equals
            n = common_prefix(g.tokens, r.tokens)
            if n >= best_len and g.tokens != r.tokens:
                best, best_len = g, n
        if best is not None:
            pairs.append((best, r))
    return pairs


def outcome_pairs(tree: Tree) -> list[tuple[Node, Node]]:
    forked = {(c.id, r.id) for c, r in fork_pairs(tree)}
    bad = [n for n in tree.nodes if not n.hidden and n.label == "bad"]
    return [(g, b) for g in good_nodes(tree) for b in bad if (g.id, b.id) not in forked]


def preference_pairs(trees: list[Tree], tok: Tokenizer, kinds: tuple[str, ...] = ("fork", "outcome")) -> list[dict]:
    rows = []
    for t in trees:
        prompt = prompt_text(t, tok)
        for kind, pairs in (("fork", fork_pairs(t)), ("outcome", outcome_pairs(t))):
            if kind not in kinds:
                continue
            for c, r in pairs:
                rows.append({"prompt": prompt, "chosen": text_of(tok, c.tokens), "rejected": text_of(tok, r.tokens),
                             "kind": kind, "item_id": t.item_id, "chosen_node": c.id, "rejected_node": r.id})
    return rows


def _roundtrips(tok: Tokenizer, ids: list[int]) -> bool:
    try:
        return tok.encode(text_of(tok, ids)) == ids and text_of(tok, ids).encode() == b"".join(
            tok.token_bytes(i) for i in ids)
    except Exception:  # a span whose text the tokenizer refuses (bytes of half a character)
        return False


def minimal_patch(tok: Tokenizer, ids: list[int], fork: int) -> tuple[int, int]:
    """The smallest [a, b) with a <= fork < b whose tokens round-trip through decode/encode, so the
    patch is a unit of text as well as of tokens (an emoji split over 3 tokens is one patch). An
    empty remainder (fork == len(ids)) gives (fork, fork)."""
    if fork >= len(ids):
        return len(ids), len(ids)
    for width in range(1, len(ids) + 1):
        for a in range(fork, max(-1, fork - width), -1):
            b = a + width
            if b <= fork or b > len(ids):
                continue
            if _roundtrips(tok, ids[a:b]):
                return a, b
    return 0, len(ids)


def token_level(trees: list[Tree], tok: Tokenizer) -> list[dict]:
    rows = []
    for t in trees:
        for c, r in fork_pairs(t):
            fork = common_prefix(c.tokens, r.tokens)
            for role, node in (("chosen", c), ("rejected", r)):
                a, b = minimal_patch(tok, node.tokens, fork)
                if a == b:
                    continue
                if role == "chosen":
                    w = 1.0
                else:
                    w = -1.0 if b - a == 1 else 0.0
                weights = [0.0] * a + [w] * (b - a) + [0.0] * (len(node.tokens) - b)
                rows.append({"item_id": t.item_id, "node": node.id, "role": role, "prompt_ids": t.prompt_ids,
                             "response_ids": node.tokens, "weights": weights, "patch": [a, b],
                             "segments": [text_of(tok, node.tokens[:a]), text_of(tok, node.tokens[a:b]),
                                          text_of(tok, node.tokens[b:])]})
    return rows


def corrections(trees: list[Tree], tok: Tokenizer) -> list[dict]:
    rows = []
    for t in trees:
        for n in t.nodes:
            if n.op != "correct" or n.hidden or n.parent is None:
                continue
            parent = t.node(n.parent)
            a_new, b_new = minimal_patch(tok, n.tokens, n.pos)
            a_old, b_old = minimal_patch(tok, parent.tokens, n.pos)
            a = min(a_new, a_old)
            rows.append({"item_id": t.item_id, "prompt": prompt_text(t, tok), "response": text_of(tok, parent.tokens),
                         "context": text_of(tok, parent.tokens[:a]), "find": text_of(tok, parent.tokens[a:b_old]),
                         "replace": text_of(tok, n.tokens[a:b_new])})
    return rows


def weighted_nll(model: Any, rows: list[dict], pad_id: int = 0) -> Any:
    """sum(-w * log pi(token)) / (tokens with w != 0) over token-level rows, through shoal.train.hf's
    masked response positions: +1 raises the chosen patch, -1 lowers a single rejected token."""
    import torch

    from ..train.hf import flatten_responses, next_token_logits, sampled_logprobs

    seqs = [r["prompt_ids"] + r["response_ids"] for r in rows]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    w = torch.zeros((len(rows), width))
    for i, (r, s) in enumerate(zip(rows, seqs, strict=True)):
        ids[i, :len(s)] = torch.tensor(s)
        attn[i, :len(s)] = 1
        w[i, len(r["prompt_ids"]):len(s)] = torch.tensor(r["weights"])
    mask = w != 0
    logits = next_token_logits(model, ids, attn)
    flat, sampled, _rows = flatten_responses(logits, ids, mask)
    logp = sampled_logprobs(flat, sampled)
    return -(w[mask] * logp).sum() / mask.sum().clamp(min=1)
