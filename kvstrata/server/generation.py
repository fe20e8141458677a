"""Running the choices of one API request on the engine and shaping OpenAI's responses.

A request has ``len(prompts) * n`` choices, submitted as one engine batch (choice index =
prompt * n + sample). The same path serves streaming and non-streaming: the latter just
accumulates. Leaving the stream early (client gone) aborts every unfinished choice in the engine.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from kvstrata.server import sse
from kvstrata.server.engine_client import Delta, EngineClient, TokenLogprob
from kvstrata.server.validation import Job

Kind = Literal["chat", "completion"]
# placeholders the text frame is cut at: control characters, which JSON always escapes
_INDEX, _TEXT = "\x00kvstrata-index\x00", "\x00kvstrata-text\x00"


@dataclass
class Choice:
    index: int
    job: int
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    text_offset: int = 0  # characters already streamed (completions' text_offset)
    length_cause: str | None = None


class Run:
    """The choices of one request and their accumulated state."""

    def __init__(self, client: EngineClient, kind: Kind, job: Job, model: str) -> None:
        self.client = client
        self.kind = kind
        self.job = job
        self.model = model
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.choices = [
            Choice(index=p * job.n + j, job=p, prompt_tokens=len(ids))
            for p, ids in enumerate(job.prompts)
            for j in range(job.n)
        ]

        self._frames: dict[bool, tuple[bytes, bytes, bytes]] = {}
        self.request = client.submit(job.prompts, job.params, job.images)  # raises APIError(400) on bad input

    async def start(self) -> None:
        """Raise the engine's refusal (APIError 400/503) before the response starts."""
        await self.request.start()

    def deltas(self) -> AsyncIterator[tuple[int, Delta]]:
        return self.request.deltas()

    def abort(self) -> None:
        self.request.abort()

    def apply(self, index: int, delta: Delta) -> Choice:
        c = self.choices[index]
        c.text.append(delta.text)
        c.logprobs.extend(delta.logprobs)
        c.prompt_tokens = delta.prompt_tokens or c.prompt_tokens
        c.completion_tokens = delta.completion_tokens
        c.cached_tokens = max(c.cached_tokens, delta.cached_tokens)
        if delta.finish_reason is not None:
            c.finish_reason = delta.finish_reason
            c.error = delta.error
            c.length_cause = delta.length_cause
        return c

    @property
    def error(self) -> str | None:
        return next((c.error for c in self.choices if c.error), None)

    def usage(self) -> dict[str, Any]:
        prompt = cached = 0
        for p, ids in enumerate(self.job.prompts):
            # the engine's count: image placeholder spans included
            prompt += next((c.prompt_tokens for c in self.choices if c.job == p), len(ids))
            # The prompt is computed once, by its first choice; the others match the pages it cached.
            cached += next((c.cached_tokens for c in self.choices if c.job == p), 0)
        completion = sum(c.completion_tokens for c in self.choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    # --- logprobs ---------------------------------------------------------------------------------
    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.client.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(self.client.token_bytes(token_id))}

    def logprobs(self, choice: Choice, items: list[TokenLogprob]) -> dict[str, Any] | None:
        wanted = self.job.params.get("return_logprob", False)
        if not wanted:
            return None
        if self.kind == "chat":
            content = []
            for item in items:
                entry = self._entry(item.token_id, item.logprob)
                entry["top_logprobs"] = [self._entry(t, lp) for t, lp in item.top]
                content.append(entry)
            return {"content": content}
        tokens, offsets, tops = [], [], []
        for item in items:
            text = self.client.token_text(item.token_id)
            tokens.append(text)
            offsets.append(choice.text_offset)
            choice.text_offset += len(text)
            tops.append({self.client.token_text(t): lp for t, lp in item.top})
        return {
            "tokens": tokens,
            "token_logprobs": [item.logprob for item in items],
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    # --- response bodies --------------------------------------------------------------------------
    def response(self) -> dict[str, Any]:
        choices = []
        for c in self.choices:
            text = "".join(c.text)
            finish = c.finish_reason if c.finish_reason in ("stop", "length") else "stop"
            logprobs = self.logprobs(c, c.logprobs)
            if self.kind == "chat":
                message = {"role": "assistant", "content": text, "refusal": None}
                body = {"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": finish}
            else:
                body = {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": finish}
            choices.append(_with_details(body, c.length_cause))
        return {
            "id": self.id,
            "object": "chat.completion" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
            "system_fingerprint": None,
        }

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None, with_usage: bool) -> dict:
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }
        if with_usage:
            body["usage"] = usage
        return body

    def role_chunk(self, index: int) -> dict[str, Any]:
        return {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }

    def delta_choice(self, choice: Choice, delta: Delta) -> dict[str, Any] | None:
        """The streamed choice for one engine delta (None when it carries nothing)."""
        finish = None
        if delta.finish_reason is not None:
            finish = delta.finish_reason if delta.finish_reason in ("stop", "length") else "stop"
        if not delta.text and not delta.logprobs and finish is None:
            return None
        logprobs = self.logprobs(choice, delta.logprobs) if delta.logprobs else None
        body = self._choice(choice.index, delta.text, logprobs, finish)
        return _with_details(body, delta.length_cause if finish is not None else None)

    def _choice(self, index: Any, text: str, logprobs: Any, finish: str | None) -> dict[str, Any]:
        if self.kind == "chat":
            content = {"content": text} if text else {}
            return {"index": index, "delta": content, "logprobs": logprobs, "finish_reason": finish}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def delta_event(self, choice: Choice, delta: Delta, with_usage: bool) -> bytes | None:
        """The SSE event of one engine delta (None when it carries nothing). A delta of text alone,
        nearly every one, is written into a frame rendered once per request: the same bytes as
        ``sse.event(self.chunk([self.delta_choice(...)], None, with_usage))`` without building and
        encoding the whole chunk per token."""
        if not delta.text or delta.logprobs or delta.finish_reason is not None:
            body = self.delta_choice(choice, delta)
            return None if body is None else sse.event(self.chunk([body], None, with_usage))
        frame = self._frames.get(with_usage)
        if frame is None:
            frame = self._frames[with_usage] = self._text_frame(with_usage)
        head, middle, tail = frame
        return b"".join((head, str(choice.index).encode(), middle, sse.encode(delta.text), tail))

    def _text_frame(self, with_usage: bool) -> tuple[bytes, bytes, bytes]:
        """The text-only chunk rendered by the general path with placeholders, cut around them."""
        rendered = sse.event(self.chunk([self._choice(_INDEX, _TEXT, None, None)], None, with_usage))
        head, rest = rendered.split(sse.encode(_INDEX))
        middle, tail = rest.split(sse.encode(_TEXT))
        return head, middle, tail


def _with_details(choice: dict[str, Any], length_cause: str | None) -> dict[str, Any]:
    """A "length" finish caused by a full KV pool says so (OpenAI has no finish_reason for it)."""
    if length_cause is not None:
        choice["finish_details"] = {
            "type": "length",
            "cause": length_cause,
            "message": "the KV cache pool is full: the sequence could not grow, so generation stopped early",
        }
    return choice
