"""CUDA: the stratified cache on the GPU gives the CPU cache's attention, counts and bookkeeping.

Both caches see the same schedule (chunked prefills mixed with decodes, padded groups, pages
completed mid-step, prefix sharing through the tree) with the same random q/k/v, for raw and
quantized codecs, with and without sinks, on the one-pass and the block-wise path.
"""

from __future__ import annotations

import math

import pytest
import torch
from radix_helpers import rel_err, small_cache

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

HKV, HQ, D, P = 2, 6, 64, 16
SCALE = 1 / math.sqrt(D)
# (history codecs per layer, sinks, block_pages, ring dtype, bound on the GPU/CPU relative error)
CASES = [
    (["fp32", "fp32"], False, 64, torch.float32, 1e-5),
    (["bf16", "fp8_e4m3"], True, 64, torch.bfloat16, 1e-4),
    (["int4", "fp4_e2m1"], True, 2, torch.bfloat16, 1e-4),
    (["fp8_e5m2", "int8"], False, 2, torch.bfloat16, 1e-4),
]


def schedule() -> list[list[tuple[int, int]]]:
    """(sequence, new tokens) per step: chunked prefills of 0 and 1 beside decodes of 2, then decodes."""
    steps = [[(0, 70), (2, 20)], [(0, 45), (1, 33), (2, 1)], [(0, 1), (1, 40), (2, 1)]]
    steps += [[(0, 1), (1, 1), (2, 1)] for _ in range(20)]
    steps += [[(3, 100)], [(3, 1), (0, 1)]]  # 3 shares its first pages with 0 through the tree
    return steps


@pytest.mark.parametrize("codecs, sinks, block_pages, ring, bound", CASES)
def test_cuda_cache_equals_cpu_cache(codecs, sinks, block_pages, ring, bound):
    caches = {
        dev: small_cache(
            num_layers=len(codecs),
            kv_heads=HKV,
            head_dim=D,
            page_size=P,
            recent_window=32,
            layer_codecs=codecs,
            ring_dtype=ring,
            num_pages=96,
            max_running=4,
            sinks=sinks,
            block_pages=block_pages,
            device=dev,
        )
        for dev in ("cpu", "cuda")
    }
    g = torch.Generator().manual_seed(0)
    tokens = [list(range(i * 1000, i * 1000 + 300)) for i in range(3)]
    tokens.append(tokens[0][:96] + list(range(9000, 9200)))
    seqs: dict[str, dict[int, object]] = {"cpu": {}, "cuda": {}}
    finished_first = False
    worst = 0.0
    for step in schedule():
        if step[0][0] == 3 and not finished_first:
            for dev, cache in caches.items():  # sequence 0 puts its pages in the tree, then goes on
                cache.cache_prefix(seqs[dev][0])
            finished_first = True
        for dev, cache in caches.items():
            for i, _ in step:
                if i not in seqs[dev]:
                    seqs[dev][i] = cache.admit(tokens[i])
        total = sum(n for _, n in step)
        q = torch.randn(total, HQ, D, generator=g)
        k = torch.randn(total, HKV, D, generator=g) * 3
        v = torch.randn(total, HKV, D, generator=g)
        outs = {}
        for dev, cache in caches.items():
            batch = cache.begin_step([seqs[dev][i] for i, _ in step], [n for _, n in step])
            outs[dev] = [
                cache.attention(layer, batch, q.to(dev), k.to(dev), v.to(dev), SCALE).cpu()
                for layer in range(len(codecs))
            ]
            cache.end_step(batch)
            cache.check_invariants()
        for gpu, cpu in zip(outs["cuda"], outs["cpu"], strict=True):
            assert torch.isfinite(gpu).all()
            worst = max(worst, rel_err(gpu, cpu))
    assert worst < bound
    cpu_cache, gpu_cache = caches["cpu"], caches["cuda"]
    assert seqs["cuda"][3].cached_tokens == seqs["cpu"][3].cached_tokens == 96
    cpu_stats, gpu_stats = cpu_cache.stats(), gpu_cache.stats()
    assert gpu_stats.quantized_pages == cpu_stats.quantized_pages > 0
    assert gpu_cache.overflow == cpu_cache.overflow
    assert gpu_cache.nonfinite == cpu_cache.nonfinite
    for dev, cache in caches.items():
        for seq in list(seqs[dev].values()):
            cache.finish(seq)
        cache.check_invariants()
    assert gpu_cache.stats().tiers["cold"].used == cpu_cache.stats().tiers["cold"].used
