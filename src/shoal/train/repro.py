"""A small, CPU-only reproduction of IER token selection for on-policy distillation (OPD).

Task: 3-digit integer arithmetic written step by step, one column at a time from the least
significant digit, with the carry (or borrow) made explicit, e.g.

    265+988=  ->  5+8+0=13,6+8+1=15,2+9+1=12.      (each column: x op y +/- carry = carry' digit)
    776-430=  ->  6-0-0=06,7-3-0=04,7-4-0=03.      (sub: the first output digit is the borrow)
    497*006=  ->  7*6+0=42,9*6+4=58,4*6+5=29.      (mul by one digit)

Every prompt is 8 tokens and every correct response 27, so answers are checkable by exact match,
and an early slip (a wrong carry) propagates, which is the exposure-bias setting OPD is for.
Three categories (add, sub, mul) give the label-routed multi-teacher (MOPD) experiment.

1. A teacher (GPT-2 config, random init, no downloads) is trained by SFT to high accuracy, and a
   smaller student by brief SFT to a weak start; one expert teacher per category for MOPD.
   Checkpoints are cached under <out>/checkpoints (delete it, or --fresh, to retrain).
2. OPD from that start: each step the student samples answers, the teacher scores every sampled
   token, a selector keeps a budget of them, and the sampled-token reverse-KL loss trains on those.
   Selectors x budgets x seeds, run on worker processes; accuracy after a fixed number of steps.
3. Selector overhead: the selector's share of an OPD step, for several student sizes.
4. MOPD: pooled teacher vs label-routed experts vs routed + ExOPD extrapolation (plain, ReLU-gated).

    python -m shoal.train.repro --config smoke    # seconds; what CI runs
    python -m shoal.train.repro --config full     # the report in docs/results (CPU, <= 45 min)
    python -m shoal.train.repro --config full --lr-sweep   # then: accuracy vs learning rate

Writes <out>/opd_repro.json, opd_repro.md and opd_repro.png.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import copy
import hashlib
import json
import math
import multiprocessing as mp
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from . import selectors, signals
from .hf import flatten_responses, next_token_logits, sampled_logprobs

CHARS = "0123456789+-*=,."
PAD = len(CHARS)
VOCAB = len(CHARS) + 1
STOI = {c: i for i, c in enumerate(CHARS)}
EOS = STOI["."]
CATEGORIES = ("add", "sub", "mul")
PROMPT_LEN, RESPONSE_LEN = 8, 27


# ------------------------------------------------------------------------------------------ task
def problem(rng: random.Random, category: str) -> tuple[str, str]:
    """(prompt, step-by-step answer) of one problem of `category`."""
    if category == "add":
        a, b, op = rng.randint(0, 999), rng.randint(0, 999), "+"
    elif category == "sub":
        a = rng.randint(0, 999)
        b, op = rng.randint(0, a), "-"
    elif category == "mul":
        a, b, op = rng.randint(0, 999), rng.randint(0, 9), "*"
    else:
        raise ValueError(f"unknown category {category!r}; choose from {CATEGORIES}")
    columns, carry = [], 0
    for i in range(3):
        x = a // 10 ** i % 10
        y = b if category == "mul" else b // 10 ** i % 10
        if category == "sub":
            d = x - y - carry
            hi, lo = int(d < 0), d % 10
            columns.append(f"{x}-{y}-{carry}={hi}{lo}")
        else:
            v = x * y + carry if category == "mul" else x + y + carry
            hi, lo = v // 10, v % 10
            columns.append(f"{x}{op}{y}+{carry}={hi}{lo}")
        carry = hi
    return f"{a:03d}{op}{b:03d}=", ",".join(columns) + "."


def encode(s: str) -> list[int]:
    return [STOI[c] for c in s]


def decode(ids: list[int]) -> str:
    return "".join(CHARS[i] if i < len(CHARS) else "_" for i in ids)


def batch(rng: random.Random, n: int, categories=CATEGORIES) -> list[tuple[str, str, str]]:
    out = []
    for _ in range(n):
        cat = rng.choice(categories)
        out.append((cat, *problem(rng, cat)))
    return out


def test_set(n: int) -> list[tuple[str, str, str]]:
    """n problems, equally many per category, from a fixed seed."""
    rng = random.Random(12345)
    return [(c, *problem(rng, c)) for c in CATEGORIES for _ in range(n // len(CATEGORIES))]


def response_mask(seqs: torch.Tensor) -> torch.Tensor:
    """Generated tokens up to and including the first EOS (later ones are not part of the answer)."""
    resp = seqs[:, PROMPT_LEN:]
    after_eos = ((resp == EOS).long().cumsum(1) - (resp == EOS).long()) > 0
    mask = torch.zeros_like(seqs, dtype=torch.bool)
    mask[:, PROMPT_LEN:] = ~after_eos
    return mask


# ------------------------------------------------------------------------------------------ models
def make_model(layers: int, width: int, seed: int):
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as e:
        raise ImportError("the OPD reproduction needs transformers: pip install 'shoal[train]'") from e

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=PROMPT_LEN + RESPONSE_LEN + 1, n_embd=width, n_layer=layers,
                     n_head=4, bos_token_id=EOS, eos_token_id=EOS, pad_token_id=PAD)
    cfg.loss_type = "ForCausalLM"  # an extra PretrainedConfig field (what the kwarg did): not in GPT2Config's signature
    return GPT2LMHeadModel(cfg)


def sft(model, steps: int, batch_size: int, lr: float, seed: int, categories=CATEGORIES) -> None:
    """Supervised training on gold answers (prompt tokens masked), warm-up then cosine decay."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    model.train()
    for step in range(steps):
        ids = torch.tensor([encode(p + a) for _, p, a in batch(rng, batch_size, categories)])
        labels = ids.clone()
        labels[:, :PROMPT_LEN] = -100  # learn the answer only
        loss = model(input_ids=ids, labels=labels).loss
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / steps))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def _step(model, ids: torch.Tensor, cache):
    """One forward with the KV cache, under either transformers' `cache` (5.x) or `past_key_values`."""
    if cache is None:
        out = model(input_ids=ids, use_cache=True)
    elif _CACHE_KW["kw"] == "cache":
        out = model(input_ids=ids, cache=cache, use_cache=True)
    else:
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    if "cache" in out:
        _CACHE_KW["kw"] = "cache"
        return out.logits[:, -1], out["cache"]
    _CACHE_KW["kw"] = "past_key_values"
    return out.logits[:, -1], out["past_key_values"]


