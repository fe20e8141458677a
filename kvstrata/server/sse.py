"""Server-sent events in OpenAI's framing: ``data: <json>\\n\\n`` per event, ``data: [DONE]`` last."""

from __future__ import annotations

import json
from typing import Any

DONE = b"data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def encode(value: Any) -> bytes:
    """Compact JSON, UTF-8, no ASCII escaping (as OpenAI sends)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def event(payload: dict[str, Any]) -> bytes:
    """One SSE event."""
    return b"data: " + encode(payload) + b"\n\n"
