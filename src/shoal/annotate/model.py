"""The model side of annotation: score a response token by token, and continue from a token prefix.

`ModelBackend` is the one interface the app uses. Two backends:
- `LocalModel`: any Hugging Face causal LM from a local directory (config + weights + tokenizer),
  or a `shoal.train.repro` checkpoint (`<role>-<key>.pt`, character vocabulary), on CPU.
- `OpenAIModel`: an OpenAI-compatible server's `/v1/completions` (vLLM, SGLang, llama.cpp's server,
  the project's scripted server with `--model`): token-id prompts, `logprobs` = top-k,
  `echo` to score a given response, `stream` for the continuation, and
  `return_tokens_as_token_ids` so token boundaries are the model's own, exactly.
"""
from __future__ import annotations

import json
import math
import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.errors import InvalidArgument, LLMUnavailable
from .tokens import CharTokenizer, HFTokenizer, Tokenizer


@dataclass
class Candidate:
    id: int
    logprob: float


@dataclass
class TokenInfo:
    """One response token: its id, log pi(token | prefix), and the model's top-k at that position."""
    id: int
    logprob: float
    top: list[Candidate] = field(default_factory=list)


class ModelBackend(ABC):
    name: str
    tokenizer: Tokenizer
    max_context: int | None = None  # positions the model can attend to (None: no fixed limit)

    @abstractmethod
    def score(self, prompt_ids: list[int], response_ids: list[int], k: int = 20) -> list[TokenInfo]:
        """Per response token: its logprob and the top-k candidates at its position."""

    @abstractmethod
    def stream(self, prefix_ids: list[int], max_tokens: int, k: int = 20, temperature: float = 0.0,
               stop_ids: list[int] | None = None, seed: int | None = None) -> Iterator[TokenInfo]:
        """The model's continuation of prefix_ids (prompt + response so far), one token at a time.
        Stops at EOS (yielded), a stop id (yielded), max_tokens, or the model's context length."""

    def encode_prompt(self, prompt: dict) -> list[int]:
        """An item's prompt ({"text"} or {"messages"}) as the model's token ids (chat: its template)."""
        tok: Any = self.tokenizer
        return tok.encode(prompt["text"] if "text" in prompt else tok.chat_prompt(prompt["messages"]))

    def close(self) -> None:  # noqa: B027  (optional: only clients hold connections)
        return None


def _check_ids(tok: Tokenizer, ids: list[int], what: str) -> None:
    bad = [i for i in ids if not isinstance(i, int) or not 0 <= i < tok.vocab_size]
    if bad:
        raise InvalidArgument(f"{what} holds token ids outside the vocabulary (0..{tok.vocab_size - 1}): {bad[:5]}")


