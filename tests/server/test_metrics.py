"""/metrics: parses with prometheus_client's parser and holds every metric of the docs table, live."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvstrata.server.metrics import METRIC_NAMES

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
    assert len(METRIC_NAMES) == 27

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
    assert 0 < value(m, "kvstrata:cache_hit_rate") < 1
    assert value(m, "kvstrata:gen_throughput") > 0
    assert value(m, "kvstrata:quantized_pages_total") > 0
    for tier in ("cold", "ring"):
        assert 0.0 <= value(m, "kvstrata:token_usage", tier=tier) <= 1.0
        assert value(m, "kvstrata:kv_bytes_per_token", tier=tier) > 0
        total_pages = sum(value(m, "kvstrata:kv_pages", tier=tier, state=s) for s in ("free", "used"))
        assert total_pages > 0
        for state in ("free", "used", "cached", "pinned"):
            pages = value(m, "kvstrata:kv_pages", tier=tier, state=state)
            nbytes = value(m, "kvstrata:kv_bytes", tier=tier, state=state)
            assert nbytes == pages * (
                value(m, "kvstrata:kv_bytes", tier=tier, state="free")
                / max(1.0, value(m, "kvstrata:kv_pages", tier=tier, state="free"))
            )
    assert value(m, "kvstrata:kv_pages", tier="cold", state="cached") > 0  # the shared system prompt
    # int8 history: 8 bits of code per element plus scales, against 32-bit float in the ring
    assert value(m, "kvstrata:kv_bytes_per_token", tier="cold") < value(
        m, "kvstrata:kv_bytes_per_token", tier="ring"
    )
    layers = {s.labels["layer"] for s in m["kvstrata:quant_overflow_ratio"].samples}
    assert len(layers) == 30
    assert {s.labels["kind"] for s in m["kvstrata:quant_nonfinite"].samples} == {"k", "v"}
    assert all(s.value == 0 for s in m["kvstrata:quant_nonfinite"].samples)
    assert value(m, "kvstrata:fallback_level") == 0
    assert value(m, "kvstrata:evicted_pages_total") >= 0
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