_CACHE_KW = {"kw": "cache"}  # which keyword this transformers version takes, learnt on the first step


@torch.no_grad()
def generate(model, prompts: list[str], greedy: bool, gen: torch.Generator | None = None) -> torch.Tensor:
    """[B, PROMPT_LEN + RESPONSE_LEN] token ids; all prompts have the same length, so one cached batch."""
    model.eval()
    ids = torch.tensor([encode(p) for p in prompts])
    logits, cache = _step(model, ids, None)
    out = []
    for t in range(RESPONSE_LEN):
        logits = logits.float()
        logits[:, PAD] = float("-inf")
        nxt = logits.argmax(-1) if greedy else torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)[:, 0]
        out.append(nxt)
        if t + 1 < RESPONSE_LEN:
            logits, cache = _step(model, nxt[:, None], cache)
    return torch.cat([ids, torch.stack(out, 1)], 1)


def accuracy(model, items) -> dict[str, float]:
    """Exact match of the greedy step-by-step answer, per category and overall."""
    seqs = generate(model, [p for _, p, _ in items], greedy=True)
    per: dict[str, list[int]] = {c: [] for c in CATEGORIES}
    for (cat, _, ans), row in zip(items, seqs[:, PROMPT_LEN:].tolist()):
        per[cat].append(int(row[:len(ans)] == encode(ans)))
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
    variant: str = "opd"
    lr: float = 0.0


