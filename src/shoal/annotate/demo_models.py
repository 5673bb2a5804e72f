"""Small real models made locally (no hub): for the tests, the bench and `shoal annotate serve --demo`.

- `make_repro_checkpoint`: shoal.train.repro's student (GPT-2, character vocabulary) after a short
  SFT on its arithmetic task, saved the way repro saves checkpoints.
- `make_bpe_model`: a byte-level BPE tokenizer trained on a small multilingual text (English, CJK,
  emoji: characters that BPE splits across tokens) and a tiny GPT-2 briefly trained on that text,
  saved as an ordinary Hugging Face directory (config.json + weights + tokenizer files).
"""
from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

DEMO_TEXT = [
    "The sandbox starts in four milliseconds and the agent runs its tests.",
    "The agent reads the file, edits one line, and runs the tests again.",
    "A good answer names the failing test and explains the fix.",
    "沙箱在四毫秒内启动，智能体运行测试。",
    "代理读取文件，修改一行，然后再次运行测试。",
    "Tests pass 🎉 and the patch is small 👍.",
    "The fish swim in a shoal 🐟🐟🐟 near the reef.",
    "日本語のテキストも正しく表示されます。",
]


def _one_thread():
    """Training these tiny models on one thread: on a shared, loaded host torch's default thread pool
    is many times slower (oversubscription)."""
    import contextlib

    import torch

    @contextlib.contextmanager
    def ctx():
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(before)
    return ctx()


def make_repro_checkpoint(path: str | Path, steps: int = 100, seed: int = 2, batch: int = 32) -> Path:
    """A repro student checkpoint (1 layer, width 64) trained for `steps` SFT steps: weak, so its
    answers have mistakes worth correcting."""
    import torch

    from ..train import repro

    p = Path(path)
    if p.exists():
        return p
    torch.manual_seed(seed)
    model = repro.make_model(1, 64, seed=seed)
    with _one_thread():
        repro.sft(model, steps, batch, 3e-3, seed)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(f".tmp{os.getpid()}")
    torch.save(model.state_dict(), tmp)
    tmp.replace(p)
    return p


def make_bpe_model(path: str | Path, steps: int = 80, seed: int = 0, n_positions: int = 128) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    p = Path(path)
    if (p / "config.json").exists():
        return p
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator(DEMO_TEXT * 4, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    eos = tok.eos_token_id
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=len(tok), n_positions=n_positions, n_embd=64, n_layer=2, n_head=4,
                     bos_token_id=eos, eos_token_id=eos)
    model = GPT2LMHeadModel(cfg)
    rows = [tok.encode(t) + [eos] for t in DEMO_TEXT]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(seed)
    with _one_thread():
        for _ in range(steps):
            row = rng.choice(rows)
            ids = torch.tensor([[eos] + row])
            loss = model(input_ids=ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    tmp = p.with_name(p.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:
        tmp.rename(p)  # atomic: a concurrent maker finds a whole directory or none
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another process made it first
    return p
