"""CUDA: the sampler never synchronizes the stream (torch's sync debug mode counts stream and device
syncs and blocking copies): its one wait per step is on the event recorded after the ids' copy into
pinned memory (overlap scheduling); its tokens equal the CPU sampler's for greedy rows."""

from __future__ import annotations

import warnings

import pytest
import torch

from kvstrata.engine.sampler import PenaltyState, Sampler, SampleRow
from kvstrata.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

VOCAB = 512


def rows(device: str) -> list[SampleRow]:
    specs = [
        {"temperature": 0.0},
        {"temperature": 0.0, "repetition_penalty": 1.3},
        {"temperature": 0.8, "top_k": 20},
        {"temperature": 1.0, "top_p": 0.7, "min_p": 0.05},
    ]
    out = []
    for i, spec in enumerate(specs):
        params = SamplingParams.from_dict(spec)
        state = PenaltyState(VOCAB, [1, 2, 3], device) if params.needs_penalties else None
        gen = None if params.greedy or i == 3 else torch.Generator(device=device).manual_seed(i)
        out.append(SampleRow(params, gen, state))
    return out


def syncs_during(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def test_one_event_wait_per_step():
    logits = torch.randn(4, VOCAB, device="cuda") * 3
    batch = rows("cuda")
    sampler = Sampler()
    sampler(logits, batch)  # first call: lazy CUDA initialisation of the generators
    assert isinstance(sampler.launch(logits, batch).ready, torch.cuda.Event)
    got = {}
    # 0 (H200): before overlap scheduling the ids' blocking copy to the host counted 1 here
    assert syncs_during(lambda: got.setdefault("out", sampler(logits, batch))) == 0
    cpu = Sampler()(logits.cpu(), rows("cpu"))
    assert got["out"].tokens[:2] == cpu.tokens[:2]  # greedy rows, with and without a penalty
    assert got["out"].invalid == [False] * 4