def opd_run(student0, teacher, selector: str, budget: float, seed: int, steps: int, batch_size: int, lr: float,
            test_items, teacher_for=None, ref=None, lam: float = 1.0, gate: str = "none",
            advantage_clip: float | None = None, warmup: int = 30) -> RunResult:
    """On-policy distillation from a copy of student0. teacher_for(category) routes each task to its
    category expert (MOPD); with `ref`, the advantage is ExOPD's extrapolation (lam, gate)."""
    student = copy.deepcopy(student0)
    # dropout stays off throughout: with it, the forward that gives the advantage's log pi_s and the
    # gradient would be a different random network each step, which measurably degraded OPD
    student.eval()
    opt = torch.optim.AdamW(student.parameters(), lr=lr, weight_decay=0.0)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    step_times, sel_times, kept = [], [], []
    for step in range(steps):
        t0 = time.perf_counter()
        items = batch(rng, batch_size)
        ids = generate(student, [p for _, p, _ in items], greedy=False, gen=gen)
        resp = response_mask(ids)
        s_logits, sampled, rows = flatten_responses(next_token_logits(student, ids), ids, resp)
        with torch.no_grad():
            if teacher_for is None:
                t_full = next_token_logits(teacher, ids)
            else:  # label-routed: each row's logits come from its category's expert
                t_full = torch.empty(ids.shape[0], ids.shape[1] - 1, VOCAB)
                cats = [c for c, _, _ in items]
                for cat in set(cats):
                    sel_rows = torch.tensor([i for i, c in enumerate(cats) if c == cat])
                    t_full[sel_rows] = next_token_logits(teacher_for(cat), ids[sel_rows])
            t_logits, _, _ = flatten_responses(t_full, ids, resp)
        valid = torch.ones_like(sampled, dtype=torch.bool)
        ts = time.perf_counter()
        mask = selectors.select(selector, budget, s_logits.detach(), t_logits, sampled, valid, rows, generator=gen)
        sel_times.append(time.perf_counter() - ts)
        logp = sampled_logprobs(s_logits, sampled)
        if ref is None:
            loss = signals.opd_loss(logp, logp.detach(), sampled_logprobs(t_logits, sampled), mask)
        else:
            with torch.no_grad():
                r_logits, _, _ = flatten_responses(next_token_logits(ref, ids), ids, resp)
            loss = signals.mopd_loss(logp, logp.detach(), sampled_logprobs(t_logits, sampled),
                                     sampled_logprobs(r_logits, sampled), mask, lam=lam, gate=gate,
                                     advantage_clip=advantage_clip)
        for g in opt.param_groups:  # linear warm-up, then constant (as the paper's constant lr)
            g["lr"] = lr * min(1.0, (step + 1) / warmup)
        opt.zero_grad()
        loss.backward()
        opt.step()
        kept.append(float(mask.float().mean()))
        step_times.append(time.perf_counter() - t0)
    return RunResult(selector, budget, seed, accuracy(student, test_items), statistics.median(step_times),
                     statistics.median(sel_times), statistics.mean(kept), lr=lr)


# ------------------------------------------------------------------------------------------ configs
@dataclass(frozen=True)
class Config:
    teacher: tuple[int, int] = (3, 128)
    student: tuple = (2, 64)
    teacher_steps: int = 1600
    student_steps: int = 550
    expert_steps: int = 1000
    opd_steps: int = 300
    batch_size: int = 64
    opd_lr: float = 1e-4
    budgets: tuple = (0.001, 0.01, 0.1, 1.0)
    selectors: tuple = ("random", "ier", "tip", "tip+ier-and", "ta-opd+ier-and")
    seeds: tuple = (0, 1, 2)
    # a second learning rate (the one best for full-token OPD here), on a subset of the grid:
    # whether selection holds up depends on it (docs/training.md)
    alt_lr: float | None = 1e-3
    alt_selectors: tuple = ("random", "ier", "tip+ier-and")
    alt_budgets: tuple = (0.001, 0.1)
    test_n: int = 600
    mopd: bool = True
    mopd_lr: float = 1e-3
    mopd_lam: float = 1.25
    mopd_advantage_clip: float | None = None  # as plain OPD: the "pooled" variant then equals full OPD
    overhead_sizes: tuple = ((2, 64), (3, 128), (4, 256))
    overhead_steps: int = 12

    def model_key(self, role: str) -> str:
        """Cache key of a pre-trained model: what determines its weights."""
        spec = {"teacher": (self.teacher, self.teacher_steps), "student": (self.student, self.student_steps)}
        spec.update({f"expert-{c}": (self.teacher, self.expert_steps) for c in CATEGORIES})
        return hashlib.sha256(json.dumps([role, *spec[role], RESPONSE_LEN]).encode()).hexdigest()[:12]


CONFIGS = {
    "smoke": Config(teacher=(2, 32), student=(1, 32), teacher_steps=30, student_steps=10, expert_steps=10,
                    opd_steps=3, batch_size=16, budgets=(0.1, 1.0), selectors=("random", "ier", "tip+ier-and"),
                    seeds=(0,), test_n=30, alt_selectors=("ier",), alt_budgets=(0.1,), overhead_sizes=((1, 32),),
                    overhead_steps=2),
    "full-no-mopd": Config(mopd=False),
    "full": Config(),
}

