"""The FastAPI application over one ``kvstrata.Engine``."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from kvstrata import __version__
from kvstrata.server.config import ServerConfig
from kvstrata.server.engine_client import EngineClient, RemoteEngineClient
from kvstrata.server.errors import install_handlers
from kvstrata.server.metrics import ServerMetrics
from kvstrata.server.middleware import AuthMiddleware, BodyLimitMiddleware
from kvstrata.server.protocol import ChatCompletionRequest, CompletionRequest, PinRequest
from kvstrata.server.routes import ServerState, router


def create_app(engine: Any, config: ServerConfig | None = None) -> FastAPI:
    """An app serving ``engine`` (a `kvstrata.Engine`, or an `EngineProcess` running one in a child
    process); the caller owns the engine (and shuts it down)."""
    from kvstrata.server.engine_process import EngineProcess

    config = config or ServerConfig()
    kind = RemoteEngineClient if isinstance(engine, EngineProcess) else EngineClient
    client = kind(engine, config.served_model_name, config.context_length)
    metrics = ServerMetrics(client.snapshot)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        unsubscribe = client.subscribe(metrics.on_event)
        trace = client.step_trace()
        watch = asyncio.create_task(watch_loop_lag(trace)) if trace is not None else None
        try:
            yield
        finally:
            unsubscribe()
            if watch is not None:
                watch.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watch

    app = FastAPI(title="kvstrata", version=__version__, lifespan=lifespan)
    app.state.kvstrata = ServerState(client=client, metrics=metrics, config=config, started=time.time())
    install_handlers(app)
    app.include_router(router)
    # outermost first: auth rejects before the body is read, then the size limit applies
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_bytes)
    app.add_middleware(AuthMiddleware, api_key=config.api_key, protect_metrics=config.protect_metrics)
    _install_openapi(app)
    return app


def freeze_startup_objects() -> None:
    """Move every object alive now (model, tokenizer tables, the app) out of the collector's reach, as
    SGLang does after its warm-up: a full collection then walks only what serving allocated, instead
    of stopping both threads for the whole heap. `kvstrata serve` calls it once, before it listens
    (not `create_app`: a process that builds and drops many engines, as the tests do, would keep
    frozen garbage). Measured on CPU (`benchmarks/server_overhead.py --streams 256`, docs/server.md):
    the one full collection of a run took 269-452 ms before, 54-114 ms after."""
    gc.collect()
    gc.freeze()


async def watch_loop_lag(trace: Any, interval: float = 0.005) -> None:
    """Record how late a ``interval`` timer fires on this event loop, for the engine's step timeline
    (``KVSTRATA_STEP_TRACE``): the time streamed chunks and new requests wait for the loop."""
    while True:  # perf_counter: uvloop's loop.time() counts whole milliseconds
        start = time.perf_counter()
        await asyncio.sleep(interval)
        trace.loop_lag(time.perf_counter() - start - interval)


def _install_openapi(app: FastAPI) -> None:
    """Routes parse their bodies themselves (strict UTF-8/JSON/types); publish the body models here."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (CompletionRequest, ChatCompletionRequest, PinRequest):
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