# ------------------------------------------------------------------------------------------ local
class LocalModel(ModelBackend):
    def __init__(self, model: Any, tokenizer: Tokenizer, name: str, max_context: int | None = None):
        import torch

        self.model, self.tokenizer, self.name = model.eval(), tokenizer, name
        self.max_context = max_context
        self._torch = torch
        self._lock = threading.Lock()  # one forward at a time: the app's threads share the model

    @classmethod
    def load(cls, path: str | Path, threads: int | None = None) -> LocalModel:
        """A local HF model directory, or a shoal.train.repro checkpoint file (`*.pt`)."""
        import torch

        if threads:
            torch.set_num_threads(threads)
        p = Path(path)
        if p.is_file() and p.suffix == ".pt":
            return cls._load_repro(p)
        if not (p / "config.json").is_file():
            raise InvalidArgument(f"{p} is neither a Hugging Face model directory (config.json) nor a "
                                  "shoal.train.repro checkpoint (*.pt)")
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(p), local_files_only=True)
        ctx = getattr(model.config, "n_positions", None) or getattr(model.config, "max_position_embeddings", None)
        return cls(model, HFTokenizer.load(p), name=p.name, max_context=ctx)

    @classmethod
    def _load_repro(cls, p: Path) -> LocalModel:
        import torch

        from ..train import repro

        state = torch.load(p, weights_only=True, map_location="cpu")
        try:
            width = state["transformer.wte.weight"].shape[1]
            layers = 1 + max(int(m.group(1)) for k in state if (m := re.match(r"transformer\.h\.(\d+)\.", k)))
        except (KeyError, ValueError):
            raise InvalidArgument(f"{p} is not a shoal.train.repro checkpoint (no GPT-2 weights in it)") from None
        model = repro.make_model(layers, width, seed=0)
        model.load_state_dict(state)
        tok = CharTokenizer(repro.CHARS, repro.PAD, repro.EOS)
        return cls(model, tok, name=p.stem, max_context=repro.PROMPT_LEN + repro.RESPONSE_LEN + 1)

    def _top(self, logp: Any, k: int) -> list[Candidate]:
        if k <= 0:
            return []
        vals, idx = logp.topk(min(k, logp.shape[-1]))
        # banned ids (padding) have -inf: never a candidate, and not JSON either
        return [Candidate(int(i), float(v)) for v, i in zip(vals.tolist(), idx.tolist(), strict=True) if v > -math.inf]

    def score(self, prompt_ids: list[int], response_ids: list[int], k: int = 20) -> list[TokenInfo]:
        torch = self._torch
        _check_ids(self.tokenizer, prompt_ids + response_ids, "the prompt or response")
        if not prompt_ids:
            raise InvalidArgument("scoring needs at least one prompt token")
        if not response_ids:
            return []
        ids = prompt_ids + response_ids
        if self.max_context and len(ids) > self.max_context:
            raise InvalidArgument(f"{len(ids)} tokens exceed the model's context of {self.max_context}")
        with self._lock, torch.no_grad():
            logits = self.model(input_ids=torch.tensor([ids])).logits[0, len(prompt_ids) - 1:-1].float()
        logp = torch.log_softmax(self._mask(logits), -1)
        return [TokenInfo(t, float(logp[i, t]), self._top(logp[i], k)) for i, t in enumerate(response_ids)]

    def _mask(self, logits: Any) -> Any:
        banned = self.tokenizer.banned()
        if banned:
            logits = logits.clone()
            logits[..., banned] = -math.inf
        return logits

    def stream(self, prefix_ids: list[int], max_tokens: int, k: int = 20, temperature: float = 0.0,
               stop_ids: list[int] | None = None, seed: int | None = None) -> Iterator[TokenInfo]:
        torch = self._torch
        _check_ids(self.tokenizer, prefix_ids, "the prefix")
        if not prefix_ids:
            raise InvalidArgument("a continuation needs at least one prefix token")
        stops = set(stop_ids or ()) | ({self.tokenizer.eos_id} if self.tokenizer.eos_id is not None else set())
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        room = max_tokens if self.max_context is None else min(max_tokens, self.max_context - len(prefix_ids))
        past, feed = None, prefix_ids
        for _ in range(max(0, room)):
            with self._lock, torch.no_grad():  # per step, so a slow consumer does not hold the model
                out = self.model(input_ids=torch.tensor([feed]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = self._mask(out.logits[0, -1].float())
            logp = torch.log_softmax(logits, -1)
            if temperature > 0:
                nxt = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen))
            else:
                nxt = int(logp.argmax())
            yield TokenInfo(nxt, float(logp[nxt]), self._top(logp, k))
            if nxt in stops:
                return
            feed = [nxt]


# ------------------------------------------------------------------------------------------ OpenAI-compatible
_TOKEN_ID = re.compile(r"token_id:(\d+)")


