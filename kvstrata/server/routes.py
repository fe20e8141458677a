"""HTTP endpoints: the OpenAI API (/v1/models, /v1/completions, /v1/chat/completions) and the
operational ones (/health, /metrics, /v1/cache, /v1/cache/flush)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvstrata.server import sse
from kvstrata.server.config import ServerConfig
from kvstrata.server.engine_client import EngineClient
from kvstrata.server.errors import APIError
from kvstrata.server.generation import Kind, Run
from kvstrata.server.metrics import ServerMetrics
from kvstrata.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    ModelList,
    PinRequest,
)
from kvstrata.server.validation import Job, chat_job, check_model, completion_job, parse_body, pin_prompt

log = logging.getLogger("kvstrata.server")
router = APIRouter()
T = TypeVar("T")
DISCONNECT_POLL_S = 0.25
ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid request"},
    401: {"model": ErrorResponse, "description": "Missing or wrong API key"},
    404: {"model": ErrorResponse, "description": "Unknown model"},
}
PIN_ERRORS: dict[int | str, dict[str, Any]] = {
    **ERRORS,
    404: {"model": ErrorResponse, "description": "Unknown pin"},
    409: {"model": ErrorResponse, "description": "The pinned-bytes budget cannot take the prefix"},
}


@dataclass
class ServerState:
    client: EngineClient
    metrics: ServerMetrics
    config: ServerConfig
    started: float


def state(request: Request) -> ServerState:
    return request.app.state.kvstrata


def _body_schema(model: type) -> dict[str, Any]:
    name = model.__name__
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}},
        }
    }


class EventStream(StreamingResponse):
    """A StreamingResponse that always closes its generator and aborts its run, so a vanished
    client's request is aborted at once (not when the generator is garbage-collected)."""

    def __init__(self, run: Run, body: AsyncIterator[bytes]) -> None:
        super().__init__(body, media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)
        self.run = run

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()
            self.run.abort()


async def _until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run ``work``; cancel it (aborting its engine requests) if the client goes away first."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise APIError(499, "client disconnected", code="client_closed")
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


async def _collect(run: Run) -> dict[str, Any]:
    async for index, delta in run.deltas():
        run.apply(index, delta)
    if run.error is not None:
        raise APIError(503, f"the engine aborted the request: {run.error}", code="request_aborted")
    return run.response()


async def _stream(run: Run, include_usage: bool) -> AsyncIterator[bytes]:
    if run.kind == "chat":  # one event per choice, as OpenAI sends them
        for c in run.choices:
            yield sse.event(run.chunk([run.role_chunk(c.index)], None, include_usage))
    try:
        async for index, delta in run.deltas():
            choice = run.apply(index, delta)
            if choice.error is not None:
                message = f"the engine aborted the request: {choice.error}"
                yield sse.event(APIError(503, message, code="request_aborted").body())
                break
            event = run.delta_event(choice, delta, include_usage)
            if event is not None:
                yield event
        else:
            if include_usage:
                yield sse.event(run.chunk([], run.usage(), True))
    except Exception as exc:  # headers are sent: report in-band, then end the stream
        log.exception("stream %s failed", run.id)
        yield sse.event(APIError(500, f"internal error: {exc}", code="internal_error").body())
    yield sse.DONE


async def _generate(request: Request, kind: Kind, job: Job, stream: bool, include_usage: bool) -> Response:
    s = state(request)
    run = Run(s.client, kind, job, s.client.model_name)
    await run.start()
    if stream:
        return EventStream(run, _stream(run, include_usage))
    try:
        return JSONResponse(await _until_disconnect(request, _collect(run)))
    finally:
        run.abort()  # a no-op when every choice finished


# ---- OpenAI API --------------------------------------------------------------------------------------


@router.get("/v1/models", response_model=ModelList, responses=ERRORS)
async def list_models(request: Request) -> dict[str, Any]:
    s = state(request)
    card = {
        "id": s.client.model_name,
        "object": "model",
        "created": int(s.started),
        "owned_by": "kvstrata",
        "max_model_len": s.client.context_length,
    }
    return {"object": "list", "data": [card]}


@router.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest), responses=ERRORS)
async def completions(request: Request) -> Response:
    req = await parse_body(request, CompletionRequest)
    client = state(request).client
    check_model(client, req.model)
    job = await asyncio.to_thread(completion_job, client, req)
    return await _generate(request, "completion", job, req.stream, req.include_usage)


@router.post("/v1/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest), responses=ERRORS)
async def chat_completions(request: Request) -> Response:
    req = await parse_body(request, ChatCompletionRequest)
    client = state(request).client
    check_model(client, req.model)
    job = await asyncio.to_thread(chat_job, client, req)
    return await _generate(request, "chat", job, req.stream, req.include_usage)


# ---- operations --------------------------------------------------------------------------------------


@router.get("/health")
async def health(request: Request) -> dict[str, Any]:
    s = state(request)
    if not s.client.healthy():
        raise APIError(503, "the engine process exited", code="engine_unavailable")
    return {"status": "ok", "model": s.client.model_name, "uptime_s": round(time.time() - s.started, 3)}


@router.get("/metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST

    body = await asyncio.to_thread(state(request).metrics.render)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/cache", responses=ERRORS)
async def cache_info(request: Request) -> dict[str, Any]:
    snap = await asyncio.to_thread(state(request).client.snapshot)
    return snap.cache_json()


@router.post("/v1/cache/flush", responses=ERRORS)
async def cache_flush(request: Request) -> JSONResponse:
    flushed = await asyncio.to_thread(state(request).client.flush_cache)
    if not flushed:
        return JSONResponse(
            APIError(
                409, "requests are running or queued; the cache was not flushed", code="cache_busy"
            ).body(),
            status_code=409,
        )
    return JSONResponse({"flushed": True})


@router.post("/v1/cache/pins", openapi_extra=_body_schema(PinRequest), responses=PIN_ERRORS)
async def cache_pin(request: Request) -> dict[str, Any]:
    """Pin a prompt's full pages (computed first when not cached): a text prefix, or chat messages
    with images. 409 when the pinned-bytes budget cannot take it."""
    req = await parse_body(request, PinRequest)
    client = state(request).client

    def pin() -> dict[str, Any]:
        ids, images = pin_prompt(client, req)
        return client.pin(ids, images, req.ttl_s, req.label)

    return await asyncio.to_thread(pin)


@router.delete("/v1/cache/pins/{pin_id}", responses=PIN_ERRORS)
async def cache_unpin(request: Request, pin_id: str) -> dict[str, Any]:
    return await asyncio.to_thread(state(request).client.unpin, pin_id)
