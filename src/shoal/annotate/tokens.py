"""The model's own tokenizer, with exact bytes per token.

A byte-level BPE token can hold part of a UTF-8 character (an emoji is often 2-4 tokens), so a
token's text is not always a string. The UI works on bytes: `split_text` gives each token the
characters whose *last* byte it holds, so the pieces concatenate to exactly the decoded text and a
token that holds only leading bytes shows as empty (it is still clickable, by position).
"""
from __future__ import annotations

import codecs
import functools
import re
from pathlib import Path
from typing import Any, Protocol

from ..core.errors import InvalidArgument

_HEX_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class Tokenizer(Protocol):
    eos_id: int | None
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    def token_id(self, piece: str) -> int | None:
        """The id of a vocabulary entry by its raw spelling (how OpenAI-style servers name tokens)."""
        ...

    def banned(self) -> list[int]:
        """Ids the model must never generate (padding)."""
        ...


def split_text(tok: Tokenizer, ids: list[int]) -> list[str]:
    """Per token, the characters completed by its bytes; "".join(result) == the UTF-8 decoding."""
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
    out = [dec.decode(tok.token_bytes(i), final=False) for i in ids]
    if out:
        out[-1] += dec.decode(b"", final=True)
    return out


def text_of(tok: Tokenizer, ids: list[int]) -> str:
    return b"".join(tok.token_bytes(i) for i in ids).decode("utf-8", errors="replace")


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's reversible byte <-> printable-character map (the ByteLevel pre-tokenizer's)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class HFTokenizer:
    """A transformers tokenizer (loaded from a local directory: never from a hub)."""

    def __init__(self, tok: Any):
        self.tok = tok
        self.eos_id = tok.eos_token_id
        self.vocab_size = len(tok)
        self._byte_level = "ByteLevel" in repr(getattr(getattr(tok, "backend_tokenizer", None), "decoder", None))
        self._cache: dict[int, bytes] = {}

    @classmethod
    def load(cls, path: str | Path) -> HFTokenizer:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(path), local_files_only=True))

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids))

    def token_bytes(self, token_id: int) -> bytes:
        b = self._cache.get(token_id)
        if b is None:
            b = self._cache[token_id] = self._bytes(token_id)
        return b

    def _bytes(self, token_id: int) -> bytes:
        if not 0 <= token_id < self.vocab_size:
            raise InvalidArgument(f"token id {token_id} is outside the vocabulary (0..{self.vocab_size - 1})")
        piece = self.tok.convert_ids_to_tokens(token_id)
        if piece in self.tok.all_special_tokens:
            return piece.encode()
        if self._byte_level:
            bd = _byte_decoder()
            if all(c in bd for c in piece):
                return bytes(bd[c] for c in piece)
        m = _HEX_BYTE.fullmatch(piece)
        if m:  # sentencepiece byte fallback
            return bytes([int(m.group(1), 16)])
        if "▁" in piece:  # sentencepiece's word boundary
            return piece.replace("▁", " ").encode()
        return str(self.tok.decode([token_id])).encode()

    def token_id(self, piece: str) -> int | None:
        i = self.tok.convert_tokens_to_ids(piece)
        return None if i is None or i == self.tok.unk_token_id and piece != self.tok.unk_token else int(i)

    def banned(self) -> list[int]:
        pad = self.tok.pad_token_id
        return [pad] if pad is not None and pad != self.eos_id else []

    def chat_prompt(self, messages: list[dict]) -> str:
        """The conversation as the model's chat template renders it (a plain role/content layout when
        the tokenizer has none), ready for the assistant's turn."""
        if getattr(self.tok, "chat_template", None):
            return str(self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        return plain_chat_prompt(messages)


def plain_chat_prompt(messages: list[dict]) -> str:
    parts = [f"{m.get('role', 'user')}: {m.get('content') or ''}\n" for m in messages]
    return "".join(parts) + "assistant: "


class CharTokenizer:
    """shoal.train.repro's character vocabulary (one token per character; PAD is never generated)."""

    eos_id: int | None

    def __init__(self, chars: str, pad_id: int, eos_id: int):
        self.chars, self.pad_id, self.eos_id = chars, pad_id, eos_id
        self.vocab_size = len(chars) + 1
        self.stoi = {c: i for i, c in enumerate(chars)}

    def encode(self, text: str) -> list[int]:
        bad = sorted({c for c in text if c not in self.stoi})
        if bad:
            raise InvalidArgument(f"characters {''.join(bad)!r} are not in this model's vocabulary {self.chars!r}")
        return [self.stoi[c] for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] if 0 <= i < len(self.chars) else "" for i in ids)

    def token_bytes(self, token_id: int) -> bytes:
        if not 0 <= token_id < self.vocab_size:
            raise InvalidArgument(f"token id {token_id} is outside the vocabulary (0..{self.vocab_size - 1})")
        return self.chars[token_id].encode() if token_id < len(self.chars) else b""

    def token_id(self, piece: str) -> int | None:
        return self.stoi.get(piece)

    def banned(self) -> list[int]:
        return [self.pad_id]

    def chat_prompt(self, messages: list[dict]) -> str:
        # repro models see a bare problem ("123+456="): the last user message is the prompt
        return next((str(m.get("content") or "") for m in reversed(messages) if m.get("role") == "user"), "")
