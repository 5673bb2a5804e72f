"""The diagnosis as training signal: an SFT filter (process score) and a dense step reward.

Process score: the mean over steps of `1 - risk.score` (1 for a trajectory with no flagged step, 0
when every step is critical). FLARE reranks and filters by its reward model's process score; how
it aggregates steps is not public, the mean is Shoal's choice.

Dense reward, gated as in Gated Reward Accumulation (G-RA): each step gets
`r_t = weight * (0.5 - risk.score)` (a safe step +0.5·w, a critical one -0.5·w), and the
trajectory's return is `R = outcome + sum_t r~_t` with

- `gate="gra"` (default, G-RA as published): `r~_t = r_t * 1[outcome >= threshold]`, so a failed
  episode earns no step reward at all, and no step reward can be farmed without solving the task;
- `gate="penalties"`: a failed episode keeps its negative step rewards (which steps were the
  mistakes) and loses the positive ones; a shaping variant, Shoal's, not G-RA's.

FLARE's exact formula is not public (docs/flare.md).
"""
from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

from ..core.errors import InvalidArgument
from .schema import Action, StepDiagnosis, StepView, Trace

Gate = Literal["gra", "penalties", "none"]


def process_score(diagnoses: Sequence[StepDiagnosis]) -> float:
    """Mean of 1 - risk.score over the steps (1.0 for an episode with no step)."""
    if not diagnoses:
        return 1.0
    return sum(1.0 - d.risk.score for d in diagnoses) / len(diagnoses)


def step_rewards(diagnoses: Sequence[StepDiagnosis], outcome: float, *, weight: float = 0.2,
                 threshold: float = 1.0, gate: Gate = "gra") -> list[float]:
    """The dense reward of each step, after the outcome gate (module docstring)."""
    if gate not in ("gra", "penalties", "none"):
        raise InvalidArgument(f"gate must be gra, penalties or none, got {gate!r}")
    raw = [weight * (0.5 - d.risk.score) for d in sorted(diagnoses, key=lambda d: d.step)]
    if gate == "none" or outcome >= threshold:
        return raw
    if gate == "gra":
        return [0.0] * len(raw)
    return [min(r, 0.0) for r in raw]


def episode_return(diagnoses: Sequence[StepDiagnosis], outcome: float, **kw: Any) -> float:
    """G-RA's R = r_high + sum of the gated step rewards."""
    return outcome + sum(step_rewards(diagnoses, outcome, **kw))


def _place(lengths: Sequence[int], rewards: Sequence[float], outcome: float) -> list[list[float]]:
    """Per-segment token rewards: each step's reward on its segment's last token, the outcome on the
    last token of the last non-empty segment (where a sparse reward would sit)."""
    if len(lengths) != len(rewards):
        raise InvalidArgument(f"{len(lengths)} token segments but {len(rewards)} step rewards")
    out = [[0.0] * n for n in lengths]
    for seg, r in zip(out, rewards):
        if seg:
            seg[-1] += r
    last = next((seg for seg in reversed(out) if seg), None)
    if last is not None:
        last[-1] += outcome
    return out


def record_token_rewards(record: Any, diagnoses: Sequence[StepDiagnosis], **kw: Any) -> list[list[float]]:
    """Per-token rewards aligned with the token ids already in an episode record: one list per
    policy call (`record.turns[i]["token_ids"]`), the same length as that turn's ids. Turn i is step
    i+1 (one policy call per step)."""
    rec = record if isinstance(record, dict) else record.to_dict()
    turns = rec.get("turns") or []
    missing = [i for i, t in enumerate(turns) if t.get("token_ids") is None]
    if missing:
        raise InvalidArgument(f"turns {missing[:5]} have no token_ids (the policy server did not return them)")
    if len(turns) != len(diagnoses):
        raise InvalidArgument(f"{len(turns)} policy turns but {len(diagnoses)} step diagnoses")
    outcome = float(rec.get("reward", 0.0))
    return _place([len(t["token_ids"]) for t in turns], step_rewards(diagnoses, outcome, **kw), outcome)


def agent_loop_token_rewards(output: Any, diagnoses: Sequence[StepDiagnosis], **kw: Any) -> list[float]:
    """Per-token rewards aligned with a verl-shaped `AgentLoopOutput.response_ids`: each run of
    model tokens (response_mask 1) is a turn; tool-output tokens (mask 0) get 0."""
    mask = list(output.response_mask)
    if len(mask) != len(output.response_ids):
        raise InvalidArgument("response_mask and response_ids differ in length")
    runs: list[tuple[int, int]] = []
    i = 0
    while i < len(mask):
        if mask[i]:
            j = i
            while j < len(mask) and mask[j]:
                j += 1
            runs.append((i, j))
            i = j
        else:
            i += 1
    placed = _place([b - a for a, b in runs], step_rewards(diagnoses, float(output.reward_score), **kw),
                    float(output.reward_score))
    flat = [0.0] * len(mask)
    for (a, _), seg in zip(runs, placed):
        flat[a:a + len(seg)] = seg
    return flat


_RESPONSE = re.compile(r"<tool_response>(.*?)</tool_response>", re.S)


