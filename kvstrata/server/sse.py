"""Server-sent events in OpenAI's framing: ``data: <json>\\n\\n`` per event, ``data: [DONE]`` last."""

from __future__ import annotations

import json
from typing import Any

DONE = b"data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(payload: dict[str, Any]) -> bytes:
    """One SSE event; compact JSON, UTF-8, no ASCII escaping (as OpenAI sends)."""
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
