"""One forward step: build the varlen batch, run the model over the cache, sample.

Python work per step is kept flat: one list build for ids and positions, one ``logits_at`` index,
one attention closure bound to the batch (the model calls it per layer), one ``tolist`` of sampled
ids. Logits are computed only for the last token of sequences that reached their end this step.
Decode steps replay the CUDA graphs when the engine captured them: piecewise (`cuda_graph.py`) or
the whole step (`full_graph.py`).

Overlap scheduling splits a step in two: `launch` queues the forward pass and the sampling on the
device, and its sampled ids may stay there while the next step is planned and launched: that step
reads them on the device as the input ids of the requests still waiting for them (``req.pending``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvstrata.engine.attention import AttentionBackend
from kvstrata.engine.cuda_graph import DecodeGraphs
from kvstrata.engine.request import Request
from kvstrata.engine.sampler import DeviceSample, SampleOutput, Sampler, host_to_device
from kvstrata.engine.scheduler import StepPlan


@dataclass
class Launched:
    """A step whose forward pass and sampling are queued on the device."""

    plan: StepPlan
    sampled: list[Request]  # the requests that get a token, in the sample's row order
    sample: DeviceSample | None  # None when no request reached its end this step
    logits: torch.Tensor | None  # float32 [len(sampled), V]; valid until the next step's forward


class StepRunner:
    def __init__(
        self,
        net: Any,
        cache: Any,
        backend: AttentionBackend,
        device: torch.device,
        graphs: DecodeGraphs | None = None,
    ) -> None:
        self.net = net
        self.cache = cache
        self.backend = backend
        self.device = device
        self.sampler = Sampler()
        self.graphs = graphs  # decode steps of up to graphs.max_bs sequences replay CUDA graphs
        self.on_launched: Callable[[], None] | None = None  # the step timeline's mark (`trace.py`)

    def run(self, plan: StepPlan) -> tuple[list[Request], SampleOutput | None, torch.Tensor | None]:
        """Forward the plan; returns the requests that got a new token, the samples, and the logits."""
        step = self.launch(plan)
        self.cache.end_step(plan.batch)
        if step.sample is None:
            return [], None, None
        return step.sampled, self.sampler.collect(step.sample), step.logits

    def launch(self, plan: StepPlan, before: Launched | None = None) -> Launched:
        """Queue the plan's forward pass and sampling; the step stays open (`cache.end_step` is the
        caller's). ``before``: the step whose ids of the plan's pending requests are still on the device."""
        try:
            logits, sampled = self._forward(plan, before)
            sample = self.sampler.launch(logits, [r.row for r in sampled]) if sampled else None
        except BaseException:
            if not plan.batch.closed:
                self.cache.cancel_step(plan.batch)  # pages back, lengths unchanged
            raise
        if self.on_launched is not None:
            self.on_launched()
        return Launched(plan, sampled, sample, logits if sampled else None)

    def _forward(self, plan: StepPlan, before: Launched | None) -> tuple[torch.Tensor, list[Request]]:
        ids: list[int] = []
        positions: list[int] = []
        logits_at: list[int] = []
        sampled: list[Request] = []
        images: list[tuple[int, torch.Tensor]] = []  # (row in the batch, feature rows) to splice
        on_device: list[int] = []  # rows of ``ids`` whose token is still on the device ...
        from_row: list[int] = []  # ... and its row in ``before``'s sample
        before_row = {id(r): i for i, r in enumerate(before.sampled)} if before is not None else {}
        for req, n in zip(plan.reqs, plan.n_new, strict=True):
            start = req.computed
            end = start + n
            known = min(end, req.tokens_len - req.pending)  # ids the host has
            if req.mm is not None and start < len(req.prompt_ids):
                images.extend((len(ids) + i, rows) for i, rows in req.mm.rows(start, end))
            p = len(req.prompt_ids)
            if known <= p:
                ids.extend(req.prompt_ids[start:known])
            elif start >= p:
                ids.extend(req.output_ids[start - p : known - p])
            else:
                ids.extend(req.prompt_ids[start:])
                ids.extend(req.output_ids[: known - p])
            if known < end:  # its last sampled token: the previous step's, on the device
                on_device.append(len(ids))
                from_row.append(before_row[id(req)])
                ids.append(0)
            positions.extend(range(start, end))
            if end == req.tokens_len:
                logits_at.append(len(ids) - 1)
                sampled.append(req)
        fill = self._filler(on_device, from_row, before)
        if self.graphs is not None and not images and self._graph_step(plan, sampled):
            logits = self.graphs.step(ids, positions, plan.batch, self.backend.bind, fill)
            if logits is not None:
                return logits, sampled
        dev = self.device
        input_ids = host_to_device(ids, torch.long, dev)
        if fill is not None:
            fill(input_ids)
        pos = host_to_device(positions, torch.long, dev)
        at = host_to_device(logits_at, torch.long, dev)
        embeds = self._splice(input_ids, images) if images else None
        logits = self.net(input_ids, pos, attn=self.backend.bind(plan.batch), logits_at=at, embeds=embeds)
        return logits, sampled

    def _filler(
        self, rows: list[int], from_row: list[int], before: Launched | None
    ) -> Callable[[torch.Tensor], None] | None:
        """What writes the ids still on the device into a step's id tensor (None: there are none)."""
        if not rows:
            return None
        assert before is not None and before.sample is not None
        dev = self.device
        dst, src = host_to_device(rows, torch.long, dev), host_to_device(from_row, torch.long, dev)
        tokens = before.sample.tokens

        def fill(input_ids: torch.Tensor) -> None:
            input_ids.index_copy_(0, dst, tokens.index_select(0, src))

        return fill

    def _graph_step(self, plan: StepPlan, sampled: list[Request]) -> bool:
        """A decode step the graphs cover: one new token per sequence, every one sampled."""
        assert self.graphs is not None
        n = len(plan.reqs)
        return len(sampled) == n <= self.graphs.max_bs and all(k == 1 for k in plan.n_new)

    def _splice(self, input_ids: torch.Tensor, images: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        """Token embeddings with image feature rows in place of the placeholders (pad ids lie
        outside the vocabulary, so they are clamped before the lookup and then overwritten)."""
        embed = self.net.embed
        x = embed(input_ids.clamp(max=embed.num_embeddings - 1))
        for row, feats in images:
            x[row : row + feats.shape[0]] = feats.to(device=x.device, dtype=x.dtype)
        return x
