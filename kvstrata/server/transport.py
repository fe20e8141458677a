"""uvicorn's event loop and HTTP implementation: uvloop and httptools (both in C) where installed,
else asyncio and h11 (pure Python, about a third more event-loop time per streamed chunk; see
docs/server.md, "Streaming and the host's time per step")."""

from __future__ import annotations

import importlib.util


def uvicorn_options() -> dict[str, str]:
    """``loop`` and ``http`` for ``uvicorn.run``/``uvicorn.Config``: the fastest ones importable."""
    return {
        "loop": "uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
        "http": "httptools" if importlib.util.find_spec("httptools") else "h11",
    }
