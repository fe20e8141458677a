"""Every bad input gets a 4xx in OpenAI's error shape, and the server stays up and leaks nothing."""

from __future__ import annotations

import json
from typing import Any

import pytest

from .live import LiveServer

MODEL = "SmolLM2-135M-Instruct"
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


def _error(r: Any, status: int, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert (
        err["type"]
        == {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}[status]
    )
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


def _chat(**over: Any) -> dict[str, Any]:
    body = dict(OK_CHAT)
    body.update(over)
    return body


def _raw(server: LiveServer, path: str, content: bytes, **headers: str) -> Any:
    with server.client() as c:
        return c.post(path, content=content, headers={"Content-Type": "application/json", **headers})


@pytest.mark.parametrize(
    ("content", "code"),
    [
        (b'{"model": "x", "messages": [', "invalid_json"),
        (b"not json at all", "invalid_json"),
        (b"", "invalid_json"),
        (b"[1, 2, 3]", "invalid_json"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "invalid_json"),
        (b'{"messages": [{"role": "user", "content": "\xff\xfe caf\xc3"}]}', "invalid_utf8"),
        (b'{"messages": ' + b"[" * 20_000 + b"]" * 20_000 + b"}", "invalid_json"),
        (b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 1}', "invalid_utf8"),
    ],
)
def test_malformed_bodies(server: LiveServer, content: bytes, code: str) -> None:
    _error(_raw(server, CHAT, content), 400, code)


@pytest.mark.parametrize(
    ("over", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": "hello"}, "messages"),
        ({"messages": [{"content": "no role"}]}, "messages[0].role"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "messages[0]"),
        ({"messages": [{"role": "user", "content": 42}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "x": 1}]}]}, "messages[0].content"),
        ({"max_tokens": "10"}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": 3.0}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"n": 1000}, "n"),
        ({"stream": "yes"}, "stream"),
        ({"stop": 5}, "stop"),
        ({"presence_penalty": 9}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"seed": "abc"}, "seed"),
        ({"top_logprobs": 3}, None),
        ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ],
)
def test_wrong_types_and_ranges_chat(server: LiveServer, over: dict[str, Any], param: str | None) -> None:
    with server.client() as c:
        err = _error(c.post(CHAT, json=_chat(**over)), 400, "invalid_value")
    if param is not None:
        assert err["param"] == param, err


@pytest.mark.parametrize(
    ("over", "param"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"prompt": [99_999_999]}, "prompt"),
        ({"logprobs": 6}, "logprobs"),
        ({"echo": True}, None),
        ({"max_tokens": 10**9}, "max_tokens"),
        ({"top_k": 2**70}, "top_k"),
        ({"repetition_penalty": 1e-39}, "repetition_penalty"),
        ({"stop": "x" * 1025}, "stop"),
    ],
)
def test_bad_completions(server: LiveServer, over: dict[str, Any], param: str | None) -> None:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 1, **over}
    with server.client() as c:
        err = _error(c.post(COMP, json=body), 400)
    if param is not None:
        assert err["param"] == param, err


def test_prompt_longer_than_context(server: LiveServer) -> None:
    with server.client() as c:
        ctx = c.get("/v1/models").json()["data"][0]["max_model_len"]
        long_ids = [28] * (ctx + 10)
        err = _error(c.post(COMP, json={"model": MODEL, "prompt": long_ids, "max_tokens": 1}), 400)
        assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
        assert str(ctx) in err["message"]
        # prompt fits, prompt + max_tokens does not
        err = _error(c.post(COMP, json={"model": MODEL, "prompt": [28] * 100, "max_tokens": ctx}), 400)
        assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
        text = "word " * (ctx + 100)
        err = _error(c.post(CHAT, json=_chat(messages=[{"role": "user", "content": text}])), 400)
        assert err["code"] == "context_length_exceeded" and err["param"] == "messages"


def test_oversized_body(server: LiveServer) -> None:
    big = json.dumps(_chat(messages=[{"role": "user", "content": "x" * 70_000}])).encode()
    assert len(big) > 64 * 1024
    _error(_raw(server, CHAT, big), 400, "request_too_large")

    def chunks() -> Any:  # no Content-Length: the limit is enforced while reading
        for _ in range(20):
            yield b" " * 8192

    with server.client() as c:
        r = c.post(CHAT, content=chunks(), headers={"Content-Type": "application/json"})
    _error(r, 400, "request_too_large")


def test_unknown_model_is_404(server: LiveServer) -> None:
    with server.client() as c:
        _error(c.post(CHAT, json=_chat(model="gpt-9")), 404, "model_not_found", "model")
        _error(c.post(COMP, json={"model": "nope", "prompt": "x"}), 404, "model_not_found", "model")
        _error(c.get("/v1/nothing-here"), 404)


def test_server_stays_up_and_leaks_nothing(server: LiveServer) -> None:
    before = server.wait_idle()
    with server.client() as c:
        for _ in range(3):
            _error(c.post(CHAT, content=b"{", headers={"Content-Type": "application/json"}), 400)
            _error(c.post(CHAT, json=_chat(max_tokens=0)), 400)
        ok = c.post(CHAT, json=OK_CHAT)
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["completion_tokens"] == 1
    after = server.wait_idle()
    assert after["tiers"]["ring"]["pages"]["used"] == 0
    assert after["pages_in_use"] == after["pages_in_tree"]
    assert after["pages_in_tree"] >= before["pages_in_tree"]
