"""The OpenAI API driven by the official `openai` client against the real engine and default model."""

from __future__ import annotations

import math

import httpx
import pytest

from .live import LiveServer, live_server

MODEL = "SmolLM2-135M-Instruct"
LONG_SYSTEM = (
    "You are a careful assistant for a library. You answer in one short sentence, you never invent "
    "facts, and when you do not know something you say so plainly. The library opens at nine, closes "
    "at six, and lends books for three weeks; fines are ten cents a day."
)


def test_models_lists_the_served_model(server: LiveServer) -> None:
    models = server.openai().models.list()
    ids = [m.id for m in models.data]
    assert ids == [MODEL]
    with server.client() as c:
        body = c.get("/v1/models").json()
    assert body["object"] == "list"
    assert body["data"][0]["max_model_len"] == 8192


def test_chat_non_streaming_usage_and_cached_prefix(server: LiveServer) -> None:
    client = server.openai()
    messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "When do you open?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert first.object == "chat.completion"
    assert first.choices[0].message.role == "assistant"
    assert first.choices[0].finish_reason in ("stop", "length")
    assert 1 <= first.usage.completion_tokens <= 8
    assert first.usage.prompt_tokens > 64
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens
    # the same system prompt again: its full pages come from the prefix tree
    again = [
        {"role": "system", "content": LONG_SYSTEM},
        {"role": "user", "content": "How long can I keep a book?"},
    ]
    second = client.chat.completions.create(model=MODEL, messages=again, max_tokens=8, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 48, cached
    assert cached % 16 == 0 and cached < second.usage.prompt_tokens


def test_chat_streaming_with_usage_matches_non_streaming(server: LiveServer) -> None:
    client = server.openai()
    messages = [{"role": "user", "content": "Name three colors."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == whole.choices[0].message.content
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_sse_framing_ends_with_done(server: LiveServer) -> None:
    body = {"model": MODEL, "prompt": "One, two,", "max_tokens": 4, "temperature": 0, "stream": True}
    with server.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert len(events) >= 2


def test_completions_streaming_and_not(server: LiveServer) -> None:
    client = server.openai()
    whole = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0
    )
    assert whole.object == "text_completion"
    assert whole.usage.completion_tokens == 6 and whole.choices[0].finish_reason == "length"
    parts = list(
        client.completions.create(
            model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0, stream=True
        )
    )
    assert "".join(p.choices[0].text for p in parts) == whole.choices[0].text
    assert parts[-1].choices[0].finish_reason == "length"


def test_completions_batch_of_prompts_and_token_ids(server: LiveServer) -> None:
    client = server.openai()
    out = client.completions.create(model=MODEL, prompt=["Once upon", "In 1969"], max_tokens=3, temperature=0)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.completion_tokens == 6
    ids = client.completions.create(model=MODEL, prompt=[504, 3458, 282], max_tokens=2, temperature=0)
    assert ids.usage.prompt_tokens == 3 and ids.usage.completion_tokens == 2


def test_n_seed_and_temperature(server: LiveServer) -> None:
    client = server.openai()
    kwargs = {"model": MODEL, "prompt": "My favourite animal is", "max_tokens": 8, "temperature": 1.0}
    a = client.completions.create(n=3, seed=1234, **kwargs)
    b = client.completions.create(n=3, seed=1234, **kwargs)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert len({c.text for c in a.choices}) >= 2  # each sample has its own seed
    single = client.completions.create(model=MODEL, prompt="My favourite animal is", max_tokens=1)
    assert a.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counts once, not n times
    assert 3 <= a.usage.completion_tokens <= 3 * 8


def test_chat_streaming_n_choices(server: LiveServer) -> None:
    stream = server.openai().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Pick a fruit."}],
        max_tokens=5,
        temperature=1.0,
        seed=7,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]
    finishes = {
        c.choices[0].index: c.choices[0].finish_reason
        for c in chunks
        if c.choices and c.choices[0].finish_reason
    }
    assert set(finishes) == {0, 1}
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and 2 <= usage.completion_tokens <= 10


def test_stop_strings_and_penalties(server: LiveServer) -> None:
    client = server.openai()
    out = client.completions.create(
        model=MODEL, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[" 7"], presence_penalty=0.0
    )
    assert out.choices[0].finish_reason == "stop"
    assert " 7" not in out.choices[0].text
    penalised = client.completions.create(
        model=MODEL,
        prompt="1, 2, 3, 4,",
        max_tokens=12,
        temperature=0,
        frequency_penalty=2.0,
        presence_penalty=2.0,
    )
    assert (
        penalised.choices[0].text
        != client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0)
        .choices[0]
        .text
    )


def test_logprobs_chat_and_completions(server: LiveServer) -> None:
    client = server.openai()
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hi."}],
        max_completion_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0.0 and len(entry.top_logprobs) == 3
        # greedy: the chosen token is the most likely one
        assert math.isclose(
            entry.logprob, max(t.logprob for t in entry.top_logprobs), rel_tol=1e-5, abs_tol=1e-5
        )
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    assert "".join(e.token for e in content) == chat.choices[0].message.content
    assert b"".join(bytes(e.bytes) for e in content).decode("utf-8") == chat.choices[0].message.content
    comp = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert lp.text_offset[0] == 0 and all(len(t) == 2 for t in lp.top_logprobs)


def test_auth_and_open_endpoints(server: LiveServer) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        assert c.get("/health").status_code == 200
        assert c.get("/metrics").status_code == 200  # open unless --protect-metrics
        missing = c.get("/v1/models")
        assert missing.status_code == 401
        assert missing.json()["error"]["code"] == "missing_api_key"
        wrong = c.get("/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        assert wrong.json()["error"] == {
            "message": "invalid API key",
            "type": "authentication_error",
            "param": None,
            "code": "invalid_api_key",
        }
        basic = c.post("/v1/chat/completions", headers={"Authorization": f"Basic {server.api_key}"}, json={})
        assert basic.status_code == 401
    import openai

    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_protected_metrics(engine: object) -> None:
    with live_server(engine, api_key="k", protect_metrics=True) as srv, httpx.Client(base_url=srv.url) as c:
        assert c.get("/metrics").status_code == 401
        assert c.get("/metrics", headers={"Authorization": "Bearer k"}).status_code == 200
        assert c.get("/health").status_code == 200


def test_cache_endpoint_and_flush(server: LiveServer) -> None:
    body = server.wait_idle()
    cold = body["tiers"]["cold"]
    assert cold["total_pages"] == cold["pages"]["free"] + cold["pages"]["used"]
    page_bytes = cold["total_bytes"] // cold["total_pages"]
    assert cold["bytes"]["used"] == cold["pages"]["used"] * page_bytes
    assert cold["bytes_per_token"] * 16 == page_bytes
    assert 0.0 <= body["hit_rate"] <= 1.0
    with server.client() as c:
        r = c.post("/v1/cache/flush")
    assert r.status_code == 200 and r.json() == {"flushed": True}
    after = server.cache()
    assert after["pages_in_tree"] == 0 and after["tiers"]["cold"]["pages"]["used"] == 0
