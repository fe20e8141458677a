"""Batched sampling: penalties, temperature, top-k / top-p / min-p, per-request seeds, logprobs.

Conventions (SGLang's): the repetition penalty covers prompt and output tokens (a positive logit is
divided by it, a negative one multiplied); frequency and presence penalties cover output tokens only
(OpenAI's definition). The three filters are computed on the same tempered distribution, not one
after another renormalised: top-k keeps the k most likely tokens, top-p the smallest head whose mass
reaches p, min-p the tokens with probability >= min_p * max. Reported logprobs are those of the raw
model distribution (log-softmax of the logits before penalties and temperature).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstrata.engine.sampling_params import SamplingParams


class PenaltyState:
    """Token counts of one request, kept only when it uses a penalty."""

    def __init__(self, vocab: int, prompt_ids: Sequence[int], device: torch.device | str = "cpu") -> None:
        self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)  # output tokens
        self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)  # prompt + output tokens
        if len(prompt_ids):
            ids = torch.tensor(list(prompt_ids), dtype=torch.long, device=device).clamp_(0, vocab - 1)
            self.seen[ids] = True

    def add(self, token: int) -> None:
        self.counts[token] += 1.0
        self.seen[token] = True


@dataclass
class SampleRow:
    """What the sampler needs of one request."""

    params: SamplingParams
    generator: torch.Generator | None = None
    penalties: PenaltyState | None = None


@dataclass
class SampleOutput:
    tokens: list[int]
    # Rows whose logits held NaN or +Inf, or only -Inf: no token can be drawn from them (their
    # entry in ``tokens`` is meaningless); the engine ends those requests with an error.
    invalid: list[bool] = field(default_factory=list)
    # Filled only when some row asked for them (return_logprob):
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    logprobs: torch.Tensor | None = None  # [B, V] raw log-softmax, when computed


def apply_penalties(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """Penalise in place the rows that use penalties; returns logits."""
    for i, row in enumerate(rows):
        p, state = row.params, row.penalties
        if state is None or not p.needs_penalties:
            continue
        x = logits[i]
        if p.repetition_penalty != 1.0:
            scaled = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
            x.copy_(torch.where(state.seen, scaled, x))
        if p.frequency_penalty != 0.0:
            x.sub_(state.counts * p.frequency_penalty)
        if p.presence_penalty != 0.0:
            x.sub_((state.counts > 0).to(x.dtype) * p.presence_penalty)
    return logits


def filter_probs(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Zero the tokens that top-k / top-p / min-p remove. probs [B, V]; the others [B] per row.

    top_k <= 0 means off. Ties at the k-th place are broken by sort order (stable, lower id first).
    """
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    rank = torch.arange(probs.shape[-1], device=probs.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k.clamp(max=probs.shape[-1]), probs.shape[-1]).unsqueeze(1)
    drop = rank >= k
    drop |= (sorted_p.cumsum(dim=-1) - sorted_p) >= top_p.unsqueeze(1)  # mass before it already >= p
    drop |= sorted_p < (sorted_p[:, :1] * min_p.unsqueeze(1))
    drop[:, 0] = False  # the most likely token always survives
    keep = torch.zeros_like(drop).scatter_(1, order, ~drop)
    return probs.masked_fill(~keep, 0.0)


@dataclass
class DeviceSample:
    """A launched sample: ids still on the device, and their host copy once ``ready`` has fired."""

    tokens: torch.Tensor  # [B] on the device: the next step's input ids under overlap scheduling
    host: torch.Tensor  # [2, B] ids and invalid flags (pinned, filled asynchronously, on CUDA)
    ready: torch.cuda.Event | None  # CUDA: recorded after the copy to ``host``
    logprobs: torch.Tensor | None
    rows: Sequence[SampleRow]


