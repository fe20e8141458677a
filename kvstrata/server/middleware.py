"""Pure ASGI middleware: API-key check and request-body size limit.

Pure ASGI (not ``BaseHTTPMiddleware``) so that streaming responses and client-disconnect
notifications pass through untouched.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from kvstrata.server.errors import error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


async def send_error(send: Send, status: int, message: str, code: str) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class AuthMiddleware:
    """``/v1/*`` (and ``/metrics`` when protected) need ``Authorization: Bearer <key>``."""

    def __init__(self, app: ASGIApp, api_key: str | None, protect_metrics: bool = False) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.protect_metrics = protect_metrics

    def _protected(self, path: str) -> bool:
        return path == "/v1" or path.startswith("/v1/") or (self.protect_metrics and path == "/metrics")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.key is None or scope["type"] != "http" or not self._protected(scope["path"]):
            await self.app(scope, receive, send)
            return
        given = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    given = token.strip()
                break
        if not given:
            message = "missing API key: send 'Authorization: Bearer <key>'"
            await send_error(send, 401, message, "missing_api_key")
            return
        if not hmac.compare_digest(given, self.key):
            await send_error(send, 401, "invalid API key", "invalid_api_key")
            return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Reject bodies over ``max_bytes`` with a 400 before any of it is parsed."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        too_large = f"request body exceeds the limit of {self.max_bytes} bytes"
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await send_error(send, 400, "invalid Content-Length", "invalid_request")
                    return
                if declared > self.max_bytes:
                    await send_error(send, 400, too_large, "request_too_large")
                    return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await send_error(send, 400, too_large, "request_too_large")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
