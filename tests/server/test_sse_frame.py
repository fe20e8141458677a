"""The streamed text chunk written into a per-request frame is byte for byte the chunk the general
path builds and encodes, for both endpoints, with and without ``include_usage``."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvstrata.server import sse
from kvstrata.server.engine_client import Delta, TokenLogprob
from kvstrata.server.generation import Run
from kvstrata.server.validation import Job

TEXTS = [
    "Hello",
    " world",
    'quote " and \\ backslash',
    "tab\tnew\nline\x00nul\x1f",
    "é中😀",
    "\u2028\u2029",
    "}",
]


class NoEngine:
    """The part of EngineClient a Run uses outside generation."""

    def submit(self, *args: Any) -> None:
        return None


def run(kind: str, n: int = 3, model: str = 'm"odel/中') -> Run:
    return Run(NoEngine(), kind, Job(prompts=[[1, 2]], params={"n": n}), model)  # type: ignore[arg-type]


def delta(text: str, **kw: Any) -> Delta:
    fields: dict[str, Any] = {"token_ids": [5], "logprobs": [], "finish_reason": None}
    fields.update(prompt_tokens=2, completion_tokens=1, cached_tokens=0)
    fields.update(kw)
    return Delta(text=text, **fields)


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("with_usage", [False, True])
def test_text_frame_matches_general_path(kind: str, with_usage: bool) -> None:
    r = run(kind)
    for choice in r.choices:
        for text in TEXTS:
            d = delta(text)
            expected = sse.event(r.chunk([r.delta_choice(choice, d)], None, with_usage))  # type: ignore[list-item]
            got = r.delta_event(choice, d, with_usage)
            assert got == expected
            body = json.loads(got[len(b"data: ") : -2])  # type: ignore[index]
            assert body["choices"][0]["index"] == choice.index
            field = body["choices"][0]["delta"]["content"] if kind == "chat" else body["choices"][0]["text"]
            assert field == text


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_other_deltas_take_the_general_path(kind: str) -> None:
    r = run(kind, n=1)
    choice = r.choices[0]
    cases = [
        delta("", finish_reason="stop"),
        delta("end", finish_reason="length"),
        delta("x", finish_reason="length", length_cause="kv_pool_full"),
        delta("", finish_reason="abort", error="gone"),
    ]
    for d in cases:
        expected = sse.event(r.chunk([r.delta_choice(choice, d)], None, False))  # type: ignore[list-item]
        assert r.delta_event(choice, d, False) == expected
    assert r.delta_event(choice, delta(""), False) is None  # nothing to send


def test_logprob_delta_keeps_its_logprobs() -> None:
    class Tokens(NoEngine):
        def token_text(self, token_id: int) -> str:
            return f"t{token_id}"

        def token_bytes(self, token_id: int) -> bytes:
            return f"t{token_id}".encode()

    r = Run(Tokens(), "chat", Job(prompts=[[1]], params={"return_logprob": True}), "m")  # type: ignore[arg-type]
    d = delta("t5", logprobs=[TokenLogprob(5, -0.5, [(5, -0.5)])])
    body = json.loads(r.delta_event(r.choices[0], d, False)[len(b"data: ") : -2])  # type: ignore[index]
    assert body["choices"][0]["logprobs"]["content"][0] == {
        "token": "t5",
        "logprob": -0.5,
        "bytes": list(b"t5"),
        "top_logprobs": [{"token": "t5", "logprob": -0.5, "bytes": list(b"t5")}],
    }