class Sampler:
    """Samples one token per row of logits [B, V]."""

    def __init__(self) -> None:
        # Called once the step is launched, just before the host waits for the device (the engine
        # hands the previous step's streamed chunks to the event loop there: `EngineCore`).
        self.before_sync: Callable[[], None] | None = None
        # Host seconds `collect` spent in ``before_sync`` and blocked on the device, summed until the
        # engine's step timeline takes them (`take_times`).
        self.flush_s = 0.0
        self.wait_s = 0.0

    def take_times(self) -> tuple[float, float]:
        times = (self.flush_s, self.wait_s)
        self.flush_s = self.wait_s = 0.0
        return times

    def __call__(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> SampleOutput:
        return self.collect(self.launch(logits, rows))

    def launch(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> DeviceSample:
        """Sample on the device and start the copy of the ids to the host; nothing waits for it."""
        logits = logits.float()
        # One pass over the logits finds every row's max and its first index (argmax's token). A row
        # is invalid when it holds a NaN (the max is NaN), a +Inf (the max is +Inf) or only -Inf (the
        # max is -Inf): exactly when its max is not finite.
        top, tokens = logits.max(dim=-1)
        invalid = ~torch.isfinite(top)
        greedy = [r.params.greedy for r in rows]
        want_lp = [r.params.return_logprob for r in rows]
        penalize = any(r.penalties is not None and r.params.needs_penalties for r in rows)
        logprobs = None
        if all(greedy) and not any(want_lp) and not penalize:
            tokens = tokens.masked_fill(invalid, 0)  # as the argmax of a zeroed row
        else:
            # A bad row must not reach torch.multinomial: it would abort the whole batch (and on
            # CUDA poison the context). It samples from zeros instead and is reported as invalid.
            logits = logits.masked_fill(invalid.unsqueeze(1), 0.0)
            logprobs = torch.log_softmax(logits, dim=-1) if any(want_lp) else None
            if penalize:
                logits = apply_penalties(logits, rows)  # in place: masked_fill made a new tensor
            tokens = logits.argmax(dim=-1)
            if not all(greedy):
                tokens = self._sample(logits, rows, greedy, tokens)
        # The step's one device-to-host copy: sampled ids and invalid flags travel together.
        packed = torch.stack((tokens, invalid.to(tokens.dtype)))
        ready = None
        if packed.device.type == "cuda":  # into pinned memory, ordered before later steps' kernels
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
            packed = host
        return DeviceSample(tokens, packed, ready, logprobs, rows)

    def collect(self, sample: DeviceSample) -> SampleOutput:
        """Wait for a launched sample's ids (only for the work launched before it) and read them."""
        t0 = time.perf_counter()
        if self.before_sync is not None:
            self.before_sync()
        t1 = time.perf_counter()
        if sample.ready is not None:
            sample.ready.synchronize()
        self.flush_s += t1 - t0
        self.wait_s += time.perf_counter() - t1
        token_list, invalid_list = sample.host.tolist()
        out = SampleOutput(
            tokens=token_list, invalid=[bool(b) for b in invalid_list], logprobs=sample.logprobs
        )
        if sample.logprobs is not None:
            out.token_logprobs, out.top_logprobs = _gather_logprobs(
                sample.logprobs, sample.tokens, sample.rows
            )
        return out

    def _sample(
        self, logits: torch.Tensor, rows: Sequence[SampleRow], greedy: list[bool], tokens: torch.Tensor
    ) -> torch.Tensor:
        idx = [i for i, g in enumerate(greedy) if not g]
        dev = logits.device
        every_row = len(idx) == len(rows)
        sub = logits if every_row else logits.index_select(0, host_to_device(idx, torch.long, dev))
        # The rows' parameters reach the device in one asynchronous copy (no host sync).
        params = [rows[i].params for i in idx]
        knobs = host_to_device(
            [
                [p.temperature for p in params],
                [p.top_p for p in params],
                [p.min_p for p in params],
                [p.top_k for p in params],  # exact in float32: vocabularies are far below 2**24
            ],
            torch.float32,
            dev,
        )
        probs = torch.softmax(sub / knobs[0].unsqueeze(1), dim=-1)
        if any(p.needs_filters for p in params):
            probs = filter_probs(probs, knobs[3].long(), knobs[1], knobs[2])
        seeded = [j for j, i in enumerate(idx) if rows[i].generator is not None]
        if not seeded:
            picked = torch.multinomial(probs, 1).squeeze(1)
        else:
            picked = torch.empty(len(idx), dtype=torch.long, device=dev)
            if len(seeded) < len(idx):
                free = host_to_device(
                    [j for j in range(len(idx)) if rows[idx[j]].generator is None], torch.long, dev
                )
                picked.index_copy_(0, free, torch.multinomial(probs.index_select(0, free), 1).squeeze(1))
            for j in seeded:
                picked[j] = torch.multinomial(probs[j], 1, generator=rows[idx[j]].generator)[0]
        if every_row:
            return picked
        return tokens.index_copy(0, host_to_device(idx, torch.long, dev), picked)


def host_to_device(values: list[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a device tensor, copied without waiting for the device: from pinned
    memory on CUDA (a plain ``torch.tensor(..., device=cuda)`` synchronizes the stream)."""
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def _gather_logprobs(
    logprobs: torch.Tensor, tokens: torch.Tensor, rows: Sequence[SampleRow]
) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    chosen_list = chosen.tolist()
    max_top = max(r.params.top_logprobs_num for r in rows)
    top_vals = top_ids = None
    if max_top > 0:
        top_vals, top_ids = torch.topk(logprobs, max_top, dim=-1)
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    token_lp: list[float | None] = []
    top_lp: list[list[tuple[int, float]] | None] = []
    for i, row in enumerate(rows):
        if not row.params.return_logprob:
            token_lp.append(None)
            top_lp.append(None)
            continue
        token_lp.append(chosen_list[i])
        n = row.params.top_logprobs_num
        top_lp.append(list(zip(top_ids[i][:n], top_vals[i][:n], strict=True)) if n and top_ids else [])
    return token_lp, top_lp