# (layers, width, steps, lr, seed, init seed, categories) of each pre-trained model
def _pretrain_specs(config: Config) -> dict[str, tuple]:
    specs = {"teacher": (*config.teacher, config.teacher_steps, 3e-3, 1, 100, CATEGORIES),
             "student": (*config.student, config.student_steps, 3e-3, 2, 200, CATEGORIES)}
    if config.mopd:
        for i, c in enumerate(CATEGORIES):
            specs[f"expert-{c}"] = (*config.teacher, config.expert_steps, 3e-3, 10 + i, 300 + i, (c,))
    return specs


# ------------------------------------------------------------------------------------------ worker jobs
def _init_worker() -> None:
    torch.set_num_threads(1)  # one core per worker process: the models are too small to split


def _load(ckpt: Path, role: str, config: Config):
    layers, width = config.student if role == "student" else config.teacher
    model = make_model(layers, width, seed=0)
    model.load_state_dict(torch.load(ckpt / f"{role}-{config.model_key(role)}.pt", weights_only=True))
    return model.eval()


def _job_pretrain(ckpt: Path, config: Config, role: str, spec: tuple) -> str:
    path = ckpt / f"{role}-{config.model_key(role)}.pt"
    if not path.exists():
        layers, width, steps, lr, seed, init_seed, cats = spec
        model = make_model(layers, width, init_seed)
        sft(model, steps, 64, lr, seed, categories=cats)
        tmp = path.with_suffix(".tmp")
        torch.save(model.state_dict(), tmp)
        tmp.replace(path)  # atomic: a killed run never leaves a half-written checkpoint behind
    return role


def _job_opd(ckpt: Path, config: Config, selector: str, budget: float, seed: int, variant: str, lr: float) -> dict:
    student = _load(ckpt, "student", config)
    teacher = _load(ckpt, "teacher", config)
    test_items = test_set(config.test_n)
    kw: dict = {}
    if variant != "opd":
        # every MOPD variant goes through mopd_loss (same advantage clip); lam = 1 is plain OPD
        kw.update(ref=copy.deepcopy(student).eval(), lam=1.0, advantage_clip=config.mopd_advantage_clip)
    if variant.startswith("routed"):
        router = signals.TeacherRouter({c: f"expert-{c}" for c in CATEGORIES})
        experts = {role: _load(ckpt, role, config) for role in router.routing.values()}
        kw["teacher_for"] = lambda cat: experts[router.route([cat])[0]]
    if variant.startswith("routed+exopd"):
        kw.update(lam=config.mopd_lam, gate="relu" if variant.endswith("relu") else "none")
    r = opd_run(student, teacher, selector, budget, seed, config.opd_steps, config.batch_size, lr, test_items, **kw)
    return asdict(replace(r, variant=variant))


def _job_eval(ckpt: Path, config: Config, role: str) -> tuple[str, dict]:
    items = test_set(config.test_n)
    if role.startswith("expert-"):
        items = [x for x in items if x[0] == role.removeprefix("expert-")]
    return role, accuracy(_load(ckpt, role, config), items)


def _job_overhead(config: Config, layers: int, width: int, selector: str = "tip+ier-and") -> dict:
    """Median OPD step time of a fresh student of this size with the selector vs full-token OPD."""
    teacher = make_model(*config.teacher, seed=1).eval()
    student = make_model(layers, width, seed=2)
    params = sum(p.numel() for p in student.parameters())
    full = opd_run(student, teacher, "full", 1.0, 0, config.overhead_steps, config.batch_size, 1e-4, test_set(3))
    sel = opd_run(student, teacher, selector, 0.01, 0, config.overhead_steps, config.batch_size, 1e-4, test_set(3))
    return {"student": [layers, width], "params": params, "selector": selector, "full_step_ms": 1000 * full.step_s,
            "selector_ms": 1000 * sel.selector_s, "overhead_pct": 100 * sel.selector_s / full.step_s}


# ------------------------------------------------------------------------------------------ driver
def _pool(workers: int) -> cf.Executor:
    if workers <= 1:  # one thread in this process: same interface, no spawn cost (and debuggable)
        return cf.ThreadPoolExecutor(1)
    return cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_init_worker)


