"""The model side: real models, exact token boundaries, the local backend and the OpenAI client agree."""
from __future__ import annotations

import math
import threading
import time

import pytest

from shoal.annotate.model import OpenAIChatModel, OpenAIModel
from shoal.annotate.tokens import split_text, text_of
from shoal.core.errors import InvalidArgument, LLMUnavailable

MULTI = "Tests pass 🎉 沙箱 🐟 日本語"


def test_byte_level_tokens_split_multibyte_characters_exactly(bpe_model):
    tok = bpe_model.tokenizer
    ids = tok.encode(MULTI)
    pieces = [tok.token_bytes(i) for i in ids]
    assert b"".join(pieces) == MULTI.encode()
    # some token holds only part of a character: the case the UI must not garble
    assert any(_not_utf8(p) for p in pieces)
    texts = split_text(tok, ids)
    assert "".join(texts) == MULTI == tok.decode(ids) == text_of(tok, ids)
    assert "" in texts  # a token with only leading bytes of a character shows as empty, by position
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        tok.token_bytes(10 ** 6)


def _not_utf8(b: bytes) -> bool:
    try:
        b.decode()
        return False
    except UnicodeDecodeError:
        return True


def test_repro_checkpoint_loads_with_its_character_vocabulary(repro_model):
    tok = repro_model.tokenizer
    prompt = tok.encode("265+988=")
    out = list(repro_model.stream(prompt, 40, k=5))
    assert 1 <= len(out) <= repro_model.max_context - len(prompt)  # type: ignore[operator]
    assert all(len(t.top) == 5 and t.top[0].logprob >= t.top[-1].logprob for t in out)
    assert all(t.id != tok.pad_id for t in out)  # padding is never generated, nor offered
    top = repro_model.score(prompt, [out[0].id], k=50)[0].top
    assert len(top) == tok.vocab_size - 1 and all(math.isfinite(c.logprob) for c in top)
    assert "+" in tok.decode([t.id for t in out])  # it learned the format: "5+8+0=13,..."
    with pytest.raises(InvalidArgument, match="not in this model's vocabulary"):
        tok.encode("abc")


def test_score_matches_the_stream_and_top_k_are_real_probabilities(bpe_model):
    tok = bpe_model.tokenizer
    prompt = tok.encode("The agent reads")
    gen = list(bpe_model.stream(prompt, 12, k=20))
    scored = bpe_model.score(prompt, [t.id for t in gen], k=20)
    for g, s in zip(gen, scored, strict=True):
        assert g.id == s.id == s.top[0].id  # greedy: the chosen token is the top candidate
        assert math.isclose(g.logprob, s.logprob, abs_tol=1e-4)
        assert [c.id for c in g.top[:5]] == [c.id for c in s.top[:5]]
        assert sum(math.exp(c.logprob) for c in s.top) <= 1.0 + 1e-5
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        bpe_model.score(prompt, [10 ** 6])
    with pytest.raises(InvalidArgument, match="at least one prefix token"):
        list(bpe_model.stream([], 3))


def test_openai_client_against_the_scripted_server_agrees_with_the_local_model(bpe_model, scripted_server_inproc):
    scripted_server = scripted_server_inproc
    remote = OpenAIModel(scripted_server.url, bpe_model.name, bpe_model.tokenizer)
    try:
        prompt = bpe_model.tokenizer.encode("沙箱在 🐟")
        local = list(bpe_model.stream(prompt, 10, k=5))
        streamed = list(remote.stream(prompt, 10, k=5))
        assert [t.id for t in streamed] == [t.id for t in local]
        assert all(math.isclose(a.logprob, b.logprob, abs_tol=1e-4) for a, b in zip(local, streamed, strict=True))
        assert [c.id for c in streamed[0].top] == [c.id for c in local[0].top]
        resp = [t.id for t in local]
        scored = remote.score(prompt, resp, k=5)
        assert [t.id for t in scored] == resp
        assert all(math.isclose(a.logprob, b.logprob, abs_tol=1e-4) for a, b in zip(local, scored, strict=True))
        with pytest.raises(LLMUnavailable, match="answered 404"):
            list(OpenAIModel(scripted_server.url, "no-such-model", bpe_model.tokenizer).stream(prompt, 3))
    finally:
        remote.close()


