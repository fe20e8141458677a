"""One forward step: build the varlen batch, run the model over the cache, sample.

Python work per step is kept flat: one list build for ids and positions, one ``logits_at`` index,
one attention closure bound to the batch (the model calls it per layer), one ``tolist`` of sampled
ids. Logits are computed only for the last token of sequences that reached their end this step.
Decode steps replay the piecewise CUDA graphs when the engine captured them (`cuda_graph.py`).
"""

from __future__ import annotations

from typing import Any

import torch

from kvstrata.engine.attention import AttentionBackend
from kvstrata.engine.cuda_graph import DecodeGraphs
from kvstrata.engine.request import Request
from kvstrata.engine.sampler import SampleOutput, Sampler
from kvstrata.engine.scheduler import StepPlan


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

    def run(self, plan: StepPlan) -> tuple[list[Request], SampleOutput | None, torch.Tensor | None]:
        """Forward the plan; returns the requests that got a new token, the samples, and the logits."""
        try:
            logits, sampled = self._forward(plan)
        except BaseException:
            if not plan.batch.closed:
                self.cache.cancel_step(plan.batch)  # pages back, lengths unchanged
            raise
        self.cache.end_step(plan.batch)
        if not sampled:
            return [], None, None
        return sampled, self.sampler(logits, [r.row for r in sampled]), logits

    def _forward(self, plan: StepPlan) -> tuple[torch.Tensor, list[Request]]:
        ids: list[int] = []
        positions: list[int] = []
        logits_at: list[int] = []
        sampled: list[Request] = []
        images: list[tuple[int, torch.Tensor]] = []  # (row in the batch, feature rows) to splice
        for req, n in zip(plan.reqs, plan.n_new, strict=True):
            start = req.computed
            end = start + n
            if req.mm is not None and start < len(req.prompt_ids):
                images.extend((len(ids) + i, rows) for i, rows in req.mm.rows(start, end))
            p = len(req.prompt_ids)
            if end <= p:
                ids.extend(req.prompt_ids[start:end])
            elif start >= p:
                ids.extend(req.output_ids[start - p : end - p])
            else:
                ids.extend(req.prompt_ids[start:])
                ids.extend(req.output_ids[: end - p])
            positions.extend(range(start, end))
            if end == req.tokens_len:
                logits_at.append(len(ids) - 1)
                sampled.append(req)
        if self.graphs is not None and not images and self._graph_step(plan, sampled):
            return self.graphs.run(ids, positions, self.backend.bind(plan.batch)), sampled
        dev = self.device
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        at = torch.tensor(logits_at, dtype=torch.long, device=dev)
        embeds = self._splice(input_ids, images) if images else None
        logits = self.net(input_ids, pos, attn=self.backend.bind(plan.batch), logits_at=at, embeds=embeds)
        return logits, sampled

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