def _drain(futures: dict, title: str, show_progress: bool) -> list:
    """Wait for jobs (with a rich progress bar if asked) and return their results in submission order."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn, TimeRemainingColumn

    results = {}
    with Progress("[bold]{task.description}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), transient=True, disable=not show_progress) as progress:
        task = progress.add_task(title, total=len(futures))
        for f in cf.as_completed(futures):
            results[futures[f]] = f.result()
            progress.advance(task)
    return [results[i] for i in range(len(futures))]


def run(config: Config, out: Path, log=print, workers: int | None = None, fresh: bool = False) -> dict:
    """Pre-train (or reuse cached) models, run the OPD grid, overhead and MOPD; write the JSON."""
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / "checkpoints"
    ckpt.mkdir(exist_ok=True)
    if fresh:
        for f in ckpt.glob("*.pt"):
            f.unlink()
    workers = workers if workers is not None else min(2, os.cpu_count() or 1)
    t0 = time.perf_counter()
    result: dict = {"config": asdict(config), "workers": workers}
    with _pool(workers) as pool:
        specs = _pretrain_specs(config)
        # longest first, so the pool's tail is short
        order = sorted(specs, key=lambda r: -specs[r][2] * specs[r][1] ** 2 * specs[r][0])
        _drain({pool.submit(_job_pretrain, ckpt, config, r, specs[r]): i for i, r in enumerate(order)},
               "pre-training", log is print)
        evals = dict(_drain({pool.submit(_job_eval, ckpt, config, r): i for i, r in enumerate(specs)},
                            "evaluating", log is print))
        result["baseline"] = {"teacher": evals["teacher"], "student": evals["student"]}
        log(f"teacher {evals['teacher']['all']:.3f}  student start {evals['student']['all']:.3f}  "
            f"({time.perf_counter() - t0:.0f} s)")
        lr = config.opd_lr
        plan = [("full", 1.0, s, "opd", lr) for s in config.seeds]
        plan += [(sel, b, s, "opd", lr) for b in config.budgets if b < 1.0 for sel in config.selectors
                 for s in config.seeds]
        if config.alt_lr is not None:
            plan += [("full", 1.0, s, "opd", config.alt_lr) for s in config.seeds]
            plan += [(sel, b, s, "opd", config.alt_lr) for b in config.alt_budgets for sel in config.alt_selectors
                     for s in config.seeds]
        if config.mopd:
            plan += [("full", 1.0, s, v, config.mopd_lr) for v in ("pooled", "routed", "routed+exopd",
                                                                    "routed+exopd-relu") for s in config.seeds]
        runs = _drain({pool.submit(_job_opd, ckpt, config, *p): i for i, p in enumerate(plan)}, "OPD runs",
                      log is print)
        result["runs"] = [r for r in runs if r["variant"] == "opd"]
        for r in result["runs"]:
            log(f"lr {r['lr']:g} {r['selector']:>15} budget {r['budget']:<6} seed {r['seed']}: "
                f"acc {r['accuracy']['all']:.3f} kept {r['kept_fraction']:.4f} step {r['step_s'] * 1000:.0f} ms "
                f"selector {r['selector_s'] * 1000:.1f} ms")
        if config.mopd:
            experts = {c: evals[f"expert-{c}"][c] for c in CATEGORIES}
            result["mopd"] = _mopd_summary(experts, evals["student"], [r for r in runs if r["variant"] != "opd"])
            for name, v in result["mopd"]["variants"].items():
                log(f"MOPD {name:>18}: " + " ".join(f"{c} {v['accuracy'][c]:.3f}" for c in (*CATEGORIES, "all"))
                    + f"  smallest gain {v['smallest_gain']:+.3f}")
    # timed after the pool has closed, alone on the machine, so the other worker does not skew it
    torch.set_num_threads(1)
    result["overhead"] = [_job_overhead(config, *size) for size in config.overhead_sizes]
    for o in result["overhead"]:
        log(f"selector overhead, student {o['student'][0]}x{o['student'][1]} ({o['params'] / 1e6:.2f} M params): "
            f"{o['selector_ms']:.1f} ms of a {o['full_step_ms']:.0f} ms step = {o['overhead_pct']:+.1f}%")
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    (out / "opd_repro.json").write_text(json.dumps(result, indent=1))
    return result


def _mopd_summary(experts: dict, base: dict, runs: list[dict]) -> dict:
    out: dict = {"experts": experts, "student": base, "variants": {}}
    for name in dict.fromkeys(r["variant"] for r in runs):
        accs = [r["accuracy"] for r in runs if r["variant"] == name]
        mean = {c: statistics.mean(a[c] for a in accs) for c in (*CATEGORIES, "all")}
        gains = {c: mean[c] - base[c] for c in CATEGORIES}
        recovery = {c: (mean[c] - base[c]) / (experts[c] - base[c]) if experts[c] != base[c] else None
                    for c in CATEGORIES}
        out["variants"][name] = {"accuracy": mean, "per_seed": accs, "gain": gains,
                                 "smallest_gain": min(gains.values()), "recovery": recovery}
    return out


# ------------------------------------------------------------------------------------------ report
def summarize(result: dict) -> dict:
    """Per (lr, selector, budget): accuracy mean and spread (min..max over seeds), kept tokens, times,
    and the selector's time as a share of the full-OPD step at that lr."""
    groups: dict[tuple, list[dict]] = {}
    for r in result["runs"]:
        groups.setdefault((r.get("lr", result["config"]["opd_lr"]), r["selector"], r["budget"]), []).append(r)
    full_step = {lr: statistics.median(r["step_s"] for r in rs) for (lr, sel, _), rs in groups.items() if sel == "full"}
    rows = []
    for (lr, sel, budget), rs in sorted(groups.items(), key=lambda kv: (kv[0][0] != result["config"]["opd_lr"],
                                                                        kv[0][0], kv[0][2], kv[0][1])):
        acc = [r["accuracy"]["all"] for r in rs]
        sel_s = statistics.median(r["selector_s"] for r in rs)
        rows.append({"lr": lr, "selector": sel, "budget": budget, "acc_mean": statistics.mean(acc),
                     "acc_min": min(acc), "acc_max": max(acc), "seeds": len(rs),
                     "kept": statistics.mean(r["kept_fraction"] for r in rs),
                     "step_ms": 1000 * statistics.median(r["step_s"] for r in rs), "selector_ms": 1000 * sel_s,
                     "selector_overhead_pct": 100 * sel_s / full_step[lr] if lr in full_step else None})
    return {"rows": rows, "lrs": list(dict.fromkeys(r["lr"] for r in rows))}


