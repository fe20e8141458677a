"""The engine in its own process (`kvstrata serve --engine-process on`, kvstrata/server/engine_process.py):
the OpenAI API tests again over it, the same greedy text as the engine in the server's process, and what
only a second process brings: errors that cross the pipe, the engine's events feeding /metrics, pages
freed after a disconnect, and an engine process that dies under open streams."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstrata.server.app import create_app
from kvstrata.server.config import ServerConfig
from kvstrata.server.engine_client import RemoteEngineClient
from kvstrata.server.engine_process import EngineProcess, RemoteStream
from kvstrata.server.errors import APIError

from . import test_errors, test_load, test_openai_api
from .conftest import API_KEY, DEFAULT_ENGINE
from .live import LiveServer

MODEL = "SmolLM2-135M-Instruct"


@dataclass
class Remote:
    server: LiveServer
    engine: EngineProcess


def _start(config: ServerConfig) -> tuple[EngineProcess, LiveServer]:
    engine = EngineProcess(config, start_timeout=300)
    try:
        return engine, LiveServer(create_app(engine, config), config.api_key).start()
    except BaseException:
        engine.shutdown()
        raise


@pytest.fixture(scope="module")
def remote() -> Iterator[Remote]:
    # the session server's options (tests/server/conftest.py), with the engine in another process
    config = ServerConfig(api_key=API_KEY, max_request_bytes=64 * 1024, engine_process="on", **DEFAULT_ENGINE)
    engine, server = _start(config)
    try:
        yield Remote(server, engine)
        assert not engine.streams  # every stream the tests opened was let go of
    finally:
        server.stop()
        engine.shutdown()
    assert engine.process.returncode == 0  # it shut down when asked, not killed


@pytest.mark.parametrize(
    "api_test",
    [
        test_openai_api.test_models_lists_the_served_model,
        test_openai_api.test_chat_non_streaming_usage_and_cached_prefix,
        test_openai_api.test_chat_streaming_with_usage_matches_non_streaming,
        test_openai_api.test_sse_framing_ends_with_done,
        test_openai_api.test_completions_streaming_and_not,
        test_openai_api.test_completions_batch_of_prompts_and_token_ids,
        test_openai_api.test_n_seed_and_temperature,
        test_openai_api.test_chat_streaming_n_choices,
        test_openai_api.test_stop_strings_and_penalties,
        test_openai_api.test_logprobs_chat_and_completions,
        test_openai_api.test_auth_and_open_endpoints,
        test_openai_api.test_cache_endpoint_and_flush,
        test_errors.test_prompt_longer_than_context,
        test_errors.test_unknown_model_is_404,
        test_errors.test_server_stays_up_and_leaks_nothing,
        test_load.test_disconnect_before_a_non_streaming_answer_aborts,
    ],
    ids=lambda fn: fn.__name__.removeprefix("test_"),
)
def test_the_api_over_the_engine_process(remote: Remote, api_test: Callable[[LiveServer], None]) -> None:
    api_test(remote.server)


def _completion(server: LiveServer, prompt: str, stream: bool) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    with server.client() as c:
        if not stream:
            return str(c.post("/v1/completions", json=body).json()["choices"][0]["text"])
        text = []
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    text.extend(choice["text"] for choice in json.loads(line[6:])["choices"])
        return "".join(text)


def test_same_greedy_text_as_the_engine_in_the_server_process(server: LiveServer, remote: Remote) -> None:
    prompts = ["The capital of France is", "def fibonacci(n):", " ".join(test_load.WORDS * 6)]
    for prompt in prompts:
        here = _completion(server, prompt, stream=False)
        assert len(here) > 10
        assert _completion(remote.server, prompt, stream=False) == here
        assert _completion(remote.server, prompt, stream=True) == here


def _metric(server: LiveServer, name: str, sample: str, **labels: str) -> float:
    with server.client() as c:
        text = c.get("/metrics").text
    for family in text_string_to_metric_families(text):
        if family.name == name:
            for s in family.samples:
                if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                    return float(s.value)
    return 0.0


def _finished(server: LiveServer, status: str) -> float:
    return test_load._finished(server).get(status, 0.0)


def test_engine_events_feed_the_metrics(remote: Remote) -> None:
    server = remote.server
    ttft = "kvstrata:time_to_first_token_seconds"
    before = _metric(server, ttft, ttft + "_count"), _finished(server, "success")
    for i in range(3):
        _completion(server, f"Count to {i}:", stream=i % 2 == 0)
    deadline = time.monotonic() + 10  # events cross the pipe on their own
    while _metric(server, ttft, ttft + "_count") < before[0] + 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _metric(server, ttft, ttft + "_count") == before[0] + 3
    assert _finished(server, "success") == before[1] + 3


def test_disconnect_mid_stream_frees_the_pages(remote: Remote) -> None:
    server = remote.server
    before = server.wait_idle()
    aborted = _finished(server, "aborted")
    prompt = "A prompt no other test sends: " + " ".join(test_load.WORDS * 8)  # not cached yet
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1000, "ignore_eos": True}
    seen = 0
    with server.client() as c, c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen == 4:
                held = server.cache()
                assert held["num_running_reqs"] == 1
                assert held["tiers"]["cold"]["pages"]["used"] > before["tiers"]["cold"]["pages"]["used"]
                break
    after = server.wait_idle(timeout=30)
    assert after["tiers"]["ring"]["pages"]["used"] == 0
    assert after["pages_in_use"] == after["pages_in_tree"]
    deadline = time.monotonic() + 10
    while _finished(server, "aborted") < aborted + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _finished(server, "aborted") == aborted + 1


def test_32_concurrent_streams(remote: Remote) -> None:
    async def main() -> list[dict[str, Any]]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(
            base_url=remote.server.url, headers=remote.server.headers, timeout=300, limits=limits
        ) as c:
            return await asyncio.gather(*(test_load._one_stream(c, i) for i in range(32)))

    results = asyncio.run(main())
    assert len(results) == 32
    for r in results:
        assert 1 <= r["usage"]["completion_tokens"] <= r["max_tokens"]
    after = remote.server.wait_idle(timeout=60)
    assert after["tiers"]["ring"]["pages"]["used"] == 0
    assert after["pages_in_use"] == after["pages_in_tree"]


def test_errors_cross_the_pipe_with_their_type(remote: Remote) -> None:
    with remote.server.client() as c:
        r = c.delete("/v1/cache/pins/no-such-pin")  # the engine side's KeyError -> APIError(404)
    assert r.status_code == 404 and r.json()["error"]["code"] == "pin_not_found"

    async def submit(params: dict[str, Any]) -> list[str]:
        stream = remote.engine.async_generate(input_ids=[[1, 2, 3]], sampling_params=params, rid=["bad"])
        try:
            await stream.wait_accepted()
            return list(stream.index)
        finally:
            await stream.aclose()

    with pytest.raises(ValueError, match="temperature"):  # the engine's own check, raised here
        asyncio.run(submit({"temperature": -1.0}))
    assert asyncio.run(submit({"max_new_tokens": 1})) == ["bad"]
    remote.server.wait_idle()


def test_a_refusal_by_the_engine_is_a_400_and_leaves_no_stream(remote: Remote) -> None:
    client = RemoteEngineClient(remote.engine)

    async def main() -> APIError:
        request = client.submit([[1, 2, 3]], {"temperature": -1.0})  # passes no server-side check
        with pytest.raises(APIError) as refused:
            await request.start()
        return refused.value

    error = asyncio.run(main())
    assert error.status == 400 and "temperature" in error.message
    assert not remote.engine.streams


def test_an_engine_that_cannot_start_raises_its_error() -> None:
    with pytest.raises(ValueError, match="recent_window"):
        EngineProcess(ServerConfig(recent_window=24, engine_process="on"), start_timeout=300)


def exit_while_loading(engine: object) -> None:
    """An engine hook (run in the engine process) that ends it before it says it is ready."""
    os._exit(3)


def test_an_engine_that_dies_while_starting_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    tests_dir = str(Path(__file__).resolve().parents[1])  # where `server.test_engine_process` imports from
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [tests_dir, os.environ.get("PYTHONPATH")])))
    hook = f"{__name__}:exit_while_loading"
    with pytest.raises(RuntimeError, match=r"exited while starting \(exit code 3\)"):
        EngineProcess(ServerConfig(engine_process="on"), start_timeout=300, engine_hook=hook)


class _Owner:
    """What a `RemoteStream` needs of its `EngineProcess`: the open streams and ``abort``."""

    def __init__(self) -> None:
        self.streams: dict[int, RemoteStream] = {}
        self.aborted: list[str] = []

    def abort(self, rid: str) -> None:
        self.aborted.append(rid)


def _chunk(rid: str, text: str, finished: bool) -> dict[str, Any]:
    return {"text": text, "output_ids": [], "meta_info": {"id": rid}, "finished": finished}


async def _drain(stream: RemoteStream) -> list[dict[str, Any]]:
    return [chunk async for chunk in stream]


def test_a_stream_whose_engine_dies_just_after_accepting_it_ends() -> None:
    async def main() -> list[dict[str, Any]]:
        owner = _Owner()
        stream = owner.streams[0] = RemoteStream(owner, 0, asyncio.get_running_loop(), ["g"])  # type: ignore[arg-type]
        stream._accept(["g-0", "g-1"])  # the reader hands both over before the consumer runs
        stream.queue.put_nowait(_chunk("g-0", "a", finished=True))  # g-0 finished before the death
        stream._fail("the engine process exited")
        got = await asyncio.wait_for(_drain(stream), 10)  # a stream missing its abort would hang
        assert not owner.streams
        return got

    got = asyncio.run(main())
    assert [(c["index"], c["text"], c["finished"]) for c in got] == [(0, "a", True), (1, "", True)]
    assert got[1]["meta_info"]["finish_reason"]["type"] == "abort"  # one end per request, no second for g-0


def test_closing_a_stream_before_the_engine_answers_aborts_its_group() -> None:
    async def main() -> _Owner:
        owner = _Owner()
        stream = owner.streams[0] = RemoteStream(owner, 0, asyncio.get_running_loop(), ["g"])  # type: ignore[arg-type]
        await stream.aclose()
        stream._accept(["g-0", "g-1"])  # too late: nobody listens
        return owner

    owner = asyncio.run(main())
    assert owner.aborted == ["g"] and not owner.streams


def test_a_dead_engine_process_ends_open_streams_and_answers_503() -> None:
    config = ServerConfig(engine_process="on", max_running_requests=4)
    engine, server = _start(config)
    try:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True}
        events: list[str] = []
        with server.client() as c, c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 3:
                        engine.process.kill()
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "request_aborted" and "engine process exited" in error["message"]
        with server.client() as c:
            health = c.get("/health")
            later = c.post("/v1/completions", json={**body, "max_tokens": 2})
            cache = c.get("/v1/cache")
            metrics = c.get("/metrics")
        assert health.status_code == 503
        assert later.status_code == 503 and later.json()["error"]["code"] == "engine_unavailable"
        assert cache.status_code == 503 and metrics.status_code == 503  # no engine state to report
    finally:
        server.stop()
        engine.shutdown()
    assert engine.process.returncode is not None
