"""Online accuracy monitor: re-score sampled requests without quantization; fall back when drift grows.

For a sampled finished request, the engine hands over the generated ids and the served log-softmax
of each generated step (recorded while decoding, at most ``max_tokens`` steps). A worker thread runs
one ``dense_forward`` (no cache, no quantization) over prompt + output and compares:

- perplexity ratio = ppl(served) / ppl(reference) over the generated tokens;
- mean KL(reference || served) over the recorded steps.

The drift value fed to the EWMA is ``|ratio - 1|`` (metric "ppl", the default) or the KL (metric
"kl"). The absolute value matters: the served model picked the tokens, so a damaged served
distribution often makes them *more* likely under itself than under the reference (ratio < 1);
measured on the default model with fp4 history and window 0, ratios of 0.91-1.04 with KL up to 0.05,
against 0.97-1.02 and KL <= 0.005 for int4. KL is the steadier signal on short outputs.

Fallback: when the EWMA passes ``threshold`` the level goes up by one (at most one step per sample
seen at the current level); level k asks for a BF16 window of ``base * 2**k`` tokens (with base 0:
0, then ``page_size * 2**(k-1)``). It comes back
down one level after ``cooldown`` consecutive samples with EWMA < ``threshold / 2`` (hysteresis).
Level changes are logged and reported through ``on_level(level, window)``, which wakes the engine;
between steps the engine reads ``window()`` and applies it via ``cache.set_recent_window``.

Precision raise (``raised_codecs`` given: the cache has a raised pool): level 1 raises precision first,
new text pages are written in the raised pool's wider codecs at the configured window; levels 2 .. max + 1
also widen the window as levels 1 .. max do without a raised pool (``max_level`` counts the window
steps). Pages keep the codec they were written in, so a raise helps from the next completed page on and
costs no re-encode; stepping back down to 0 sends new pages to the shipped codecs again. The engine reads
``raised()`` between steps and applies it via ``cache.set_raised``.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

log = logging.getLogger("kvstrata.drift")
HISTORY = 256


@dataclass
class DriftSample:
    rid: str
    ppl_ratio: float
    kl: float
    tokens: int
    ewma: float
    level: int


@dataclass
class DriftStats:
    """Plain snapshot for metrics: no Prometheus in the engine."""

    enabled: bool
    level: int
    window: int
    ewma: float
    samples: int
    dropped: int
    level_changes: int
    raised: bool = False  # new text pages go to the raised pool's wider codecs
    ppl_ratios: list[float] = field(default_factory=list)  # recent, oldest first
    kls: list[float] = field(default_factory=list)


@dataclass
class DriftJob:
    rid: str
    token_ids: list[int]  # prompt + output
    prompt_len: int
    served: torch.Tensor  # [n, V] log-softmax of generated steps 0..n-1


def score(dense_forward: Callable[..., torch.Tensor], job: DriftJob) -> tuple[float, float]:
    """(ppl_ratio, mean KL(reference || served)) of one job."""
    n = job.served.shape[0]
    ids = torch.tensor([job.token_ids[: job.prompt_len + n - 1]], dtype=torch.long)
    with torch.inference_mode():
        # logits of the n scored positions only: [n, V] float32, whatever the prompt's length
        logits = dense_forward(ids.to(_device_of(dense_forward)), logits_from=job.prompt_len - 1)
    logits = logits.reshape(-1, logits.shape[-1])
    ref = torch.log_softmax(logits.float().cpu(), dim=-1)
    served = job.served.float()
    chosen = torch.tensor(job.token_ids[job.prompt_len : job.prompt_len + n]).unsqueeze(1)
    nll_ref = -ref.gather(1, chosen).mean()
    nll_served = -served.gather(1, chosen).mean()
    ratio = float(torch.exp(nll_served - nll_ref))
    kl = float((ref.exp() * (ref - served)).sum(dim=-1).mean())
    return ratio, max(kl, 0.0)


def _device_of(fn: Callable[..., torch.Tensor]) -> torch.device:
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, torch.nn.Module):
        for p in owner.parameters():
            return p.device
    return torch.device("cpu")


def summarize_codecs(codecs: list[str]) -> str:
    """``"int4/fp8_e4m3 (layers 0-23)"``: each layer codec with its layers, runs merged."""
    runs: list[tuple[str, int, int]] = []
    for layer, name in enumerate(codecs):
        if runs and runs[-1][0] == name and runs[-1][2] == layer - 1:
            runs[-1] = (name, runs[-1][1], layer)
        else:
            runs.append((name, layer, layer))
    return ", ".join(f"{n} (layer{'s' * (a != b)} {a}{f'-{b}' * (a != b)})" for n, a, b in runs)


def fallback_window(base: int, page_size: int, level: int) -> int:
    """The BF16 window that fallback level ``level`` asks for."""
    if base > 0:
        return base * 2**level
    return 0 if level == 0 else page_size * 2 ** (level - 1)


class FallbackPolicy:
    """EWMA of drift and the level it calls for; pure state, testable without a model."""

    def __init__(self, threshold: float, max_level: int, alpha: float = 0.3, cooldown: int = 4) -> None:
        self.threshold = threshold
        self.max_level = max_level
        self.alpha = alpha
        self.cooldown = cooldown
        self.ewma: float | None = None
        self.level = 0
        self.low_streak = 0
        self.seen_at_level = 2  # samples seen since the last change
        self.changes = 0

    def update(self, drift: float) -> int:
        """Feed one drift value; returns the level change (-1, 0 or +1)."""
        self.ewma = drift if self.ewma is None else self.alpha * drift + (1 - self.alpha) * self.ewma
        self.seen_at_level += 1
        self.low_streak = self.low_streak + 1 if self.ewma < self.threshold * 0.5 else 0
        step = 0
        # After a change, wait for a second sample: the first may predate the new window.
        if self.ewma > self.threshold and self.level < self.max_level and self.seen_at_level >= 2:
            step = 1
        elif self.low_streak >= self.cooldown and self.level > 0:
            step = -1
        if step:
            self.level += step
            self.changes += 1
            self.seen_at_level = 0
            self.low_streak = 0
        return step


def _closed_forward(*args: object, **kwargs: object) -> torch.Tensor:
    raise RuntimeError("the drift monitor is closed")


class DriftMonitor:
    def __init__(
        self,
        dense_forward: Callable[[torch.Tensor], torch.Tensor],
        sample_rate: float,
        threshold: float,
        base_window: int,
        max_level: int,
        page_size: int = 16,
        metric: str = "ppl",
        max_tokens: int = 128,
        alpha: float = 0.3,
        cooldown: int = 4,
        on_level: Callable[[int, int], None] | None = None,
        on_sample: Callable[[DriftSample], None] | None = None,
        max_pending: int = 4,
        seed: int | None = None,
        raised_codecs: list[str] | None = None,
    ) -> None:
        if metric not in ("ppl", "kl"):
            raise ValueError(f"drift metric must be 'ppl' or 'kl', got {metric!r}")
        self.dense_forward = dense_forward
        self.sample_rate = sample_rate
        self.base_window = base_window
        self.page_size = page_size
        self.metric = metric
        self.max_tokens = max_tokens
        self.raised_codecs = raised_codecs
        self.raise_levels = 1 if raised_codecs else 0
        self.policy = FallbackPolicy(threshold, max_level + self.raise_levels, alpha, cooldown)
        self.on_level = on_level
        self.on_sample = on_sample
        self.rng = random.Random(seed)
        self.jobs: queue.Queue[DriftJob | None] = queue.Queue(maxsize=max_pending)
        self.samples = 0
        self.dropped = 0
        self.ratios: deque[float] = deque(maxlen=HISTORY)
        self.kls: deque[float] = deque(maxlen=HISTORY)
        self.lock = threading.Lock()
        self.idle = threading.Event()
        self.idle.set()
        self.thread = threading.Thread(target=self._run, name="kvstrata-drift", daemon=True)
        self.thread.start()

    def window(self, level: int | None = None) -> int:
        lvl = self.policy.level if level is None else level
        return fallback_window(self.base_window, self.page_size, max(0, lvl - self.raise_levels))

    def raised(self, level: int | None = None) -> bool:
        """Whether level ``level`` (default: now) writes new text pages in the raised codecs."""
        lvl = self.policy.level if level is None else level
        return self.raise_levels > 0 and lvl >= 1

    def describe(self, level: int) -> str:
        """What level ``level`` asks for, for the log: the window and the codecs of new text pages."""
        codecs = "shipped codecs"
        if self.raised(level):
            codecs = "raised codecs " + summarize_codecs(self.raised_codecs or [])
        return f"recent window {self.window(level)}, new pages in {codecs}"

    def should_sample(self) -> bool:
        return self.sample_rate > 0 and self.rng.random() < self.sample_rate

    def submit(self, job: DriftJob) -> bool:
        """Queue a finished request for re-scoring; dropped (False) when the worker is behind."""
        if job.served.shape[0] == 0:
            return False
        try:
            self.idle.clear()
            self.jobs.put_nowait(job)
            return True
        except queue.Full:
            with self.lock:
                self.dropped += 1
            if self.jobs.empty():
                self.idle.set()
            return False

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every queued job is scored (tests, shutdown)."""
        return self.idle.wait(timeout)

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            try:
                ratio, kl = score(self.dense_forward, job)
                self._record(job, ratio, kl)
            except Exception:  # a broken re-score must not take the engine down
                log.exception("drift re-score of %s failed", job.rid)
            finally:
                if self.jobs.empty():
                    self.idle.set()

    def _record(self, job: DriftJob, ratio: float, kl: float) -> None:
        with self.lock:
            old = self.policy.level
            step = self.policy.update(abs(ratio - 1.0) if self.metric == "ppl" else kl)
            self.samples += 1
            self.ratios.append(ratio)
            self.kls.append(kl)
            sample = DriftSample(job.rid, ratio, kl, job.served.shape[0], self.policy.ewma or 0.0, old + step)
        if step:
            new = old + step
            log.warning(
                "kv precision fallback level %d -> %d (drift ewma %.4f, threshold %.4f): %s",
                old,
                new,
                sample.ewma,
                self.policy.threshold,
                self.describe(new),
            )
            if self.on_level is not None:
                self.on_level(new, self.window(new))
        if self.on_sample is not None:
            self.on_sample(sample)

    def stats(self) -> DriftStats:
        with self.lock:
            return DriftStats(
                enabled=self.sample_rate > 0,
                level=self.policy.level,
                window=self.window(),
                ewma=self.policy.ewma or 0.0,
                samples=self.samples,
                dropped=self.dropped,
                level_changes=self.policy.changes,
                raised=self.raised(),
                ppl_ratios=list(self.ratios),
                kls=list(self.kls),
            )

    def close(self) -> None:
        """Stop the worker. Once it has stopped, the model's forward and the engine's callback are
        dropped: a shut-down engine's weights must not stay reachable through its monitor."""
        self.jobs.put(None)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.dense_forward = _closed_forward
            self.on_level = None