def report(result: dict, out: Path) -> str:
    """Markdown tables and a PNG of a run's results."""
    summ = summarize(result)
    base = result["baseline"]
    lines = [f"teacher accuracy {base['teacher']['all']:.3f}, student start {base['student']['all']:.3f} "
             f"(exact match of the whole step-by-step answer, {result['config']['test_n']} test problems); "
             f"{result['config']['opd_steps']} OPD steps of {result['config']['batch_size']} prompts; "
             f"wall time {result.get('wall_s', 0) / 60:.1f} min on {result.get('workers', 1)} worker(s)"]
    for lr in summ["lrs"]:
        lines += ["", f"**lr {lr:g}**", "",
                  "| selector | budget | accuracy mean (min..max) | Δ vs start | kept tokens | step | selector | "
                  "selector / full-OPD step |",
                  "|---|---:|---|---:|---:|---:|---:|---:|"]
        for r in (r for r in summ["rows"] if r["lr"] == lr):
            ov = f"{r['selector_overhead_pct']:+.1f}%" if r["selector_overhead_pct"] is not None else ""
            lines.append(f"| {r['selector']} | {r['budget']:g} | "
                         f"{r['acc_mean']:.3f} ({r['acc_min']:.3f}..{r['acc_max']:.3f})"
                         f" | {r['acc_mean'] - base['student']['all']:+.3f} | {r['kept']:.4f} | "
                         f"{r['step_ms']:.0f} ms | {r['selector_ms']:.1f} ms | {ov} |")
    if result.get("overhead"):
        lines += ["", "| student | params | full-OPD step | selector (tip+ier-and, k=16) | overhead |",
                  "|---|---:|---:|---:|---:|"]
        for o in result["overhead"]:
            lines.append(f"| {o['student'][0]} x {o['student'][1]} | {o['params'] / 1e6:.2f} M | "
                         f"{o['full_step_ms']:.0f} ms | {o['selector_ms']:.1f} ms | {o['overhead_pct']:+.1f}% |")
    if "mopd" in result:
        m = result["mopd"]
        lines += ["", f"MOPD at lr {result['config']['mopd_lr']:g}, full tokens. Experts (own category): "
                      f"{json.dumps({k: round(v, 3) for k, v in m['experts'].items()})}; student start: "
                      f"{json.dumps({k: round(v, 3) for k, v in m['student'].items()})}", "",
                  "| MOPD variant | add | sub | mul | all | smallest gain | recovery add / sub / mul |",
                  "|---|---:|---:|---:|---:|---:|---|"]
        for name, v in m["variants"].items():
            a, rec = v["accuracy"], v["recovery"]
            rec_s = " / ".join("n/a" if rec[c] is None else f"{rec[c]:.2f}" for c in CATEGORIES)
            lines.append(f"| {name} | {a['add']:.3f} | {a['sub']:.3f} | {a['mul']:.3f} | {a['all']:.3f} | "
                         f"{v['smallest_gain']:+.3f} | {rec_s} |")
    text = "\n".join(lines) + "\n"
    (out / "opd_repro.md").write_text(text)
    _plot(result, summ, out / "opd_repro.png")
    return text


