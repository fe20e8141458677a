"""One streamed request against scripted servers (httpx.MockTransport): what is sent, how chunks are
timed and counted, and how failures are reported."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import numpy as np

from kvstrata.bench.client import Endpoint, stream_request
from kvstrata.bench.metrics import RequestResult
from kvstrata.bench.prompts import Prompt, Vocabulary


class WordTokenizer:
    """A stand-in tokenizer: one token per space-separated word."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(range(len(text.split())))

    def decode(self, ids: list[int]) -> str:
        return " ".join(f"w{i}" for i in ids)


def _sse(*events: Any) -> bytes:
    lines = [f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events]
    return "".join(lines).encode()


def _text(t: str) -> dict:
    return {"choices": [{"index": 0, "text": t, "finish_reason": None}]}


def _run(handler: Any, vocab: Vocabulary, endpoint: Endpoint | None = None) -> RequestResult:
    async def go() -> RequestResult:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            ep = endpoint or Endpoint("http://test", "m")
            return await stream_request(client, ep, Prompt([5, 6, 7], 4), vocab)

    return asyncio.run(go())


VOCAB = Vocabulary(np.arange(10), WordTokenizer(), "words")
BARE = Vocabulary(np.arange(10), None, "config")


def test_request_body_and_usage_from_the_last_chunk() -> None:
    sent: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}
        body = _sse(_text("a"), _text(""), _text("b c"), _text("d"), usage, "[DONE]")
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    res = _run(handler, VOCAB)
    assert sent == [
        {
            "model": "m",
            "prompt": [5, 6, 7],
            "max_tokens": 4,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
    ]
    assert res.success and res.error == ""
    assert (res.prompt_len, res.output_len, res.output_tokens_from) == (3, 4, "usage")
    assert len(res.itl) == 2  # three chunks with text: the first is TTFT, then two gaps
    assert 0 < res.ttft <= res.latency and all(gap >= 0 for gap in res.itl)


def test_without_usage_the_text_is_retokenized_or_the_chunks_counted() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=_sse(_text("one two"), _text(" three"), "[DONE]"))

    res = _run(handler, VOCAB)
    assert res.success and (res.output_len, res.output_tokens_from) == (3, "retokenized")
    res = _run(handler, BARE)
    assert res.success and (res.output_len, res.output_tokens_from) == (2, "chunks")


def test_text_prompts_and_eos_allowed() -> None:
    sent: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(200, content=_sse(_text("x"), "[DONE]"))

    endpoint = Endpoint("http://test/", "m", api_key="k", ignore_eos=False, text_prompts=True)
    assert _run(handler, VOCAB, endpoint).success
    assert sent[0]["prompt"] == "w5 w6 w7" and "ignore_eos" not in sent[0]


def test_failures_are_reported_not_raised() -> None:
    def http_error(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": {"message": "max_tokens is too large", "type": "x"}})

    res = _run(http_error, VOCAB)
    assert not res.success and res.error == "HTTP 400: max_tokens is too large"

    def in_band(request: httpx.Request) -> httpx.Response:
        body = _sse(_text("a"), {"error": {"message": "the engine aborted the request"}}, "[DONE]")
        return httpx.Response(200, content=body)

    res = _run(in_band, VOCAB)
    assert not res.success and res.error == "the engine aborted the request"

    def refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused")

    res = _run(refused, VOCAB)
    assert not res.success and res.error == "ConnectError: connection refused"

    def garbage(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b"data: {not json\n\n")

    res = _run(garbage, VOCAB)
    assert not res.success and res.error.startswith("JSONDecodeError")


def test_cli_reports_an_unreachable_server_and_bad_flags_in_one_line(capsys) -> None:
    import socket

    from kvstrata.cli import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once the socket is closed
    assert main(["bench", "--base-url", f"http://127.0.0.1:{port}", "--disable-tqdm"]) == 1
    assert "kvstrata bench: ConnectError" in capsys.readouterr().err
    tokenizer = ["--model", "m", "--tokenizer", "/no/such/dir"]
    assert main(["bench", *tokenizer, "--base-url", f"http://127.0.0.1:{port}"]) == 1
    assert "--tokenizer /no/such/dir: no such file or directory" in capsys.readouterr().err
