"""Engine-level request statistics as plain data, and the event hook the server subscribes to.

The engine thread emits one `RequestFinished` per finished request (timings, token counts, status)
and one `DriftSample` per re-scored request (from the drift worker thread). Subscribers are called
synchronously on those threads: they must be quick and must not call back into the engine
(a Prometheus observe() is fine). `EngineStats` is a snapshot for gauges and counters.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvstrata.engine.drift import DriftSample, DriftStats

log = logging.getLogger("kvstrata.engine")


@dataclass
class RequestFinished:
    rid: str
    status: str  # "success" | "aborted" | "error"
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft: float | None  # seconds from arrival to the first token
    inter_token_latencies: list[float]  # seconds between consecutive tokens
    e2e_latency: float
    preemptions: int
    started: bool = True  # it ran at least one step (False: aborted or failed while queued)


EngineEvent = RequestFinished | DriftSample


@dataclass
class EngineStats:
    num_running_reqs: int = 0
    num_queue_reqs: int = 0
    requests_received_total: int = 0
    requests_finished_total: dict[str, int] = field(
        default_factory=lambda: {"success": 0, "aborted": 0, "error": 0}
    )
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    cached_tokens_total: int = 0
    preemptions_total: int = 0
    nonfinite_logits_total: int = 0  # requests ended because their logits held NaN/Inf
    # cached / prompt tokens over finished requests that ran: each request's first step counts, not
    # admissions rolled back under pressure nor re-admissions after a preemption
    cache_hit_rate: float = 0.0
    gen_throughput: float = 0.0  # generated tokens/s over the last few seconds
    steps_total: int = 0
    drift: DriftStats | None = None
    cache: Any = None  # cache.stats() snapshot (CacheStats), taken by Engine.get_stats


class StatsCollector:
    """Counters kept by the engine thread; snapshots are taken under a lock by any thread."""

    WINDOW_S = 10.0

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stats = EngineStats()
        self.listeners: list[Callable[[EngineEvent], None]] = []
        self.recent: deque[tuple[float, int]] = deque()  # (time, tokens generated in a step)
        self.started_prompt_tokens = 0  # the hit rate's denominator

    def reset(self) -> None:
        """Counters back to zero (after the warm-up); listeners stay."""
        with self.lock:
            self.stats = EngineStats()
            self.recent.clear()
            self.started_prompt_tokens = 0

    def subscribe(self, fn: Callable[[EngineEvent], None]) -> Callable[[], None]:
        with self.lock:
            self.listeners.append(fn)

        def unsubscribe() -> None:
            with self.lock:
                if fn in self.listeners:
                    self.listeners.remove(fn)

        return unsubscribe

    def emit(self, event: EngineEvent) -> None:
        with self.lock:
            listeners = list(self.listeners)
        for fn in listeners:
            try:
                fn(event)
            except Exception:
                log.exception("engine stats listener failed")

    def received(self, n: int = 1) -> None:
        with self.lock:
            self.stats.requests_received_total += n

    def step(self, generated: int, running: int, queued: int) -> None:
        now = time.perf_counter()
        with self.lock:
            s = self.stats
            s.steps_total += 1
            s.num_running_reqs, s.num_queue_reqs = running, queued
            s.generation_tokens_total += generated
            self.recent.append((now, generated))
            self._throughput(now)

    def _throughput(self, now: float) -> None:
        """Generated tokens/s over the last WINDOW_S seconds (0 once idle that long)."""
        while self.recent and now - self.recent[0][0] > self.WINDOW_S:
            self.recent.popleft()
        span = now - self.recent[0][0] if len(self.recent) > 1 else 0.0
        self.stats.gen_throughput = sum(n for _, n in list(self.recent)[1:]) / span if span > 0 else 0.0

    def nonfinite_logits(self) -> None:
        with self.lock:
            self.stats.nonfinite_logits_total += 1

    def queue_sizes(self, running: int, queued: int) -> None:
        with self.lock:
            self.stats.num_running_reqs, self.stats.num_queue_reqs = running, queued

    def finished(self, event: RequestFinished) -> None:
        with self.lock:
            s = self.stats
            s.requests_finished_total[event.status] = s.requests_finished_total.get(event.status, 0) + 1
            s.prompt_tokens_total += event.prompt_tokens
            s.cached_tokens_total += event.cached_tokens
            s.preemptions_total += event.preemptions
            if event.started:
                self.started_prompt_tokens += event.prompt_tokens
            if self.started_prompt_tokens:
                s.cache_hit_rate = s.cached_tokens_total / self.started_prompt_tokens
        self.emit(event)

    def snapshot(self, drift: DriftStats | None) -> EngineStats:
        with self.lock:
            self._throughput(time.perf_counter())
            s = self.stats
            return EngineStats(
                num_running_reqs=s.num_running_reqs,
                num_queue_reqs=s.num_queue_reqs,
                requests_received_total=s.requests_received_total,
                requests_finished_total=dict(s.requests_finished_total),
                prompt_tokens_total=s.prompt_tokens_total,
                generation_tokens_total=s.generation_tokens_total,
                cached_tokens_total=s.cached_tokens_total,
                preemptions_total=s.preemptions_total,
                nonfinite_logits_total=s.nonfinite_logits_total,
                cache_hit_rate=s.cache_hit_rate,
                gen_throughput=s.gen_throughput,
                steps_total=s.steps_total,
                drift=drift,
                cache=s.cache,
            )