def _plot(result: dict, summ: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = len(summ["lrs"]) + ("mopd" in result)
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.4), squeeze=False)
    all_selectors = sorted({r["selector"] for r in summ["rows"]} - {"full"})
    colors = {sel: f"C{i}" for i, sel in enumerate(all_selectors)}
    for ax, lr in zip(axes[0], summ["lrs"]):
        rows = [r for r in summ["rows"] if r["lr"] == lr]
        sels = sorted({r["selector"] for r in rows} - {"full"})
        for i, sel in enumerate(sels):
            pts = [r for r in rows if r["selector"] == sel]
            xs = [r["budget"] * (1 + 0.08 * (i - len(sels) / 2)) for r in pts]  # dodge overlapping bars
            ax.errorbar(xs, [r["acc_mean"] for r in pts],
                        yerr=[[r["acc_mean"] - r["acc_min"] for r in pts], [r["acc_max"] - r["acc_mean"] for r in pts]],
                        marker="o", capsize=3, label=sel, color=colors[sel])
        full = [r for r in rows if r["selector"] == "full"]
        if full:
            ax.axhspan(full[0]["acc_min"], full[0]["acc_max"], color="k", alpha=0.08)
            ax.axhline(full[0]["acc_mean"], color="k", ls="--", label="full OPD (band: seeds)")
        ax.axhline(result["baseline"]["student"]["all"], color="grey", ls=":", label="student start")
        ax.set_xscale("log")
        ax.set_xlabel("token budget (fraction of response tokens)")
        ax.set_title(f"OPD token selection, lr {lr:g}")
        ax.set_ylabel("exact-match accuracy (mean, min..max over seeds)")
        ax.legend(fontsize=7)
    if "mopd" in result:
        ax = axes[0][-1]
        m = result["mopd"]
        names = list(m["variants"])
        cats = (*CATEGORIES, "all")
        width = 0.8 / (len(names) + 1)
        ax.bar(range(len(cats)), [m["student"][c] for c in cats], width, label="student start", color="lightgrey")
        for i, name in enumerate(names):
            ax.bar([j + (i + 1) * width for j in range(len(cats))], [m["variants"][name]["accuracy"][c] for c in cats],
                   width, label=name)
        for j, c in enumerate(CATEGORIES):
            ax.plot([j - width / 2, j + (len(names) + 0.5) * width], [m["experts"][c]] * 2, color="k", lw=1)
        ax.set_xticks([j + len(names) * width / 2 for j in range(len(cats))], cats)
        ax.set_title(f"Multi-teacher OPD, lr {result['config']['mopd_lr']:g} (line: category expert)")
        ax.set_ylabel("exact-match accuracy (mean over seeds)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------------ lr sweep
SWEEP_LRS = (3e-5, 1e-4, 3e-4, 1e-3)
SWEEP_SELECTORS = ("full", "random", "ier", "tip")


def lr_sweep(config: Config, out: Path, lrs=SWEEP_LRS, selectors_=SWEEP_SELECTORS, budget: float = 0.001,
             log=print, workers: int | None = None) -> dict:
    """Accuracy against the learning rate, for full OPD and each selector at one budget.

    Needs the checkpoints of a previous `run` (same config) in <out>/checkpoints; reuses that run's
    results (and an earlier sweep's) where (lr, selector, budget, seed) match, since runs are
    deterministic. Writes
    <out>/opd_lr_sweep.json, .md and .png."""
    ckpt = out / "checkpoints"
    for role in ("teacher", "student"):
        if not (ckpt / f"{role}-{config.model_key(role)}.pt").exists():
            raise FileNotFoundError(f"no {role} checkpoint for this config under {ckpt}: run the reproduction first")
    previous = out / "opd_repro.json"
    known: dict[tuple, dict] = {}
    if previous.exists():
        prev = json.loads(previous.read_text())
        same = {k: v for k, v in prev["config"].items() if k in ("opd_steps", "batch_size", "test_n", "student",
                                                                   "teacher", "student_steps", "teacher_steps")}
        if same == {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(config).items() if k in same}:
            known = {(r["lr"], r["selector"], r["budget"], r["seed"]): r for r in prev["runs"] if "lr" in r}
            if (out / "opd_lr_sweep.json").exists():  # and an earlier sweep's runs, from the same checkpoints
                known.update({(r["lr"], r["selector"], r["budget"], r["seed"]): r
                              for r in json.loads((out / "opd_lr_sweep.json").read_text())["runs"]})
    plan = [(sel, 1.0 if sel == "full" else budget, seed, "opd", lr) for lr in lrs for sel in selectors_
            for seed in config.seeds]
    todo = [p for p in plan if (p[4], p[0], p[1], p[2]) not in known]
    log(f"lr sweep: {len(plan)} runs, {len(plan) - len(todo)} reused from earlier runs in {out}")
    workers = workers if workers is not None else min(2, os.cpu_count() or 1)
    with _pool(workers) as pool:
        fresh = _drain({pool.submit(_job_opd, ckpt, config, *p): i for i, p in enumerate(todo)}, "lr sweep",
                       log is print)
    for p, r in zip(todo, fresh):
        known[(p[4], p[0], p[1], p[2])] = r
    runs = [known[(p[4], p[0], p[1], p[2])] for p in plan]
    start = json.loads(previous.read_text())["baseline"]["student"]["all"] if previous.exists() else None
    result = {"lrs": list(lrs), "budget": budget, "student_start": start, "runs": runs}
    (out / "opd_lr_sweep.json").write_text(json.dumps(result, indent=1))
    lines = [f"accuracy after {config.opd_steps} OPD steps, mean (min..max) over seeds {list(config.seeds)}; "
             f"selectors at budget {budget:g}; student start "
             + (f"{start:.3f}" if start is not None else "unknown"), "",
             "| selector | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " |", "|---|" + "---|" * len(lrs)]
    curves = {}
    for sel in selectors_:
        cells, curve = [], []
        for lr in lrs:
            acc = [r["accuracy"]["all"] for r in runs if r["selector"] == sel and r["lr"] == lr]
            cells.append(f"{statistics.mean(acc):.3f} ({min(acc):.3f}..{max(acc):.3f})")
            curve.append((statistics.mean(acc), min(acc), max(acc)))
        curves[sel] = curve
        lines.append(f"| {sel} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    (out / "opd_lr_sweep.md").write_text(text)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for sel, curve in curves.items():
        ax.errorbar(lrs, [c[0] for c in curve], yerr=[[c[0] - c[1] for c in curve], [c[2] - c[0] for c in curve]],
                    marker="o", capsize=3, label=sel if sel == "full" else f"{sel} @ {budget:g}",
                    color="k" if sel == "full" else None, ls="--" if sel == "full" else "-")
    if start is not None:
        ax.axhline(start, color="grey", ls=":", label="student start")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate (constant after 30 warm-up steps)")
    ax.set_ylabel("exact-match accuracy (mean, min..max over seeds)")
    ax.set_title("OPD: full tokens vs selected tokens, by learning rate")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "opd_lr_sweep.png", dpi=120)
    plt.close(fig)
    return {**result, "table": text}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", choices=sorted(CONFIGS), default="smoke")
    ap.add_argument("--out", type=Path, default=Path("docs/results"))
    ap.add_argument("--workers", type=int, default=None, help="worker processes (default: min(2, CPUs))")
    ap.add_argument("--fresh", action="store_true", help="retrain the cached teacher, experts and student")
    ap.add_argument("--report-only", action="store_true", help="rebuild tables and plot from <out>/opd_repro.json")
    ap.add_argument("--lr-sweep", action="store_true",
                    help="after a run: accuracy vs learning rate for full OPD and the selectors at 0.1%%")
    args = ap.parse_args(argv)
    if args.workers is not None and args.workers < 1:
        ap.error(f"--workers must be >= 1, got {args.workers}")
    if args.lr_sweep:
        try:
            print(lr_sweep(CONFIGS[args.config], args.out, workers=args.workers)["table"])
        except FileNotFoundError as e:
            ap.error(str(e))
        return
    if args.report_only:
        path = args.out / "opd_repro.json"
        if not path.exists():
            ap.error(f"--report-only needs {path}; run without it first")
        result = json.loads(path.read_text())
    else:
        result = run(CONFIGS[args.config], args.out, workers=args.workers, fresh=args.fresh)
    print(report(result, args.out))


if __name__ == "__main__":
    main()
