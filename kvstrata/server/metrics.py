"""Prometheus metrics, named exactly as the METRIC NAMES table in docs/architecture.md.

Two sources, both the engine's:
- histograms are observed from the engine's events (``RequestFinished``: TTFT, inter-token and
  end-to-end latency; ``DriftSample``: perplexity ratio and KL), delivered by ``Engine.subscribe``;
- everything else is read at scrape time by ``EngineCollector`` from an ``EngineSnapshot`` (gauges,
  and counters whose running totals the engine keeps).

Each ``ServerMetrics`` owns its own ``CollectorRegistry`` so that several apps can live in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstrata.engine.drift import DriftSample
from kvstrata.engine.stats import RequestFinished
from kvstrata.server.histogram import BatchHistogram
from kvstrata.server.snapshot import PAGE_STATES, EngineSnapshot

P = "kvstrata:"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
PPL_BUCKETS = (0.9, 0.95, 0.99, 1.0, 1.01, 1.02, 1.05, 1.1, 1.2, 1.5, 2.0, 3.0, 5.0, 10.0)
KL_BUCKETS = (0.0001, 0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
FINISH_STATUSES = ("success", "error", "aborted")

# Every metric family the server exports (the docs/architecture.md table); tests check this list.
METRIC_NAMES = (
    "num_running_reqs",
    "num_queue_reqs",
    "token_usage",
    "cache_hit_rate",
    "gen_throughput",
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "prompt_tokens_total",
    "generation_tokens_total",
    "cached_tokens_total",
    "requests_received_total",
    "requests_finished_total",
    "kv_pages",
    "kv_bytes",
    "kv_bytes_per_token",
    "quantized_pages_total",
    "evicted_pages_total",
    "pinned_pages",
    "quant_overflow_ratio",
    "quant_nonfinite_total",
    "kv_absmax_ratio",
    "ppl_drift_ratio",
    "ppl_drift_ewma",
    "kl_divergence",
    "fallback_level",
    "pinned_bytes",
    "pins_created_total",
    "pins_expired_total",
    "pins_refused_total",
    "vision_encoded_images_total",
    "vision_cached_images_total",
    "kv_layer_bits",
    "num_preemptions_total",
    "nonfinite_logits_total",
    "kv_precision_raised",
)


def _layer_kind(name: str, doc: str, values: dict[tuple[int, str], float], counter: bool = False) -> Metric:
    family: Metric
    if counter:
        family = CounterMetricFamily(P + name, doc, labels=["layer", "kind"])
    else:
        family = GaugeMetricFamily(P + name, doc, labels=["layer", "kind"])
    for (layer, kind), value in sorted(values.items()):
        family.add_metric([str(layer), kind], float(value))
    return family


class EngineCollector(Collector):
    """Scrape-time view of the engine (everything in the table that the engine owns)."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(P + name, doc, value=float(value))

        yield gauge("num_running_reqs", "Requests running (admitted to the cache).", s.num_running)
        yield gauge("num_queue_reqs", "Requests waiting for admission.", s.num_queued)
        usage = GaugeMetricFamily(P + "token_usage", "Share of each KV tier in use (0-1).", labels=["tier"])
        pages = GaugeMetricFamily(P + "kv_pages", "KV pages per tier and state.", labels=["tier", "state"])
        nbytes = GaugeMetricFamily(P + "kv_bytes", "KV bytes per tier and state.", labels=["tier", "state"])
        per_token = GaugeMetricFamily(P + "kv_bytes_per_token", "KV bytes per token.", labels=["tier"])
        for tier, t in s.tiers.items():
            usage.add_metric([tier], t.usage)
            per_token.add_metric([tier], t.bytes_per_token)
            for state in PAGE_STATES:
                pages.add_metric([tier, state], t.pages.get(state, 0))
                nbytes.add_metric([tier, state], t.bytes.get(state, 0))
        yield from (usage, pages, nbytes, per_token)
        yield gauge("cache_hit_rate", "Share of prompt tokens served from the cache.", s.cache_hit_rate)
        yield gauge("gen_throughput", "Generated tokens per second (recent window).", s.gen_throughput)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(P + name, doc, value=float(value))

        yield counter("prompt_tokens", "Prompt tokens of finished requests.", s.prompt_tokens)
        yield counter("generation_tokens", "Tokens generated.", s.generation_tokens)
        yield counter("cached_tokens", "Prompt tokens served from the prefix cache.", s.cached_tokens)
        yield counter("requests_received", "Requests received by the engine.", s.requests_received)
        finished = CounterMetricFamily(P + "requests_finished", "Requests finished.", labels=["status"])
        for status in sorted({*FINISH_STATUSES, *s.requests_finished}):
            finished.add_metric([status], float(s.requests_finished.get(status, 0)))
        yield finished
        yield counter("num_preemptions", "Running requests preempted to free KV pages.", s.preemptions)
        yield counter(
            "nonfinite_logits", "Requests ended because their logits held NaN/Inf.", s.nonfinite_logits
        )
        yield counter("quantized_pages", "Pages quantized into the cold pool.", s.quantized_pages)
        yield counter("evicted_pages", "Pages evicted from the prefix tree.", s.evicted_pages)
        yield gauge("pinned_pages", "Pages pinned in the prefix tree.", s.pinned_pages)
        yield gauge("pinned_bytes", "Cold bytes pinned in the prefix tree.", s.pinned_bytes)
        yield counter("pins_created", "Pins created (image spans and POST /v1/cache/pins).", s.pins_created)
        yield counter("pins_expired", "Pins released by their time-to-live.", s.pins_expired)
        yield counter("pins_refused", "Pins refused by the pinned-bytes budget.", s.pins_refused)
        yield counter(
            "vision_encoded_images", "Images run through the vision tower.", s.vision_encoded_images
        )
        yield counter(
            "vision_cached_images",
            "Images whose span was cached (vision tower skipped).",
            s.vision_cached_images,
        )
        yield _layer_kind("quant_overflow_ratio", "Share of elements clipped.", s.overflow_ratio)
        yield _layer_kind(
            "quant_nonfinite", "NaN/Inf elements met while quantizing.", dict(s.nonfinite), counter=True
        )
        yield _layer_kind("kv_absmax_ratio", "Running absmax / calibration clip.", s.absmax_ratio)
        yield gauge(
            "ppl_drift_ewma",
            "Smoothed perplexity ratio (quantized / reference; 1 = no drift); fallback above 1 + threshold.",
            s.ppl_drift_ewma,
        )
        yield gauge("fallback_level", "Precision fallback level (0 = configured precision).", s.drift.level)
        yield gauge(
            "kv_precision_raised",
            "1 while new text pages are written in the raised pool's wider codecs (drift fallback).",
            float(s.drift.raised),
        )
        bits = GaugeMetricFamily(
            P + "kv_layer_bits",
            "Stored bits per element of new cold pages, per layer and K/V (label codec: its codec).",
            labels=["layer", "kind", "codec"],
        )
        for layer, (codecs, widths) in enumerate(zip(s.layer_codecs, s.layer_bits, strict=True)):
            for kind, codec, width in zip("kv", codecs, widths, strict=True):
                bits.add_metric([str(layer), kind, codec], float(width))
        yield bits


