"""The same greedy stream, event for event (but its id, time and cache hits), over uvicorn's pure-Python stack
(asyncio + h11) and its C one (uvloop + httptools, what `kvstrata serve` picks when installed)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from .live import live_server

PURE_PYTHON = {"loop": "asyncio", "http": "h11"}
C_STACK = {"loop": "uvloop", "http": "httptools"}
BODY = {
    "messages": [{"role": "user", "content": "Name three colours."}],
    "max_tokens": 12,
    "temperature": 0,
    "stream": True,
    "stream_options": {"include_usage": True},
}


def stream_events(engine: Any, transport: dict[str, str]) -> tuple[list[dict[str, Any]], str]:
    with live_server(engine, transport=transport) as srv, srv.client() as c:
        r = c.post("/v1/chat/completions", json=BODY)
        assert r.status_code == 200
        lines = [ln for ln in r.text.split("\n\n") if ln]
        assert lines[-1] == "data: [DONE]"
        events = [json.loads(ln.removeprefix("data: ")) for ln in lines[:-1]]
        for e in events:
            e.pop("id"), e.pop("created")
            if e.get("usage"):  # the second server's engine finds the prompt in its prefix cache
                e["usage"].pop("prompt_tokens_details")
        # the official client parses the stream
        chunks = srv.openai().chat.completions.create(model=events[0]["model"], **BODY)
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        return events, text


def test_c_stack_streams_the_same_bytes(engine: Any) -> None:
    pytest.importorskip("uvloop")
    pytest.importorskip("httptools")
    pure, pure_text = stream_events(engine, PURE_PYTHON)
    fast, fast_text = stream_events(engine, C_STACK)
    assert fast == pure
    assert len(pure) >= 3  # role, text, usage
    streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in pure if e["choices"])
    assert streamed == pure_text == fast_text
