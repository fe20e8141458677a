"""Triton kernels with a raised pool (the drift fallback's wider codecs), under TRITON_INTERPRET=1 on CPU
and natively on CUDA: attention reads the raised pages as one more kernel pass (`_cold_passes`), equal
to float64 dense attention over what both pools store; the Triton page quantize writes each completed
page into the pool it was allocated from, byte-identical to the torch path."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_helpers import DEVICES, kernel_attend, reference_attend
from radix_helpers import rel_err, small_cache
from test_kernels_page_quantize import same_bytes, tricky

HKV, HQ, D, P = 2, 4, 32, 16
SCALE = 1 / math.sqrt(D)
# (shipped codec, raised codec): the fallback's auto raise of fp4 and int4, and a plain 8-bit one
PAIRS = [("fp4_e2m1", "int4/fp8_e4m3"), ("int4", "int8_asym/int8"), ("fp8_e4m3", "bf16")]


def raised_cache(text: str, raised: str, device: str, *, sinks: bool = False):
    return small_cache(
        num_layers=1,
        kv_heads=HKV,
        head_dim=D,
        page_size=P,
        recent_window=16,
        layer_codecs=[text],
        ring_dtype=torch.float32,
        num_pages=24,
        max_running=3,
        sinks=sinks,
        device=device,
        raised_codecs=[raised],
        raised_pages=16,
    )


def qkv(T: int, g: torch.Generator, dev) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.randn(T, HQ, D, generator=g).to(dev)
    return q, *(torch.randn(T, HKV, D, generator=g).to(dev) for _ in range(2))


def step(cache, seqs, n_new: list[int], g, check: bool, splits=None) -> int:
    """One step stored through the torch path; with ``check``, the kernels against the float64 reference
    first. Returns the groups that read raised pages."""
    batch = cache.begin_step(seqs, n_new)
    q, k, v = qkv(sum(n_new), g, cache.device)
    if check:
        got = kernel_attend(cache, batch, q, k, v, SCALE, splits)
        ref = reference_attend(cache, batch, q, k, v, SCALE)
        assert torch.isfinite(got).all()
        assert rel_err(got.cpu(), ref) < 2e-5, rel_err(got.cpu(), ref)
    cache.attention(0, batch, q, k, v, SCALE)
    cache.end_step(batch)
    return sum(grp.raised_plan is not None for grp in batch.groups)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("text", "raised"), PAIRS)
@pytest.mark.parametrize("splits", [None, 2])
def test_attention_reads_both_pools(text, raised, device, splits):
    cache = raised_cache(text, raised, device, sinks=splits is None)
    g = torch.Generator().manual_seed(1)
    seqs = [cache.admit(list(range(1000 * i + 1, 1000 * i + 120))) for i in range(3)]
    step(cache, seqs[:2], [40, 40], g, check=False)  # 2 shipped pages each
    cache.set_raised(True)
    step(cache, seqs, [30, 30, 50], g, check=False)  # raised pages next to shipped ones; seq 2 raised only
    cache.set_raised(False)
    assert step(cache, seqs, [1, 1, 1], g, check=True, splits=splits) == 1  # decode over both pools
    assert step(cache, seqs, [9, 9, 9], g, check=True, splits=splits) == 1  # an extend over both pools
    flags = [[cache.is_raised_page(p) for p in s.page_ids] for s in seqs]
    assert flags[0] == [False, False, True, True, False] and flags[2] == [True, True, True]
    for s in seqs:
        cache.finish(s)
    cache.check_invariants()


def test_group_without_raised_pages_is_one_pass():
    cache = raised_cache("int4", "int8", DEVICES[0])
    g = torch.Generator().manual_seed(2)
    seq = cache.admit(list(range(1, 80)))
    step(cache, [seq], [60], g, check=False)
    batch = cache.begin_step([seq], [1])
    assert batch.groups[0].raised_table is None and batch.groups[0].raised_plan is None
    cache.cancel_step(batch)
    assert step(cache, [seq], [1], g, check=True) == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("text", "raised"), PAIRS)
def test_triton_store_writes_each_pool_like_torch(text, raised, device):
    caches = [raised_cache(text, raised, device, sinks=True) for _ in range(2)]
    g = torch.Generator().manual_seed(3)
    seqs = [[c.admit(list(range(1000 * i + 1, 1000 * i + 140))) for i in range(3)] for c in caches]
    plan = [([40, 17, 33], False), ([9, 20, 16], True), ([1, 1, 1], True), ([16, 16, 16], False)]
    completed = 0
    for n_step, on in plan:
        T = sum(n_step)
        q = torch.randn(T, HQ, D, generator=g).to(device)
        k, v = (tricky(T, g, torch.float32).to(device) for _ in range(2))
        for c, s, kernels in zip(caches, seqs, (False, True), strict=True):
            c.set_raised(on)
            batch = c.begin_step(s, n_step)
            if kernels and batch.write.raised_split is not None:
                completed += batch.write.raised_split[1].numel()
            c.attention(0, batch, q, k, v, SCALE, kernels=kernels)
            c.end_step(batch)
        ref, got = caches
        for a, b in ((ref.pool, got.pool), (ref.raised_pool, got.raised_pool)):
            for kind in ("k", "v"):
                for name, buf in getattr(a, kind)[0].items():
                    assert same_bytes(buf, getattr(b, kind)[0][name]), (kind, name)
        assert same_bytes(ref.sinks.k, got.sinks.k) and same_bytes(ref.ring.k, got.ring.k)
    assert completed == 3  # the raised step completes one page of each sequence
    for c in caches:
        c.check_invariants()
