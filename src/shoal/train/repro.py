"""A small, CPU-only reproduction of IER token selection for on-policy distillation.

Task: integer arithmetic written as characters, e.g. `47+385=` -> `234.` (the answer's digits are
written least-significant first, which a small causal transformer can learn; `.` ends it). Three
categories: add (2-digit + 2-digit), sub (2-digit - smaller), mul (2-digit x 1-digit).

1. A teacher (GPT-2 config, random init, no downloads) is trained by SFT to high accuracy; a
   smaller student gets brief SFT to a weak start.
2. On-policy distillation from that start: each step the student samples answers, the teacher
   scores every sampled token, a selector keeps a budget of tokens, and the reverse-KL OPD loss is
   applied to them. Selectors x budgets x seeds; accuracy after a fixed number of steps and the
   selector's share of the step time.

    python -m shoal.train.repro --config smoke    # seconds; what CI runs
    python -m shoal.train.repro --config full     # the report in docs/ (CPU, <= 45 min)

Writes <out>/opd_repro.json (and, with matplotlib, opd_repro.png).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from . import selectors, signals
from .hf import flatten_responses, next_token_logits, sampled_logprobs

CHARS = "0123456789+-*=."
PAD = len(CHARS)
VOCAB = len(CHARS) + 1
STOI = {c: i for i, c in enumerate(CHARS)}
EOS = STOI["."]
CATEGORIES = ("add", "sub", "mul")


# ------------------------------------------------------------------------------------------ task
def problem(rng: random.Random, category: str) -> tuple[str, str]:
    if category == "add":
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        return f"{a}+{b}=", str(a + b)[::-1] + "."
    if category == "sub":
        a = rng.randint(0, 99)
        b = rng.randint(0, a)
        return f"{a}-{b}=", str(a - b)[::-1] + "."
    a, b = rng.randint(0, 99), rng.randint(0, 9)
    return f"{a}*{b}=", str(a * b)[::-1] + "."


def encode(s: str) -> list[int]:
    return [STOI[c] for c in s]


def batch(rng: random.Random, n: int, categories=CATEGORIES) -> list[tuple[str, str, str]]:
    out = []
    for _ in range(n):
        cat = rng.choice(categories)
        out.append((cat, *problem(rng, cat)))
    return out


def pad(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    t = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), t), PAD, dtype=torch.long)
    mask = torch.zeros((len(seqs), t), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    return ids, mask


# ------------------------------------------------------------------------------------------ models
def make_model(layers: int, width: int, seed: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=width, n_layer=layers, n_head=4,
                     bos_token_id=EOS, eos_token_id=EOS, pad_token_id=PAD)
    return GPT2LMHeadModel(cfg)


def sft(model, steps: int, batch_size: int, lr: float, seed: int, categories=CATEGORIES) -> None:
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    model.train()
    for step in range(steps):
        items = batch(rng, batch_size, categories)
        ids, attn = pad([encode(p + a) for _, p, a in items])
        labels = ids.clone()
        for i, (_, p, _) in enumerate(items):
            labels[i, :len(p)] = -100  # learn the answer only
        labels[attn == 0] = -100
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        for g in opt.param_groups:  # warm-up over 50 steps, then cosine decay (set before the step)
            g["lr"] = lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / steps))
        opt.zero_grad()
        loss.backward()
        opt.step()


@torch.no_grad()
def generate(model, prompts: list[str], greedy: bool, gen: torch.Generator | None = None, max_new: int = 6):
    """Left-aligned prompts of equal length are not guaranteed, so decode row by row in one batch
    with right padding and per-row positions: simple and exact for these short sequences."""
    model.eval()
    seqs = [encode(p) for p in prompts]
    done = [False] * len(seqs)
    for _ in range(max_new):
        ids, attn = pad(seqs)
        logits = model(input_ids=ids, attention_mask=attn).logits
        last = attn.sum(1) - 1
        nxt = logits[torch.arange(len(seqs)), last].float()
        nxt[:, PAD] = float("-inf")
        tok = nxt.argmax(-1) if greedy else torch.multinomial(torch.softmax(nxt, -1), 1, generator=gen).squeeze(-1)
        for i, t in enumerate(tok.tolist()):
            if not done[i]:
                seqs[i].append(t)
                done[i] = t == EOS
        if all(done):
            break
    return [s[len(encode(p)):] for s, p in zip(seqs, prompts)]


def accuracy(model, items) -> dict[str, float]:
    outs = generate(model, [p for _, p, _ in items], greedy=True)
    per: dict[str, list[int]] = {c: [] for c in CATEGORIES}
    for (cat, _, ans), out in zip(items, outs):
        per[cat].append(int(out == encode(ans)))
    res = {c: statistics.mean(v) for c, v in per.items() if v}
    res["all"] = statistics.mean(x for v in per.values() for x in v)
    return res


# ------------------------------------------------------------------------------------------ OPD
@dataclass
class RunResult:
    selector: str
    budget: float
    seed: int
    accuracy: dict
    step_s: float
    selector_s: float
    kept_fraction: float


def opd_run(student0, teacher, selector: str, budget: float, seed: int, steps: int, batch_size: int, lr: float,
            test_items, teacher_for=None, ref=None, lam: float = 1.0, gate: str = "none") -> RunResult:
    """On-policy distillation from a copy of student0. teacher_for(category) routes each task to its
    category expert (MOPD); with `ref`, the advantage is ExOPD's extrapolation (lam, gate)."""
    import copy

    student = copy.deepcopy(student0)
    opt = torch.optim.AdamW(student.parameters(), lr=lr)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    step_times, sel_times, kept = [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        items = batch(rng, batch_size)
        prompts = [p for _, p, _ in items]
        responses = generate(student, prompts, greedy=False, gen=gen)
        seqs = [encode(p) + r for p, r in zip(prompts, responses)]
        ids, attn = pad(seqs)
        resp_mask = torch.zeros_like(ids, dtype=torch.bool)
        for i, p in enumerate(prompts):
            resp_mask[i, len(p):len(seqs[i])] = True
        # dropout off: with it, the forward that gives log pi_s (the advantage) and the gradient is a
        # different random network every step, and OPD measurably degrades the student (training.md)
        student.eval()
        s_logits, sampled, rows = flatten_responses(next_token_logits(student, ids, attn), ids, resp_mask)
        with torch.no_grad():
            if teacher_for is None:
                t_logits, _, _ = flatten_responses(next_token_logits(teacher, ids, attn), ids, resp_mask)
            else:  # label-routed: each row's logits from its category's expert
                per_row = {}
                for cat in set(c for c, _, _ in items):
                    per_row[cat] = next_token_logits(teacher_for(cat), ids, attn)
                full = torch.stack([per_row[c][i] for i, (c, _, _) in enumerate(items)])
                t_logits, _, _ = flatten_responses(full, ids, resp_mask)
        valid = torch.ones_like(sampled, dtype=torch.bool)
        ts = time.perf_counter()
        mask = selectors.select(selector, budget, s_logits.detach(), t_logits, sampled, valid, rows, generator=gen)
        sel_times.append(time.perf_counter() - ts)
        logp = sampled_logprobs(s_logits, sampled)
        if ref is None:
            loss = signals.opd_loss(logp, logp.detach(), sampled_logprobs(t_logits, sampled), mask)
        else:
            with torch.no_grad():
                r_logits, _, _ = flatten_responses(next_token_logits(ref, ids, attn), ids, resp_mask)
            loss = signals.mopd_loss(logp, logp.detach(), sampled_logprobs(t_logits, sampled),
                                     sampled_logprobs(r_logits, sampled), mask, lam=lam, gate=gate)
        opt.zero_grad()
        loss.backward()
        opt.step()
        kept.append(float(mask.float().mean()))
        step_times.append(time.perf_counter() - t0)
    return RunResult(selector, budget, seed, accuracy(student, test_items), statistics.median(step_times),
                     statistics.median(sel_times), statistics.mean(kept))


# ------------------------------------------------------------------------------------------ configs
@dataclass
class Config:
    teacher: tuple = (3, 128)
    student: tuple = (2, 64)
    teacher_steps: int = 3000
    student_steps: int = 250
    opd_steps: int = 150
    batch_size: int = 64
    opd_lr: float = 5e-4
    budgets: tuple = (0.001, 0.01, 0.1, 1.0)
    selectors: tuple = ("random", "ier", "tip", "tip+ier-and", "ta-opd+ier-and")
    seeds: tuple = (0, 1, 2)
    test_n: int = 600
    expert_steps: int = 1500
    mopd: bool = True
    extra: dict = field(default_factory=dict)


CONFIGS = {
    "smoke": Config(teacher=(2, 32), student=(1, 32), teacher_steps=30, student_steps=10, opd_steps=3,
                    batch_size=16, budgets=(0.1, 1.0), selectors=("random", "ier", "tip+ier-and"), seeds=(0,),
                    test_n=30, expert_steps=10),
    "full-no-mopd": Config(mopd=False),
    "full": Config(),
}


def run(config: Config, out: Path, log=print) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    test_items = batch(random.Random(12345), config.test_n)
    t0 = time.perf_counter()
    teacher = make_model(*config.teacher, seed=100)
    sft(teacher, config.teacher_steps, 128, 3e-3, seed=1)
    student0 = make_model(*config.student, seed=200)
    sft(student0, config.student_steps, 64, 3e-3, seed=2)
    base = {"teacher": accuracy(teacher, test_items), "student": accuracy(student0, test_items)}
    log(f"teacher {base['teacher']['all']:.3f}  student start {base['student']['all']:.3f}  "
        f"({time.perf_counter() - t0:.0f} s)")
    runs: list[RunResult] = []
    plan = [("full", 1.0)] + [(s, b) for b in config.budgets if b < 1.0 for s in config.selectors]
    for sel, budget in plan:
        for seed in config.seeds:
            r = opd_run(student0, teacher, sel, budget, seed, config.opd_steps, config.batch_size, config.opd_lr,
                        test_items)
            runs.append(r)
            log(f"{sel:>15} budget {budget:<6} seed {seed}: acc {r.accuracy['all']:.3f} "
                f"kept {r.kept_fraction:.4f} step {r.step_s * 1000:.0f} ms selector {r.selector_s * 1000:.1f} ms")
    result = {"config": asdict(config), "baseline": base, "runs": [asdict(r) for r in runs]}
    if config.mopd:
        result["mopd"] = mopd(config, student0, teacher, test_items, log)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    (out / "opd_repro.json").write_text(json.dumps(result, indent=1))
    return result


def mopd(config: Config, student0, pooled, test_items, log=print) -> dict:
    """Category experts distilled into one student: pooled teacher vs label-routed vs routed + ExOPD."""
    import copy

    experts = {}
    for i, cat in enumerate(CATEGORIES):
        experts[cat] = make_model(*config.teacher, seed=300 + i)
        sft(experts[cat], config.expert_steps, 128, 3e-3, seed=10 + i, categories=(cat,))
    expert_acc = {c: accuracy(m, [x for x in test_items if x[0] == c])[c] for c, m in experts.items()}
    base = accuracy(student0, test_items)
    log(f"experts {expert_acc}  student {base}")
    router = signals.TeacherRouter({c: c for c in CATEGORIES})
    ref = copy.deepcopy(student0).eval()  # the common base the experts' gains are measured from
    variants = {
        "pooled": dict(teacher_for=None),
        "routed": dict(teacher_for=lambda c: experts[router.route([c])[0]]),
        "routed+exopd": dict(teacher_for=lambda c: experts[router.route([c])[0]], ref=ref, lam=1.25),
        "routed+exopd-relu": dict(teacher_for=lambda c: experts[router.route([c])[0]], ref=ref, lam=1.25,
                                  gate="relu"),
    }
    out: dict = {"experts": expert_acc, "student": base, "variants": {}}
    for name, kw in variants.items():
        accs = [opd_run(student0, pooled, "full", 1.0, seed, config.opd_steps, config.batch_size, config.opd_lr,
                        test_items, **kw).accuracy for seed in config.seeds]
        mean = {c: statistics.mean(a[c] for a in accs) for c in (*CATEGORIES, "all")}
        gains = {c: mean[c] - base[c] for c in CATEGORIES}
        recovery = {c: (mean[c] - base[c]) / (expert_acc[c] - base[c]) if expert_acc[c] != base[c] else None
                    for c in CATEGORIES}
        out["variants"][name] = {"accuracy": mean, "per_seed": accs, "gain": gains,
                                 "smallest_gain": min(gains.values()), "recovery": recovery}
        log(f"MOPD {name:>18}: {mean}  smallest gain {min(gains.values()):+.3f}")
    return out


def summarize(result: dict) -> dict:
    """Mean and spread (min..max over seeds) of accuracy per (selector, budget), and selector overhead."""
    groups: dict[tuple, list[dict]] = {}
    for r in result["runs"]:
        groups.setdefault((r["selector"], r["budget"]), []).append(r)
    full_step = statistics.median(r["step_s"] for r in groups.get(("full", 1.0), [])) if ("full", 1.0) in groups \
        else None
    rows = []
    for (sel, budget), rs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        acc = [r["accuracy"]["all"] for r in rs]
        sel_s = statistics.median(r["selector_s"] for r in rs)
        rows.append({"selector": sel, "budget": budget, "acc_mean": statistics.mean(acc), "acc_min": min(acc),
                     "acc_max": max(acc), "kept": statistics.mean(r["kept_fraction"] for r in rs),
                     "step_ms": 1000 * statistics.median(r["step_s"] for r in rs),
                     "selector_overhead_pct": 100 * sel_s / full_step if full_step else None})
    return {"rows": rows}


def report(result: dict, out: Path) -> str:
    """Markdown tables (and a PNG when matplotlib is there) of a run's results."""
    summ = summarize(result)
    lines = [f"teacher accuracy {result['baseline']['teacher']['all']:.3f}, student start "
             f"{result['baseline']['student']['all']:.3f}", "",
             "| selector | budget | accuracy mean (min..max) | kept | step | selector overhead vs full-OPD step |",
             "|---|---:|---|---:|---:|---:|"]
    for r in summ["rows"]:
        ov = f"{r['selector_overhead_pct']:+.1f}%" if r["selector_overhead_pct"] is not None else ""
        lines.append(f"| {r['selector']} | {r['budget']:g} | {r['acc_mean']:.3f} ({r['acc_min']:.3f}..{r['acc_max']:.3f})"
                     f" | {r['kept']:.4f} | {r['step_ms']:.0f} ms | {ov} |")
    if "mopd" in result:
        m = result["mopd"]
        lines += ["", f"experts: {json.dumps({k: round(v, 3) for k, v in m['experts'].items()})}; student start: "
                      f"{json.dumps({k: round(v, 3) for k, v in m['student'].items()})}", "",
                  "| MOPD variant | add | sub | mul | all | smallest gain | recovery add/sub/mul |",
                  "|---|---:|---:|---:|---:|---:|---|"]
        for name, v in m["variants"].items():
            a, rec = v["accuracy"], v["recovery"]
            rec_s = " / ".join("n/a" if rec[c] is None else f"{rec[c]:.2f}" for c in CATEGORIES)
            lines.append(f"| {name} | {a['add']:.3f} | {a['sub']:.3f} | {a['mul']:.3f} | {a['all']:.3f} | "
                         f"{v['smallest_gain']:+.3f} | {rec_s} |")
    text = "\n".join(lines) + "\n"
    (out / "opd_repro.md").write_text(text)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for sel in sorted({r["selector"] for r in summ["rows"]} - {"full"}):
            pts = [r for r in summ["rows"] if r["selector"] == sel]
            ax.errorbar([r["budget"] for r in pts], [r["acc_mean"] for r in pts],
                        yerr=[[r["acc_mean"] - r["acc_min"] for r in pts], [r["acc_max"] - r["acc_mean"] for r in pts]],
                        marker="o", capsize=3, label=sel)
        full = [r for r in summ["rows"] if r["selector"] == "full"]
        if full:
            ax.axhline(full[0]["acc_mean"], color="k", ls="--", label="full OPD")
        ax.axhline(result["baseline"]["student"]["all"], color="grey", ls=":", label="student start")
        ax.set_xscale("log")
        ax.set_xlabel("token budget (fraction of response tokens)")
        ax.set_ylabel("exact-match accuracy")
        ax.set_title("OPD token selection on CPU arithmetic (mean, min..max over seeds)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "opd_repro.png", dpi=120)
        plt.close(fig)
    except ImportError:
        pass
    return text


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", choices=sorted(CONFIGS), default="smoke")
    ap.add_argument("--out", type=Path, default=Path("docs/results"))
    ap.add_argument("--report-only", action="store_true", help="rebuild tables and plot from <out>/opd_repro.json")
    args = ap.parse_args(argv)
    result = json.loads((args.out / "opd_repro.json").read_text()) if args.report_only else \
        run(CONFIGS[args.config], args.out)
    print(report(result, args.out))


if __name__ == "__main__":
    main()