class OpenAIModel(ModelBackend):
    """A client of an OpenAI-compatible completions endpoint. The tokenizer is the served model's own
    (a local copy), for prompts and display; the server names tokens as `token_id:N`."""

    def __init__(self, base_url: str, model: str, tokenizer: Tokenizer, api_key: str | None = None,
                 timeout: float = 30.0, max_context: int | None = None):
        import httpx

        self.base_url, self.name, self.tokenizer, self.max_context = base_url.rstrip("/"), model, tokenizer, max_context
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(timeout=httpx.Timeout(timeout, connect=5.0), headers=headers)
        self._httpx = httpx

    def close(self) -> None:
        self._http.close()

    def _id(self, piece: str) -> int:
        m = _TOKEN_ID.fullmatch(piece)
        if m:
            return int(m.group(1))
        i = self.tokenizer.token_id(piece)
        if i is None:
            raise LLMUnavailable(f"{self.base_url} named a token {piece!r} that is not in the local tokenizer "
                                 "(is it serving the same model?)")
        return i

    def _tops(self, top: dict | None) -> list[Candidate]:
        cands = [Candidate(self._id(p), float(lp)) for p, lp in (top or {}).items()]
        return sorted(cands, key=lambda c: -c.logprob)

    def _body(self, ids: list[int], **kw: Any) -> dict:
        return {"model": self.name, "prompt": ids, "return_tokens_as_token_ids": True, **kw}

    def _fail(self, e: Exception) -> LLMUnavailable:
        return LLMUnavailable(f"the model server at {self.base_url} failed: {type(e).__name__}: {e}")

    def score(self, prompt_ids: list[int], response_ids: list[int], k: int = 20) -> list[TokenInfo]:
        _check_ids(self.tokenizer, prompt_ids + response_ids, "the prompt or response")
        if not response_ids:
            return []
        body = self._body(prompt_ids + response_ids, max_tokens=1, echo=True, logprobs=k, temperature=0.0)
        try:
            r = self._http.post(f"{self.base_url}/v1/completions", json=body)
        except self._httpx.HTTPError as e:
            raise self._fail(e) from None
        if r.status_code != 200:
            raise LLMUnavailable(f"the model server at {self.base_url} answered {r.status_code}: {r.text[:300]}")
        lp = r.json()["choices"][0]["logprobs"]
        n = len(prompt_ids)
        out = []
        for j, t in enumerate(response_ids):
            tops = lp["top_logprobs"][n + j]
            out.append(TokenInfo(t, float(lp["token_logprobs"][n + j]), self._tops(tops)[:k]))
        return out

    def stream(self, prefix_ids: list[int], max_tokens: int, k: int = 20, temperature: float = 0.0,
               stop_ids: list[int] | None = None, seed: int | None = None) -> Iterator[TokenInfo]:
        _check_ids(self.tokenizer, prefix_ids, "the prefix")
        if self.max_context:
            max_tokens = min(max_tokens, self.max_context - len(prefix_ids))
        if max_tokens <= 0:
            return
        body = self._body(prefix_ids, max_tokens=max_tokens, logprobs=k, temperature=temperature, stream=True)
        if stop_ids:
            body["stop_token_ids"] = list(stop_ids)
        if seed is not None:
            body["seed"] = seed
        for choice in self._stream_choices("/v1/completions", body):
            lp = choice.get("logprobs") or {}
            for j, piece in enumerate(lp.get("tokens") or []):
                tops = (lp.get("top_logprobs") or [None] * (j + 1))[j]
                yield TokenInfo(self._id(piece), float(lp["token_logprobs"][j]), self._tops(tops)[:k])

    def _stream_choices(self, path: str, body: dict) -> Iterator[dict]:
        """POST a streaming request and yield each server-sent event's first choice; a stream that
        ends before `[DONE]` or a finish reason is the server going away, not a finished answer."""
        done = False
        try:
            with self._http.stream("POST", f"{self.base_url}{path}", json=body) as r:
                if r.status_code != 200:
                    raise LLMUnavailable(f"the model server at {self.base_url} answered {r.status_code}: "
                                         f"{r.read().decode(errors='replace')[:300]}")
                for line in r.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    choice = json.loads(data)["choices"][0]
                    yield choice
                    if choice.get("finish_reason"):
                        done = True
        except self._httpx.HTTPError as e:
            raise self._fail(e) from None
        if not done:  # the connection closed cleanly, but before the server said it had finished
            raise LLMUnavailable(f"the model server at {self.base_url} ended the stream early (it went away?)")