def test_model_server_going_away_mid_stream_is_a_clear_error(bpe_model, scripted_server):
    import httpx

    httpx.post(f"{scripted_server.url}/admin/token_delay", json={"seconds": 0.3})
    remote = OpenAIModel(scripted_server.url, bpe_model.name, bpe_model.tokenizer)
    got = []
    threading.Timer(0.5, scripted_server.stop).start()
    t0 = time.monotonic()
    with pytest.raises(LLMUnavailable, match="went away|failed"):
        for t in remote.stream(bpe_model.tokenizer.encode("The agent"), 100, k=3):
            got.append(t)
    assert time.monotonic() - t0 < 10
    assert len(got) < 100
    with pytest.raises(LLMUnavailable, match="failed"):  # and later calls say so too
        remote.score([1, 2], [3])
    remote.close()


def test_chat_client_continues_an_assistant_prefill_with_the_local_models_tokens(bpe_model, scripted_server_inproc):
    """The chat endpoint (continue_final_message, top_logprobs) gives the same continuation, logprobs and
    top-k as the local model run on the same tokens; bad requests and split characters are clear errors."""
    import httpx

    url = scripted_server_inproc.url
    tok = bpe_model.tokenizer
    chat = OpenAIChatModel(url, bpe_model.name, tok)
    try:
        prompt = chat.encode_prompt({"messages": [{"role": "user", "content": "Fix the tests 🐟"}]})
        assert prompt == tok.encode(tok.chat_prompt([{"role": "user", "content": "Fix the tests 🐟"}]))
        head = list(chat.stream(prompt, 6, k=5))  # no prefill yet: add_generation_prompt
        assert [t.id for t in head] == [t.id for t in bpe_model.stream(prompt, 6, k=5)]
        prefix = prompt + tok.encode("Tests pass 沙箱")  # a response so far (the server re-tokenizes its text)
        local = list(bpe_model.stream(prefix, 8, k=5))
        got = list(chat.stream(prefix, 8, k=5))
        assert [t.id for t in got] == [t.id for t in local] and got
        assert all(math.isclose(a.logprob, b.logprob, abs_tol=1e-4) for a, b in zip(local, got, strict=True))
        assert [[c.id for c in t.top] for t in got] == [[c.id for c in t.top] for t in local]
        # the wire format, as vLLM takes and answers it
        r = httpx.post(f"{url}/v1/chat/completions", json={
            "model": bpe_model.name, "messages": [{"role": "user", "content": "hi"},
                                                  {"role": "assistant", "content": "The"}],
            "continue_final_message": True, "add_generation_prompt": False, "max_tokens": 3,
            "logprobs": True, "top_logprobs": 2, "temperature": 0})
        choice = r.json()["choices"][0]
        assert r.status_code == 200 and len(choice["logprobs"]["content"]) == 3
        assert len(choice["logprobs"]["content"][0]["top_logprobs"]) == 2 and choice["message"]["content"]
        bad = httpx.post(f"{url}/v1/chat/completions", json={
            "model": bpe_model.name, "messages": [{"role": "user", "content": "hi"}], "continue_final_message": True})
        assert bad.status_code == 400 and "add_generation_prompt" in bad.text
        ids = tok.encode(MULTI)
        cut = next(j for j in range(1, len(ids)) if not _decodes(b"".join(tok.token_bytes(i) for i in ids[:j])))
        split = prompt + ids[:cut]  # ends inside a character: not text
        with pytest.raises(InvalidArgument, match="inside a character"):
            list(chat.stream(split, 3))
        with pytest.raises(InvalidArgument, match="encode_prompt"):
            list(chat.stream(tok.encode("never encoded"), 3))
    finally:
        chat.close()


def test_chat_client_server_going_away_mid_stream_is_a_clear_error(bpe_model, scripted_server):
    import httpx

    # a second between tokens: the server is killed well before the model could finish (it stops early here)
    httpx.post(f"{scripted_server.url}/admin/token_delay", json={"seconds": 1.0})
    chat = OpenAIChatModel(scripted_server.url, bpe_model.name, bpe_model.tokenizer)
    prompt = chat.encode_prompt({"text": "The agent"})
    got = []
    with pytest.raises(LLMUnavailable, match="went away|failed"):
        for t in chat.stream(prompt, 100, k=3):
            if not got:  # the server goes away once the stream is under way (however slow the host)
                threading.Timer(0.2, scripted_server.stop).start()
            got.append(t)
    assert 0 < len(got) < 100
    chat.close()


def _decodes(raw: bytes) -> bool:
    try:
        raw.decode()
    except UnicodeDecodeError:
        return False
    return True
