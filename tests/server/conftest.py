"""Fixtures: the default model's engine is loaded once per session and served by one live uvicorn
server; modules that need other engine options build their own with ``live_server``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from .live import LiveServer, live_server

API_KEY = "test-key-0123456789"
# The session engine: quantized history (int8) behind a 32-token BF16 window, so that prompts of a
# few pages exercise cold pages, the ring and the prefix tree together.
DEFAULT_ENGINE = {"kv_cache_dtype": "int8", "recent_window": 32, "max_running_requests": 32}


@pytest.fixture(scope="session")
def engine() -> Iterator[Any]:
    from kvstrata import Engine

    eng = Engine(**DEFAULT_ENGINE)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def server(engine: Any) -> Iterator[LiveServer]:
    with live_server(engine, api_key=API_KEY, max_request_bytes=64 * 1024) as srv:
        yield srv
