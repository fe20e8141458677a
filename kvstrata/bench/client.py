"""One streaming ``/v1/completions`` request, timed chunk by chunk.

TTFT is the time to the first chunk that carries text; each later chunk with text adds one
inter-token latency (a chunk may carry several tokens when a server batches its deltas, as in SGLang's
``bench_serving``). The output length is the server's own count when it sends ``usage`` in the last
chunk (``stream_options.include_usage``); otherwise the generated text is re-tokenized, and without a
tokenizer the text chunks are counted.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from kvstrata.bench.metrics import RequestResult
from kvstrata.bench.prompts import Prompt, Vocabulary


@dataclass(frozen=True)
class Endpoint:
    base_url: str  # e.g. http://127.0.0.1:30000 (without /v1)
    model: str
    api_key: str | None = None
    ignore_eos: bool = True
    text_prompts: bool = False  # send decoded text instead of token ids

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, prompt: Prompt, vocab: Vocabulary) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": vocab.decode(prompt.ids) if self.text_prompts else prompt.ids,
            "max_tokens": prompt.output_len,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        return body


def _error_text(payload: Any) -> str | None:
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        return str(payload["error"].get("message", payload["error"]))
    if isinstance(payload, dict) and "error" in payload and payload["error"]:
        return str(payload["error"])
    return None


async def stream_request(
    client: httpx.AsyncClient, endpoint: Endpoint, prompt: Prompt, vocab: Vocabulary
) -> RequestResult:
    """Send one request and time it; never raises for a failed request (``success`` False)."""
    result = RequestResult(prompt_len=len(prompt.ids))
    text: list[str] = []
    usage: dict[str, Any] | None = None
    start = last = time.perf_counter()
    try:
        url = endpoint.base_url.rstrip("/") + "/v1/completions"
        body = endpoint.body(prompt, vocab)
        async with client.stream("POST", url, json=body, headers=endpoint.headers) as resp:
            if resp.status_code != 200:
                raw = (await resp.aread()).decode(errors="replace")
                try:
                    message = _error_text(json.loads(raw)) or raw
                except ValueError:
                    message = raw
                result.error = f"HTTP {resp.status_code}: {message[:500]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                error = _error_text(chunk)
                if error is not None:
                    result.error = error
                    return result
                if chunk.get("usage"):
                    usage = chunk["usage"]
                piece = "".join(c.get("text") or "" for c in chunk.get("choices") or [])
                if piece:
                    now = time.perf_counter()
                    if not text:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    text.append(piece)
        result.latency = time.perf_counter() - start
    except (httpx.HTTPError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    generated = "".join(text)
    if usage is not None and usage.get("completion_tokens") is not None:
        result.output_len = int(usage["completion_tokens"])
        result.prompt_len = int(usage.get("prompt_tokens") or result.prompt_len)
    elif (count := vocab.count_tokens(generated)) is not None:
        result.output_len, result.output_tokens_from = count, "retokenized"
    else:
        result.output_len, result.output_tokens_from = len(text), "chunks"
    if not text and result.output_len > 0:
        result.ttft = result.latency  # tokens without text (no tokenizer on the server): first = last
    result.success = True
    return result
