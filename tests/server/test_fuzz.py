"""Property-based fuzzing with schemathesis against /openapi.json: no input gets a 5xx.

Bounded in examples per operation and in wall time. The fuzzed server caps the context at 48 tokens
so that schema-valid requests generate a handful of tokens at most, whatever max_tokens/n they ask.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

from .conftest import API_KEY
from .live import LiveServer, live_server

MAX_EXAMPLES = 25
TIME_BUDGET_S = 35.0


@pytest.fixture(scope="module")
def fuzz_server(engine: Any) -> Iterator[LiveServer]:
    with live_server(engine, api_key=API_KEY, context_length=48, max_request_bytes=64 * 1024) as srv:
        yield srv


def test_openapi_lists_the_api(fuzz_server: LiveServer) -> None:
    spec = httpx.get(fuzz_server.url + "/openapi.json").json()
    paths = set(spec["paths"])
    assert {
        "/v1/models",
        "/v1/completions",
        "/v1/chat/completions",
        "/health",
        "/metrics",
        "/v1/cache",
    } <= paths
    body = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"][
        "schema"
    ]
    assert body == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    assert "ChatMessage" in spec["components"]["schemas"]


def _fuzz(operation: Any, mode: Any, headers: dict[str, str], deadline: float, tally: dict) -> None:
    name = f"{operation.method.upper()} {operation.path} {mode.value}"

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def fuzz(case: Any) -> None:
        if name in tally["calls"] and time.monotonic() > deadline:
            return  # time bound: the remaining examples pass without a call (the first always runs)
        response = case.call(headers=headers, timeout=120)
        tally["calls"][name] = tally["calls"].get(name, 0) + 1
        tally["status"][response.status_code] = tally["status"].get(response.status_code, 0) + 1
        assert response.status_code < 500, (name, case.body, response.text[:500])
        if response.status_code >= 400:
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}

    fuzz()


def test_no_server_errors(fuzz_server: LiveServer) -> None:
    schema = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")
    headers = {"Authorization": f"Bearer {API_KEY}"}
    started = time.monotonic()
    tally: dict[str, dict] = {"calls": {}, "status": {}}
    operations = [result.ok() for result in schema.get_all_operations()]
    with_body = sum(1 for op in operations if op.body)
    share = TIME_BUDGET_S / (2 * with_body)  # each body operation, positive and negative, gets a share
    for operation in operations:
        _fuzz(operation, schemathesis.GenerationMode.POSITIVE, headers, time.monotonic() + share, tally)
        if operation.body:  # schema-invalid bodies too
            _fuzz(operation, schemathesis.GenerationMode.NEGATIVE, headers, time.monotonic() + share, tally)
    elapsed = time.monotonic() - started
    calls, statuses = tally["calls"], tally["status"]
    print(f"\nschemathesis: {sum(calls.values())} calls in {elapsed:.1f}s; {calls}; {statuses}")
    # every operation (the pin routes included), and the three bodies schema-invalid too
    assert len(calls) == 9 + 3
    assert any(200 <= s < 300 for s in statuses) and any(400 <= s < 500 for s in statuses)
