"""The scripted server's model routes, streamed: the events spell the same text as the plain answer,
the last event names the finish reason, and the stream ends with `data: [DONE]` (what OpenAI clients
wait for)."""
from __future__ import annotations

import json

import httpx
import pytest


def events(url: str, body: dict) -> list[str]:
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_a_stream_spells_the_plain_answer_and_ends_with_done(scripted_server_inproc, route):
    if route == "completions":
        url, body = f"{scripted_server_inproc.url}/v1/completions", {"prompt": "hello there", "max_tokens": 8,
                                                                      "temperature": 0, "logprobs": 2}
    else:
        url, body = f"{scripted_server_inproc.url}/v1/chat/completions", {
            "model": "tiny-bpe", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8,
            "temperature": 0, "logprobs": True, "top_logprobs": 2}
    plain = httpx.post(url, json=body, timeout=60).json()
    evs = events(url, {**body, "stream": True})
    assert evs[-1] == "[DONE]"
    chunks = [json.loads(e) for e in evs[:-1]]
    if route == "completions":
        text = "".join(c["choices"][0]["text"] for c in chunks)
        want = plain["choices"][0]["text"]
        assert all(c["choices"][0]["logprobs"]["tokens"] for c in chunks[:-1])
    else:
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        want = plain["choices"][0]["message"]["content"]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        lps = [t for c in chunks[1:-1] for t in c["choices"][0]["logprobs"]["content"]]
        assert [t["token"] for t in lps] == [t["token"] for t in plain["choices"][0]["logprobs"]["content"]]
    assert text == want
    assert chunks[-1]["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
