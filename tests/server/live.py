"""A real uvicorn server on 127.0.0.1 (free port) in a background thread, serving a real engine."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import uvicorn

from kvstrata.server.app import create_app
from kvstrata.server.config import ServerConfig
from kvstrata.server.transport import uvicorn_options


class LiveServer:
    def __init__(self, app: Any, api_key: str | None, transport: dict[str, str] | None = None) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        # what `kvstrata serve` runs on (uvloop + httptools where installed) unless a test picks one
        transport = uvicorn_options() if transport is None else transport
        config = uvicorn.Config(
            app, log_level="warning", access_log=False, timeout_graceful_shutdown=5, **transport
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.sock.close()

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=120, **kwargs)

    def openai(self) -> Any:
        import openai

        return openai.OpenAI(
            base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0, timeout=120
        )

    def cache(self) -> dict[str, Any]:
        with self.client() as c:
            r = c.get("/v1/cache")
            r.raise_for_status()
            return r.json()

    def wait_idle(self, timeout: float = 60.0) -> dict[str, Any]:
        """Poll /v1/cache until no request runs or waits; returns the last body."""
        deadline = time.monotonic() + timeout
        while True:
            body = self.cache()
            if (
                body["num_running_reqs"] == 0
                and body["num_queue_reqs"] == 0
                and (body["tiers"]["ring"]["pages"]["used"] == 0)
            ):
                return body
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle after {timeout}s: {body}")
            time.sleep(0.1)


@contextmanager
def live_server(engine: Any, transport: dict[str, str] | None = None, **config: Any) -> Iterator[LiveServer]:
    cfg = ServerConfig(**config)
    server = LiveServer(create_app(engine, cfg), cfg.api_key, transport).start()
    try:
        yield server
    finally:
        server.stop()