def agent_loop_trace(output: Any, tokenizer: Any) -> Trace:
    """The steps of a verl-shaped rollout, read back from its tokens: each run of model tokens is a
    step (its `<tool_call>` blocks the actions, the text around them the thought), and the tool-output
    run after it holds the observations (`<tool_response>` blocks, in order)."""
    from ..rollout.adapters import parse_tool_calls

    mask, ids = list(output.response_mask), list(output.response_ids)
    runs: list[tuple[int, list[int]]] = []
    for m, t in zip(mask, ids):
        if runs and runs[-1][0] == m:
            runs[-1][1].append(t)
        else:
            runs.append((m, [t]))
    steps: list[StepView] = []
    for i, (m, toks) in enumerate(runs):
        if not m:
            continue
        text = tokenizer.decode(toks)
        nxt = runs[i + 1] if i + 1 < len(runs) and not runs[i + 1][0] else None
        obs = _RESPONSE.findall(tokenizer.decode(nxt[1])) if nxt else []
        calls = parse_tool_calls(text)
        actions = [Action(tool=c["name"], arguments=c["arguments"], observation=obs[j] if j < len(obs) else "",
                          error=c["name"] == "__invalid__") for j, c in enumerate(calls)]
        steps.append(StepView(step=len(steps) + 1, thought=re.sub(r"<tool_call>.*?</tool_call>", "", text, flags=re.S),
                              actions=actions))
    extra = getattr(output, "extra_fields", None) or {}
    return Trace(task=str(extra.get("task", "")), steps=steps, resolved=float(output.reward_score) >= 1.0)


def agent_loop_diagnoses(output: Any, tokenizer: Any, diagnoser: Any = None) -> list[StepDiagnosis]:
    """Each step of a verl-shaped rollout diagnosed from its prefix (default: the programmatic rules,
    which see the tool calls only here: there is no probe in a trainer's rollout)."""
    import asyncio

    from .programmatic import ProgrammaticDiagnoser

    dg = diagnoser or ProgrammaticDiagnoser()
    trace = agent_loop_trace(output, tokenizer)
    if hasattr(dg, "diagnose_now"):
        return [dg.diagnose_now(trace.prefix(k)) for k in range(1, len(trace.steps) + 1)]

    async def all_() -> list[StepDiagnosis]:
        return [await dg.diagnose(trace.prefix(k)) for k in range(1, len(trace.steps) + 1)]
    return asyncio.run(all_())


def flare_reward_fn(diagnoses_of: Any = None, *, tokenizer: Any = None, diagnoser: Any = None, **kw: Any):
    """A reward function for the verl-shaped adapter: `fn(output) -> {"reward_score", "token_level_rewards"}`.
    `diagnoses_of(output)` returns the step diagnoses of that rollout (e.g. looked up by
    `output.extra_fields["task"]` and the episode); without it, the rollout is diagnosed from its
    own tokens (`agent_loop_diagnoses` with `tokenizer` and `diagnoser`)."""
    if diagnoses_of is None:
        if tokenizer is None:
            raise InvalidArgument("flare_reward_fn needs diagnoses_of, or a tokenizer to read the rollout's steps")
        diagnoses_of = functools.partial(agent_loop_diagnoses, tokenizer=tokenizer, diagnoser=diagnoser)

    def fn(output: Any) -> dict[str, Any]:
        diags = list(diagnoses_of(output))
        return {"reward_score": episode_return(diags, float(output.reward_score), **kw),
                "token_level_rewards": agent_loop_token_rewards(output, diags, **kw)}

    return fn


# ------------------------------------------------------------------------------------------ SFT
def sft_messages(messages: Sequence[dict]) -> list[dict]:
    """Chat messages as TRL's SFTTrainer (and transformers' chat templates) read them: tool-call
    arguments as objects, not JSON text; no None contents."""
    out = []
    for m in messages:
        msg: dict[str, Any] = {"role": m["role"], "content": m.get("content") or ""}
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = c.get("function", {})
                args = fn.get("arguments") or "{}"
                try:
                    args = json.loads(args) if isinstance(args, str) else args
                except ValueError:
                    args = {"__unparsed__": args}
                calls.append({"type": "function", "function": {"name": fn.get("name", ""), "arguments": args}})
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def rank_for_sft(items: Iterable[tuple[Any, Sequence[StepDiagnosis]]], *, top: int | None = None,
                 min_score: float = 0.0, resolved_only: bool = True) -> list[tuple[float, Any]]:
    """(score, record) best first: resolved episodes (if `resolved_only`) with process score >=
    `min_score`, ranked by process score, then fewer steps."""
    scored = []
    for rec, diags in items:
        d = rec if isinstance(rec, dict) else rec.to_dict()
        if resolved_only and not d.get("resolved"):
            continue
        s = process_score(diags)
        if s >= min_score:
            scored.append((s, -len(diags), d))
    scored.sort(key=lambda x: (x[0], x[1]), reverse=True)
    return [(s, d) for s, _, d in scored[:top]]


def write_sft_jsonl(items: Iterable[tuple[Any, Sequence[StepDiagnosis]]], path: str | os.PathLike, *,
                    tools: list[dict] | None = None, **rank: Any) -> int:
    """Write the kept episodes as TRL SFT rows: {"messages": [...], "tools": [...]} per line (TRL's
    conversational format with tool calls). Returns the number of rows."""
    if tools is None:
        from ..rollout.tools import TOOLS as tools
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    n = 0
    with tmp.open("w") as f:
        for _, d in rank_for_sft(items, **rank):
            f.write(json.dumps({"messages": sft_messages(d["messages"]), "tools": tools}) + "\n")
            n += 1
    os.replace(tmp, p)
    return n
