"""Client disconnects and concurrency against the real engine: pages and ring slots always come back."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from .live import LiveServer

MODEL = "SmolLM2-135M-Instruct"
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "wizards"]


def _finished(server: LiveServer) -> dict[str, float]:
    with server.client() as c:
        text = c.get("/metrics").text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "kvstrata:requests_finished":
            for s in family.samples:
                if s.name.endswith("_total"):
                    out[s.labels["status"]] = s.value
    return out


def test_disconnect_mid_stream_aborts_and_frees_pages(server: LiveServer, engine: Any) -> None:
    before = server.wait_idle()
    aborted_before = _finished(server).get("aborted", 0.0)
    prompt = " ".join(WORDS * 8)  # several pages: cold pages are held while it runs
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 1000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    seen = 0
    client = httpx.Client(base_url=server.url, headers=server.headers, timeout=60)
    with client, client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen += 1
            if seen == 4:
                held = server.cache()
                assert held["num_running_reqs"] == 1
                assert held["tiers"]["ring"]["pages"]["used"] > 0
                assert held["tiers"]["cold"]["pages"]["used"] > before["tiers"]["cold"]["pages"]["used"]
                with server.client() as other:  # no flush while a request runs
                    busy = other.post("/v1/cache/flush")
                assert busy.status_code == 409 and busy.json()["error"]["code"] == "cache_busy"
                break
    t0 = time.monotonic()
    after = server.wait_idle(timeout=30)
    freed_in = time.monotonic() - t0
    assert after["tiers"]["ring"]["pages"]["used"] == 0
    assert after["pages_in_use"] == after["pages_in_tree"]
    deadline = time.monotonic() + 10  # the finish event lands just after the pages are released
    while _finished(server)["aborted"] < aborted_before + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _finished(server)["aborted"] == aborted_before + 1
    assert freed_in < 10.0
    engine.check_invariants()


def _prompt(i: int) -> str:
    n = (3, 20, 60, 120, 240)[i % 5]  # words; ~1.2 tokens each
    return f"Request {i}: " + " ".join(WORDS[(i + k) % len(WORDS)] for k in range(n))


async def _one_stream(client: httpx.AsyncClient, i: int) -> dict[str, Any]:
    chat = i % 2 == 0
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 6 + i % 7,
        "temperature": 0.7,
        "seed": i,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if chat:
        body["messages"] = [{"role": "user", "content": _prompt(i)}]
    else:
        body["prompt"] = _prompt(i)
    t0 = time.monotonic()
    first = None
    events: list[str] = []
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                if first is None:
                    first = time.monotonic() - t0
                events.append(line[6:])
    import json

    assert events[-1] == "[DONE]", events[-3:]
    usage = json.loads(events[-2])["usage"]
    assert all("error" not in json.loads(e) for e in events[:-1])
    return {"ttft": first, "e2e": time.monotonic() - t0, "usage": usage, "max_tokens": body["max_tokens"]}


def test_32_concurrent_streaming_clients(server: LiveServer, engine: Any) -> None:
    async def main() -> list[dict[str, Any]]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(
            base_url=server.url, headers=server.headers, timeout=300, limits=limits
        ) as c:
            return await asyncio.gather(*(_one_stream(c, i) for i in range(32)))

    t0 = time.monotonic()
    results = asyncio.run(main())
    wall = time.monotonic() - t0
    assert len(results) == 32
    prompt_lens = sorted({r["usage"]["prompt_tokens"] for r in results})
    assert prompt_lens[0] < 30 and prompt_lens[-1] > 250  # mixed lengths
    for r in results:
        assert 1 <= r["usage"]["completion_tokens"] <= r["max_tokens"]
    ttfts = sorted(r["ttft"] for r in results)
    e2es = sorted(r["e2e"] for r in results)
    generated = sum(r["usage"]["completion_tokens"] for r in results)
    print(
        f"\n32 streams: wall {wall:.1f}s, {generated} tokens, {generated / wall:.1f} tok/s; "
        f"ttft p50 {ttfts[16]:.2f}s max {ttfts[-1]:.2f}s; e2e p50 {e2es[16]:.2f}s max {e2es[-1]:.2f}s"
    )
    after = server.wait_idle(timeout=60)
    assert after["tiers"]["ring"]["pages"]["used"] == 0
    assert after["pages_in_use"] == after["pages_in_tree"]
    stats = engine.check_invariants()
    assert stats.tiers["cold"].used == stats.tiers["cold"].cached


def test_disconnect_before_a_non_streaming_answer_aborts(server: LiveServer) -> None:
    server.wait_idle()
    aborted_before = _finished(server).get("aborted", 0.0)
    body = {"model": MODEL, "prompt": " ".join(WORDS * 4), "max_tokens": 1000, "ignore_eos": True}
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=httpx.Timeout(30, read=1.5)) as c:
        try:
            c.post("/v1/completions", json=body)
            raise AssertionError("a 1000-token answer came back within the read timeout")
        except httpx.ReadTimeout:
            pass  # the client gives up and closes the connection
    after = server.wait_idle(timeout=30)
    assert after["tiers"]["ring"]["pages"]["used"] == 0
    assert after["pages_in_use"] == after["pages_in_tree"]
    deadline = time.monotonic() + 10
    while _finished(server)["aborted"] < aborted_before + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _finished(server)["aborted"] == aborted_before + 1