class OpenAIChatModel(OpenAIModel):
    """A client of an OpenAI-compatible *chat* endpoint for the continuation: the conversation goes
    as messages, the response so far as a final assistant message that the server continues
    (`continue_final_message: true`, `add_generation_prompt: false`, as vLLM and SGLang take it),
    with `logprobs` / `top_logprobs` and `return_tokens_as_token_ids`, so the continued tokens are
    exact ids with their top-k.

    A chat endpoint takes text, not token ids: the server re-tokenizes the prefilled text (the
    generated ids coming back are exact). So a prefix must end on a whole character, and scoring a
    given response token by token goes through the same server's `/v1/completions` (token ids,
    `echo`), which vLLM, SGLang and llama.cpp serve beside chat."""

    def __init__(self, *a: Any, **kw: Any):
        super().__init__(*a, **kw)
        self._prompts: dict[tuple[int, ...], list[dict]] = {}  # prompt ids -> the messages they render

    def encode_prompt(self, prompt: dict) -> list[int]:
        msgs = prompt["messages"] if "messages" in prompt else [{"role": "user", "content": prompt["text"]}]
        tok: Any = self.tokenizer
        ids = tok.encode(tok.chat_prompt(msgs))
        self._prompts[tuple(ids)] = [dict(m) for m in msgs]
        return ids

    def split(self, prefix_ids: list[int]) -> tuple[list[dict], str]:
        """(the conversation, the assistant's text so far) for a prefix that starts with a known prompt."""
        best = max((p for p in self._prompts if tuple(prefix_ids[:len(p)]) == p), key=len, default=None)
        if best is None:
            raise InvalidArgument("the chat client continues only prompts it encoded (encode_prompt): this "
                                  "prefix starts with none of them")
        raw = b"".join(self.tokenizer.token_bytes(i) for i in prefix_ids[len(best):])
        try:
            text = raw.decode()
        except UnicodeDecodeError:
            raise InvalidArgument("a chat endpoint takes text: this prefix ends inside a character (a multi-byte "
                                  "character split across tokens); correct at a whole character, or use the "
                                  "completions client, which takes token ids") from None
        return self._prompts[best], text

    def stream(self, prefix_ids: list[int], max_tokens: int, k: int = 20, temperature: float = 0.0,
               stop_ids: list[int] | None = None, seed: int | None = None) -> Iterator[TokenInfo]:
        _check_ids(self.tokenizer, prefix_ids, "the prefix")
        msgs, text = self.split(prefix_ids)
        if self.max_context:
            max_tokens = min(max_tokens, self.max_context - len(prefix_ids))
        if max_tokens <= 0:
            return
        body: dict[str, Any] = {"model": self.name, "max_tokens": max_tokens, "temperature": temperature,
                                "logprobs": True, "top_logprobs": k, "stream": True,
                                "return_tokens_as_token_ids": True}
        if text:
            body.update(messages=msgs + [{"role": "assistant", "content": text}], continue_final_message=True,
                        add_generation_prompt=False)
        else:
            body.update(messages=msgs, add_generation_prompt=True)
        if stop_ids:
            body["stop_token_ids"] = list(stop_ids)
        if seed is not None:
            body["seed"] = seed
        for choice in self._stream_choices("/v1/chat/completions", body):
            for t in (choice.get("logprobs") or {}).get("content") or []:
                tops = [Candidate(self._id(c["token"]), float(c["logprob"])) for c in t.get("top_logprobs") or []]
                yield TokenInfo(self._id(t["token"]), float(t["logprob"]), sorted(tops, key=lambda c: -c.logprob)[:k])