class ServerMetrics:
    """All of the server's metrics in one registry."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.ttft = Histogram(
            P + "time_to_first_token_seconds", "Time to first token.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = BatchHistogram(P + "inter_token_latency_seconds", "Time between tokens.", ITL_BUCKETS, r)
        self.e2e = Histogram(
            P + "e2e_request_latency_seconds", "Request latency.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.ppl_ratio = Histogram(
            P + "ppl_drift_ratio", "Perplexity ratio per re-scored request.", buckets=PPL_BUCKETS, registry=r
        )
        self.kl = Histogram(
            P + "kl_divergence", "Mean KL divergence per re-scored request.", buckets=KL_BUCKETS, registry=r
        )
        r.register(EngineCollector(snapshot))

    def on_event(self, event: object) -> None:
        """Engine event hook (called on engine threads; observe() is thread-safe)."""
        if isinstance(event, RequestFinished):
            if event.ttft is not None:
                self.ttft.observe(event.ttft)
            self.itl.observe_many(event.inter_token_latencies)
            self.e2e.observe(event.e2e_latency)
        elif isinstance(event, DriftSample):
            self.ppl_ratio.observe(event.ppl_ratio)
            self.kl.observe(event.kl)

    def render(self) -> bytes:
        return generate_latest(self.registry)
