"""A small KV pool under HTTP load: honest hit numbers, a truthful "pool full" finish, and a stress
run of concurrent streams with disconnects that leaves nothing behind.

The engine: 128 cold pages of 16 tokens (2,048 tokens), 16 running slots, int8 history behind a
32-token BF16 window.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .live import LiveServer, live_server

MODEL = "SmolLM2-135M-Instruct"
PAGE = 16
POOL_PAGES = 128


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    from kvstrata import Engine

    eng = Engine(
        kv_cache_dtype="int8",
        recent_window=32,
        page_size=PAGE,
        max_total_tokens=POOL_PAGES * PAGE,
        max_running_requests=16,
        chunked_prefill_size=512,
        seed=0,
    )
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine: Any) -> Iterator[LiveServer]:
    with live_server(engine) as srv:
        yield srv


def metrics(server: LiveServer) -> dict[str, float]:
    with server.client() as c:
        text = c.get("/metrics").text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + "".join(f"|{k}={v}" for k, v in sorted(s.labels.items()))
            out[key] = s.value
    return out


def token_prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 30000) for _ in range(n)]


def test_same_prompt_ten_times_reuses_its_full_pages(server: LiveServer) -> None:
    prompt = token_prompt(1, 600)
    cached = []
    with server.client() as c:
        for _ in range(10):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            assert usage["prompt_tokens"] == 600
            cached.append(usage["prompt_tokens_details"]["cached_tokens"])
    full_pages = (600 - 1) // PAGE * PAGE  # the last prompt token is always computed: 592
    assert cached == [0] + [full_pages] * 9
    deadline = time.monotonic() + 10
    while (m := metrics(server))["kvstrata:prompt_tokens_total"] < 6000 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert m["kvstrata:cached_tokens_total"] == 9 * full_pages
    assert m["kvstrata:cache_hit_rate"] == pytest.approx(9 * full_pages / 6000)
    assert m["kvstrata:cache_hit_rate"] >= 0.8
    # The warm prefix cache is not "usage": its pages are evictable, so the pool reads as free.
    idle = server.wait_idle()
    assert idle["tiers"]["cold"]["pages"]["cached"] >= 600 // PAGE
    assert m["kvstrata:token_usage|tier=cold"] == 0.0


def test_a_sequence_the_pool_cannot_hold_says_so(server: LiveServer, engine: Any) -> None:
    """With a quarter of the pool pinned (an image prefix, say), a 1,500-token prompt asking for 540
    more tokens fits the context but not the pages left: it ends with finish_reason "length" and
    finish_details naming the full pool, streaming or not."""
    with server.client() as c:
        pinned = token_prompt(3, 32 * PAGE)
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": pinned, "max_tokens": 1})
        assert r.status_code == 200, r.text
        server.wait_idle()
        handle = engine.cache.match_prefix(pinned).handle  # the engine thread is idle
        engine.cache.pin(handle)
        try:
            assert server.cache()["pinned_pages"] == 32  # the metric reads the tree's real count
            body = {
                "model": MODEL,
                "prompt": token_prompt(2, 1500),
                "max_tokens": 540,
                "temperature": 0,
                "ignore_eos": True,
            }
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "length"
            assert choice["finish_details"]["cause"] == "kv_pool_full"
            assert r.json()["usage"]["completion_tokens"] < 540
            with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
                events = [line for line in s.iter_lines() if line.startswith("data: {")]
            assert '"kv_pool_full"' in events[-1]
            short = c.post("/v1/completions", json={**body, "prompt": body["prompt"][:100], "max_tokens": 5})
            assert "finish_details" not in short.json()["choices"][0]  # an ordinary length finish
        finally:
            server.wait_idle()
            engine.cache.unpin(handle)
    assert server.cache()["pinned_pages"] == 0


STREAMS = 48
PROMPT_TOKENS = 600
NEW_TOKENS = 64
# Every prompt starts with the same 512-token system prompt (as chat traffic does) and ends with 88
# tokens of its own: once the first request has finished, the others read 32 pages from the tree.
SYSTEM = token_prompt(7, 512)


async def one_stream(client: httpx.AsyncClient, i: int, disconnect: bool) -> str:
    """'done' after a finish_reason, 'left' when this client hung up on purpose, else the problem."""
    body = {
        "model": MODEL,
        "prompt": SYSTEM + token_prompt(100 + i, PROMPT_TOKENS - len(SYSTEM)),
        "max_tokens": NEW_TOKENS,
        "temperature": 0.8,
        "seed": i,
        "ignore_eos": True,
        "stream": True,
    }
    chunks = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return f"status {r.status_code}: {(await r.aread())[:200]!r}"
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            if '"error"' in line:
                return f"error event: {line[:300]}"
            chunks += 1
            if disconnect and chunks == 3:
                return "left"  # leaving the block closes the connection mid-stream
            if '"finish_reason":"length"' in line.replace(" ", ""):
                return "done"
    return "stream ended without a finish_reason"


def test_stress_48_streams_on_a_128_page_pool(server: LiveServer, engine: Any) -> None:
    before = metrics(server)

    async def main() -> list[str]:
        limits = httpx.Limits(max_connections=STREAMS)
        async with httpx.AsyncClient(base_url=server.url, timeout=600, limits=limits) as client:
            return await asyncio.gather(*(one_stream(client, i, i % 4 == 0) for i in range(STREAMS)))

    t0 = time.monotonic()
    outcomes = asyncio.run(main())
    elapsed = time.monotonic() - t0
    assert outcomes.count("left") == STREAMS // 4
    assert outcomes.count("done") == STREAMS - STREAMS // 4, [
        o for o in outcomes if o not in ("done", "left")
    ]
    idle = server.wait_idle(timeout=60)
    after = metrics(server)
    key = "kvstrata:requests_finished_total|status="
    assert after[key + "error"] == before[key + "error"]
    assert after[key + "success"] - before[key + "success"] == STREAMS - STREAMS // 4
    assert after[key + "aborted"] - before[key + "aborted"] == STREAMS // 4
    stats = engine.check_invariants()  # on the engine thread, after everything ended
    assert stats.tiers["cold"].used == stats.tiers["cold"].cached  # pages in use == pages in the tree
    assert idle["pages_in_use"] == idle["pages_in_tree"]
    assert stats.running == 0 and stats.tiers["ring"].used == 0
    print(f"stress: {STREAMS} streams in {elapsed:.1f} s")
