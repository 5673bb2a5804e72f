"""An LLM judge over any OpenAI-compatible endpoint: the prefix rendered into the prompt template
(`prompts/judge.md`), a JSON-schema answer (`response_format`), and retries on invalid output.

- HTTP failures (408/409/425/429/5xx, connection errors) are retried with backoff, as the policy
  client does; after that `LLMUnavailable`.
- An answer that is not a JSON object of the schema (no JSON, an unknown risk or class, extra
  fields) is retried `retries` times, with the bad answer and what was wrong with it added to the
  conversation; after that `JudgeOutputInvalid`.
- Servers without `response_format: json_schema` still work: the prompt asks for the object, and
  the first `{...}` in the answer is parsed.

`scripted_judge_completion` is the judge behind `rollout.scripted_server` (model "judge", or
"judge-bad:N" that answers N invalid times first): it reads the prefix back from the prompt and
answers with the programmatic diagnoser, so the whole HTTP path runs without a model.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from string import Template
from typing import Any

import httpx
from pydantic import ValidationError

from ..core.errors import InvalidArgument, ShoalError
from ..rollout.policy import post_chat_completions
from .diagnoser import Diagnoser
from .schema import TAXONOMY, Prefix, Risk, StepDiagnosis, json_schema_for_judge

TEMPLATE_PATH = Path(__file__).with_name("prompts") / "judge.md"
OBS_CHARS = 1500  # per observation in the prompt: the judge needs the gist, not whole files
_JSON_BLOCK = re.compile(r"```json\n(.*?)\n```", re.S)


class JudgeOutputInvalid(ShoalError):
    """The judge answered, but never with a valid diagnosis within its retries."""


def _clip(text: str, n: int = OBS_CHARS) -> str:
    return text if len(text) <= n else f"{text[: n // 2]}\n[... {len(text) - n} characters cut ...]\n{text[-n // 2:]}"


def prefix_json(prefix: Prefix) -> str:
    d = prefix.model_dump(mode="json", exclude={"problem"})
    for s in d["steps"]:
        for a in s["actions"]:
            a["observation"] = _clip(a["observation"])
            for k, v in list(a["arguments"].items()):
                if isinstance(v, str):
                    a["arguments"][k] = _clip(v)
    return json.dumps(d, indent=1)


def render(prefix: Prefix, template: str) -> str:
    return Template(template).substitute(
        step=prefix.k, risks=", ".join(r.value for r in Risk),
        taxonomy="\n".join(f"- {c.value}: {why}" for c, why in TAXONOMY.items()),
        problem=prefix.problem.strip() or "(not given)", prefix_json=prefix_json(prefix))


def parse_answer(text: str, step: int, name: str) -> StepDiagnosis:
    """A StepDiagnosis from a judge's text; InvalidArgument says what is wrong with it."""
    m = re.search(r"\{.*\}", text or "", re.S)
    if not m:
        raise InvalidArgument("the answer holds no JSON object")
    try:
        d = json.loads(m.group(0))
    except ValueError as e:
        raise InvalidArgument(f"the answer is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise InvalidArgument("the answer is not a JSON object")
    extra = set(d) - {"risk", "error_class", "evidence", "fix"}
    if extra:
        raise InvalidArgument(f"unexpected fields {sorted(extra)}")
    try:
        return StepDiagnosis(step=step, diagnoser=name, **d)
    except (ValidationError, TypeError) as e:
        raise InvalidArgument(f"the answer does not match the schema: {str(e)[:400]}") from None


class LLMJudge(Diagnoser):
    def __init__(self, url: str, model: str, api_key: str | None = None, *, template: str | Path | None = None,
                 retries: int = 2, http_retries: int = 3, backoff_s: float = 0.5, timeout_s: float = 120.0,
                 temperature: float = 0.0, max_tokens: int = 600, json_schema: bool = True):
        if not url.startswith(("http://", "https://")):
            raise InvalidArgument(f"judge url must be http(s)://host[:port][/v1], got {url!r}")
        self.url = url.rstrip("/")
        if not self.url.endswith("/v1"):
            self.url += "/v1"
        self.model, self.name = model, f"judge:{model}"
        self.template = Path(template).read_text() if isinstance(template, Path) else \
            (template if template is not None else TEMPLATE_PATH.read_text())
        self.retries, self.http_retries, self.backoff_s = retries, http_retries, backoff_s
        self.temperature, self.max_tokens, self.json_schema = temperature, max_tokens, json_schema
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(timeout=timeout_s, headers=headers)
        self.calls = self.invalid = 0
        self.tokens = 0

    def request(self, prefix: Prefix) -> dict[str, Any]:
        """The first request for a prefix (what a test compares to show hindsight-freedom)."""
        body: dict[str, Any] = {"model": self.model, "temperature": self.temperature, "max_tokens": self.max_tokens,
                                "messages": [{"role": "user", "content": render(prefix, self.template)}]}
        if self.json_schema:
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "step_diagnosis", "strict": True, "schema": json_schema_for_judge()}}
        return body

    async def _post(self, body: dict) -> dict:
        def count() -> None:
            self.calls += 1
        return await post_chat_completions(self._client, self.url, body, retries=self.http_retries,
                                           backoff_s=self.backoff_s, on_attempt=count, who="judge")

    async def diagnose(self, prefix: Prefix) -> StepDiagnosis:
        body = self.request(prefix)
        why = ""
        for _ in range(self.retries + 1):
            out = await self._post(body)
            usage = out.get("usage") or {}
            self.tokens += int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0)
            try:
                text = out["choices"][0]["message"].get("content") or ""
            except (KeyError, IndexError, TypeError, AttributeError):
                text = ""
            try:
                return parse_answer(text, prefix.k, self.name)
            except InvalidArgument as e:
                self.invalid += 1
                why = str(e)
                body = {**body, "messages": [*body["messages"], {"role": "assistant", "content": text},
                                             {"role": "user", "content": f"That answer is not valid: {why}. Answer "
                                              "with only the JSON object, fields risk, error_class, evidence, fix."}]}
        raise JudgeOutputInvalid(f"judge {self.model} gave no valid diagnosis in {self.retries + 1} tries; last: {why}")

    async def aclose(self) -> None:
        await self._client.aclose()


def scripted_judge_completion(body: dict) -> dict:
    """A chat completion answering a judge request with the programmatic diagnoser (see module doc)."""
    from .programmatic import ProgrammaticDiagnoser

    messages = body.get("messages") or []
    model = str(body.get("model", "judge"))
    bad = int(model.partition(":")[2] or 0) if model.startswith("judge-bad") else 0
    tries = sum(1 for m in messages if m.get("role") == "assistant")
    first = next((m.get("content") or "" for m in messages if m.get("role") == "user"), "")
    if tries < bad:
        content = ["no JSON here", '{"risk": "severe", "error_class": "none", "evidence": "", "fix": ""}',
                   '{"risk": "low"'][tries % 3]
    else:
        m = _JSON_BLOCK.search(first)
        if not m:
            content = "I cannot see an episode in this prompt."
        else:
            d = json.loads(m.group(1))
            d.setdefault("problem", "")
            dg = ProgrammaticDiagnoser().diagnose_now(Prefix.model_validate(d))
            content = json.dumps(dg.model_dump(mode="json", include={"risk", "error_class", "evidence", "fix"}))
    return {"id": "chatcmpl-judge", "object": "chat.completion", "model": model,
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": content}}],
            "usage": {"prompt_tokens": sum(len(str(m.get("content") or "")) // 4 for m in messages),
                      "completion_tokens": len(content) // 4}}
