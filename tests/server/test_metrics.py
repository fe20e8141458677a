"""/metrics: parses with prometheus_client's parser and holds every metric of the docs table, live."""

from __future__ import annotations

import time
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstrata.server.metrics import METRIC_NAMES
from kvstrata.server.snapshot import PAGE_STATES

from .live import LiveServer

MODEL = "SmolLM2-135M-Instruct"
PREFIX = "You are a terse assistant. " * 12  # several full pages shared by both requests


def scrape(server: LiveServer) -> dict[str, Any]:
    with server.client() as c:
        r = c.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def scrape_until(server: LiveServer, name: str, at_least: float, suffix: str = "") -> dict[str, Any]:
    """Scrape until ``name`` reaches ``at_least``: the engine records a request's finish event just
    after it delivers the last chunk, so a scrape right after the response may precede it."""
    deadline = time.monotonic() + 10
    while True:
        families = scrape(server)
        if value(families, name, suffix) >= at_least or time.monotonic() > deadline:
            return families
        time.sleep(0.05)


def value(families: dict[str, Any], name: str, suffix: str = "", **labels: str) -> float:
    family = families[name.removesuffix("_total")]
    for s in family.samples:
        if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise KeyError(f"{name}{suffix} {labels}")


def test_every_metric_in_the_table_is_exported_with_live_values(server: LiveServer) -> None:
    client = server.openai()
    done = value(scrape(server), "kvstrata:e2e_request_latency_seconds", "_count")
    for question in ("What is 2+2?", "What is 3+3?"):
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": PREFIX}, {"role": "user", "content": question}],
            max_tokens=6,
            temperature=0,
        )
    m = scrape_until(server, "kvstrata:e2e_request_latency_seconds", done + 2, "_count")
    names = {name.removesuffix("_total") for name in METRIC_NAMES}
    missing = sorted(n for n in names if "kvstrata:" + n not in m)
    assert not missing, missing
    assert len(METRIC_NAMES) == 36

    types = {
        "kvstrata:time_to_first_token_seconds": "histogram",
        "kvstrata:inter_token_latency_seconds": "histogram",
        "kvstrata:e2e_request_latency_seconds": "histogram",
        "kvstrata:ppl_drift_ratio": "histogram",
        "kvstrata:kl_divergence": "histogram",
        "kvstrata:prompt_tokens": "counter",
        "kvstrata:quantized_pages": "counter",
        "kvstrata:quant_nonfinite": "counter",
        "kvstrata:requests_finished": "counter",
        "kvstrata:token_usage": "gauge",
        "kvstrata:fallback_level": "gauge",
    }
    for name, kind in types.items():
        assert m[name].type == kind, (name, m[name].type)

    # live values after the two requests
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert value(m, "kvstrata:" + hist, "_count") >= 2
        assert value(m, "kvstrata:" + hist, "_sum") > 0
    assert value(m, "kvstrata:prompt_tokens_total") >= 2 * 100
    assert value(m, "kvstrata:generation_tokens_total") >= 2
    assert value(m, "kvstrata:cached_tokens_total") >= 64
    assert value(m, "kvstrata:requests_received_total") >= 2
    assert value(m, "kvstrata:requests_finished_total", status="success") >= 2
    # two short requests on a roomy pool: nothing preempted, no NaN/Inf logits
    assert value(m, "kvstrata:num_preemptions_total") == 0
    assert value(m, "kvstrata:nonfinite_logits_total") == 0
    assert 0 < value(m, "kvstrata:cache_hit_rate") < 1
    assert value(m, "kvstrata:gen_throughput") > 0
    assert value(m, "kvstrata:quantized_pages_total") > 0
    # Bytes of one 16-token page of the default model (30 layers, 3 KV heads, head_dim 64), by hand
    # from the documented layouts: int8 history = int8 codes + float32 scales (per head and channel
    # for keys, per token and head for values); the ring is BF16 (quantized history) K and V.
    cold_page = 30 * (16 * 3 * 64 + 3 * 64 * 4 + 16 * 3 * 64 + 16 * 3 * 4)
    ring_page = 16 * 2 * 30 * 3 * 64 * 2
    assert (cold_page, ring_page) == (213_120, 368_640)
    assert value(m, "kvstrata:kv_bytes_per_token", tier="cold") == cold_page / 16
    assert value(m, "kvstrata:kv_bytes_per_token", tier="ring") == ring_page / 16
    for tier, page_bytes in (("cold", cold_page), ("ring", ring_page)):
        pages = {s: value(m, "kvstrata:kv_pages", tier=tier, state=s) for s in PAGE_STATES}
        assert pages["free"] + pages["used"] > 0
        assert pages["pinned"] <= pages["cached"] and pages["evictable"] <= pages["cached"] <= pages["used"]
        for state in PAGE_STATES:
            assert value(m, "kvstrata:kv_bytes", tier=tier, state=state) == pages[state] * page_bytes
        usage = (pages["used"] - pages["evictable"]) / (pages["free"] + pages["used"])
        assert value(m, "kvstrata:token_usage", tier=tier) == pytest.approx(usage)
    assert value(m, "kvstrata:kv_pages", tier="cold", state="cached") > 0  # the shared system prompt
    layers = {s.labels["layer"] for s in m["kvstrata:quant_overflow_ratio"].samples}
    assert len(layers) == 30
    assert {s.labels["kind"] for s in m["kvstrata:quant_nonfinite"].samples} == {"k", "v"}
    assert all(s.value == 0 for s in m["kvstrata:quant_nonfinite"].samples)
    assert value(m, "kvstrata:fallback_level") == 0
    assert value(m, "kvstrata:pinned_pages") == 0


def test_metrics_refresh_on_scrape(server: LiveServer) -> None:
    before = scrape(server)
    server.openai().completions.create(model=MODEL, prompt="Count: 1 2 3", max_tokens=3, temperature=0)
    after = scrape_until(
        server,
        "kvstrata:e2e_request_latency_seconds",
        value(before, "kvstrata:e2e_request_latency_seconds", "_count") + 1,
        "_count",
    )
    assert (
        value(after, "kvstrata:generation_tokens_total")
        == value(before, "kvstrata:generation_tokens_total") + 3
    )
    assert value(after, "kvstrata:e2e_request_latency_seconds", "_count") == (
        value(before, "kvstrata:e2e_request_latency_seconds", "_count") + 1
    )
    assert value(after, "kvstrata:num_running_reqs") == 0
