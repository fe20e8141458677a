"""The read/write path: cache attention against plain softmax attention over the same K/V."""

from __future__ import annotations

import math

import pytest
import torch
from radix_helpers import dense_attention, rel_err, small_cache

from kvstrata.radix import StratifiedKVCache

HKV, HQ, D, P, W = 2, 6, 32, 4, 8  # head_dim 32: fp4 values use 32-channel blocks
SCALE = 1 / math.sqrt(D)


class Stream:
    """Random K/V/Q of one sequence per layer, and a record of what the cache stored where."""

    def __init__(
        self, cache: StratifiedKVCache, length: int, seed: int, tokens: list[int] | None = None
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        layers = cache.cfg.num_layers
        self.k = torch.randn(layers, length, HKV, D, generator=g)
        self.v = torch.randn(layers, length, HKV, D, generator=g)
        self.q = torch.randn(layers, length, HQ, D, generator=g)
        self.seq = cache.admit(tokens or list(range(seed * 1000, seed * 1000 + length)))


def run_steps(
    cache: StratifiedKVCache, schedule: list[list[tuple[Stream, int]]], reference
) -> tuple[float, int]:
    """Run each step of ``schedule`` through all layers; return the worst relative error against
    ``reference(layer, stream, n)`` and the number of outputs compared."""
    worst, compared = 0.0, 0
    for step in schedule:
        streams = [s for s, _ in step]
        n_new = [n for _, n in step]
        refs = {}
        for layer in range(cache.cfg.num_layers):
            for s, n in step:
                refs[layer, id(s)] = reference(layer, s, n)
        batch = cache.begin_step([s.seq for s in streams], n_new)
        for layer in range(cache.cfg.num_layers):
            sl = [slice(s.seq.length, s.seq.length + n) for s, n in step]
            q = torch.cat([s.q[layer, x] for s, x in zip(streams, sl, strict=True)])
            k = torch.cat([s.k[layer, x] for s, x in zip(streams, sl, strict=True)])
            v = torch.cat([s.v[layer, x] for s, x in zip(streams, sl, strict=True)])
            out = cache.attention(layer, batch, q, k, v, SCALE)
            row = 0
            for s, n in step:
                worst = max(worst, rel_err(out[row : row + n], refs[layer, id(s)]))
                compared += 1
                row += n
        cache.end_step(batch)
        cache.check_invariants()
    return worst, compared


def original(layer: int, s: Stream, n: int) -> torch.Tensor:
    L = s.seq.length
    return dense_attention(s.q[layer, L : L + n], s.k[layer, : L + n], s.v[layer, : L + n], L, SCALE)


def mixed_schedule(a: Stream, b: Stream, c: Stream) -> list[list[tuple[Stream, int]]]:
    """Chunked prefills of hundreds of tokens in the same steps as decodes of other sequences."""
    steps = [[(a, 130), (b, 9)], [(a, 128), (b, 1), (c, 30)]]
    steps += [[(a, 1), (b, 1), (c, 1)] for _ in range(6)]
    steps += [[(a, 1), (c, 17)], [(b, 3), (c, 1)]]
    return steps


def make(
    codecs: list[str], ring: torch.dtype = torch.float32, page_size: int = P, window: int = W, **kw
) -> StratifiedKVCache:
    """fp4_e2m1 keys need pages of 16 tokens (its channel scales cover 16-token blocks)."""
    return small_cache(
        num_layers=len(codecs),
        kv_heads=HKV,
        head_dim=D,
        page_size=page_size,
        recent_window=window,
        layer_codecs=codecs,
        ring_dtype=ring,
        num_pages=200,
        **kw,
    )


# 64 pages: every history here fits one pass (one SDPA call per group); 2 pages: the block-wise
# online softmax over several blocks.
BLOCKS = pytest.mark.parametrize("block_pages", [64, 2])


@BLOCKS
def test_fp32_storage_equals_attention_over_original_kv_gqa_chunked_prefill_and_decode(
    block_pages: int,
) -> None:
    cache = make(["fp32", "fp32"], block_pages=block_pages)
    a, b, c = Stream(cache, 270, 1), Stream(cache, 20, 2), Stream(cache, 60, 3)
    worst, compared = run_steps(cache, mixed_schedule(a, b, c), original)
    assert compared == 2 * 27
    assert worst < 1e-5
    assert a.seq.length == 265 and a.seq.ring_start == (265 - W) // P * P
    assert (b.seq.length, c.seq.length) == (19, 54)
    assert cache.stats().quantized_pages == 265 // P + 19 // P + 54 // P


def test_bf16_storage_equals_attention_over_bf16_rounded_history() -> None:
    cache = make(["bf16"], ring=torch.bfloat16)
    a, b, c = Stream(cache, 270, 1), Stream(cache, 20, 2), Stream(cache, 60, 3)

    def rounded(layer: int, s: Stream, n: int) -> torch.Tensor:
        L = s.seq.length
        k = torch.cat([s.k[layer, :L].bfloat16().float(), s.k[layer, L : L + n]])
        v = torch.cat([s.v[layer, :L].bfloat16().float(), s.v[layer, L : L + n]])
        return dense_attention(s.q[layer, L : L + n], k, v, L, SCALE)

    worst, _ = run_steps(cache, mixed_schedule(a, b, c), rounded)
    assert worst < 1e-5
    worst_vs_exact, _ = run_steps(cache, [[(a, 1), (b, 1), (c, 1)]], original)
    assert 1e-5 < worst_vs_exact < 1e-2  # the history really is rounded to bf16


def stored_history(cache: StratifiedKVCache, layer: int, s: Stream, n: int) -> torch.Tensor:
    """Dense attention over what the cache holds: cold pages dequantized from the pool (the first
    page from its sink, if any), the ring in ring_dtype, the new tokens at full precision."""
    seq, L, P = s.seq, s.seq.length, cache.page_size
    cold = seq.ring_start // P
    parts_k, parts_v = [], []
    if cold:
        k, v = cache.pool.read(layer, torch.tensor(seq.page_ids[:cold]), torch.float32)
        k, v = k.reshape(-1, HKV, D), v.reshape(-1, HKV, D)
        if cache.sinks is not None:
            sink = cache.sinks.of_page[seq.page_ids[0]]
            k[:P], v[:P] = cache.sinks.k[layer, sink].float(), cache.sinks.v[layer, sink].float()
        parts_k.append(k)
        parts_v.append(v)
    dt = cache.cfg.ring_dtype
    parts_k += [s.k[layer, seq.ring_start : L].to(dt).float(), s.k[layer, L : L + n]]
    parts_v += [s.v[layer, seq.ring_start : L].to(dt).float(), s.v[layer, L : L + n]]
    return dense_attention(s.q[layer, L : L + n], torch.cat(parts_k), torch.cat(parts_v), L, SCALE)


@BLOCKS
@pytest.mark.parametrize("plan", [["fp8_e4m3", "fp4_e2m1"], ["int4", "int8"]])
def test_quantized_history_equals_attention_over_dequantized_sequence(
    plan: list[str], block_pages: int
) -> None:
    cache = make(plan, ring=torch.bfloat16, page_size=16, window=16, block_pages=block_pages)
    a, b, c = Stream(cache, 270, 1), Stream(cache, 20, 2), Stream(cache, 60, 3)

    def ref(layer: int, s: Stream, n: int) -> torch.Tensor:
        return stored_history(cache, layer, s, n)

    worst, compared = run_steps(cache, mixed_schedule(a, b, c), ref)
    assert compared == 54 and worst < 1e-5
    # The pool holds the right tokens: its pages decode close to the original K.
    k, _ = cache.pool.read(1, torch.tensor(a.seq.page_ids), torch.float32)
    assert rel_err(k.reshape(-1, HKV, D), a.k[1, : len(a.seq.page_ids) * 16]) < 0.2


def test_sinks_keep_the_first_page_in_bf16_for_matching_sequences_too() -> None:
    P = 16
    cache = make(["fp4_e2m1"], ring=torch.bfloat16, sinks=True, page_size=P, window=16)
    tokens = list(range(100, 164))
    a = Stream(cache, 64, 1, tokens=tokens)

    def ref(layer: int, s: Stream, n: int) -> torch.Tensor:
        return stored_history(cache, layer, s, n)

    worst, _ = run_steps(cache, [[(a, 40)], [(a, 20)], [(a, 1)], [(a, 1)]], ref)
    assert worst < 1e-5
    sink = cache.sinks.of_page[a.seq.page_ids[0]]
    assert torch.equal(cache.sinks.k[0, sink], a.k[0, :P].bfloat16())
    cache.finish(a.seq)
    b = Stream(cache, 64, 1, tokens=tokens[:60] + [7, 7, 7, 7])
    assert b.seq.cached_tokens == 48 and b.seq.page_ids[0] == cache.tree.match_prefix(tokens[:P]).pages[0]
    worst, _ = run_steps(cache, [[(b, 8)]], ref)
    assert worst < 1e-5
    with_sink = stored_history(cache, 0, b, 1)
    cache.sinks.k[0, sink] = 0.0  # the cache must be reading the sink, not the fp4 page
    out_changed, _ = run_steps(cache, [[(b, 1)]], lambda layer, s, n: with_sink)
    assert out_changed > 1e-3
    assert cache.stats().tiers["sink"].used == 1


def test_window_widening_keeps_dropped_positions_cold_and_narrowing_drops_more() -> None:
    cache = make(["fp8_e4m3"], ring=torch.bfloat16, max_recent_window=16)
    a = Stream(cache, 80, 1)

    def ref(layer: int, s: Stream, n: int) -> torch.Tensor:
        return stored_history(cache, layer, s, n)

    run_steps(cache, [[(a, 30)]], ref)
    assert a.seq.ring_start == (30 - W) // P * P == 20
    cache.set_recent_window(16)
    worst, _ = run_steps(cache, [[(a, 1)], [(a, 5)]], ref)
    assert a.seq.ring_start == 20 and worst < 1e-5  # widened: nothing comes back from cold
    run_steps(cache, [[(a, 10)]], ref)
    assert a.seq.ring_start == (46 - 16) // P * P == 28
    cache.set_recent_window(0)
    run_steps(cache, [[(a, 1)]], ref)
    assert a.seq.ring_start == 44
    with pytest.raises(ValueError, match="multiple of 4"):
        cache.set_recent_window(6)
    with pytest.raises(ValueError, match=r"\[0, 16\]"):
        cache.set_recent_window(20)


def test_rotation_keeps_attention_exact_with_fp32_storage() -> None:
    cache = make(["fp32"], rotation=True)
    a, b, c = Stream(cache, 270, 1), Stream(cache, 20, 2), Stream(cache, 60, 3)
    worst, _ = run_steps(cache, mixed_schedule(a, b, c), original)
    assert worst < 1e-5


class FixedScales:
    """A stand-in for a scales file: one clip value for every head and channel."""

    def __init__(self, clip: float) -> None:
        self.value = clip

    def check_geometry(self, num_layers: int, kv_heads: int, head_dim: int) -> None:
        assert (kv_heads, head_dim) == (HKV, D)

    def clip(self, layer: int, kind: str) -> torch.Tensor:
        return torch.full((HKV, 1), self.value)


def test_static_scales_count_clipped_and_nonfinite_elements_per_layer_and_kind() -> None:
    cache = make(["fp8_e4m3", "fp8_e4m3"], ring=torch.bfloat16, scales=FixedScales(1.5))
    a = Stream(cache, 16, 1)
    a.k[1, 3, 0, 0] = float("nan")
    run_steps(cache, [[(a, 8)]], lambda layer, s, n: torch.zeros(n, HQ, D))
    stats = cache.stats()
    for layer in range(2):
        assert stats.overflow_k[layer] == int((a.k[layer, :8].abs() > 1.5).sum())
        assert stats.overflow_v[layer] == int((a.v[layer, :8].abs() > 1.5).sum())
    assert stats.nonfinite_k == [0, 1] and stats.nonfinite_v == [0, 0]
    finite_k = a.k[:, :8].nan_to_num(0.0).abs().amax(dim=(1, 2, 3))
    assert stats.absmax_k == pytest.approx(finite_k.tolist())
    assert stats.absmax_ratio_k == pytest.approx((finite_k / 1.5).tolist())
    assert stats.quantized_elements == 2 * P * HKV * D


def test_static_scales_refuse_rotation() -> None:
    with pytest.raises(ValueError, match="cannot be combined with rotation"):
        make(["int8"], scales=FixedScales(1.5), rotation=True)


@BLOCKS
@pytest.mark.parametrize("codecs, sinks", [(["fp32"], False), (["bf16"], False), (["fp8_e4m3"], True)])
def test_non_finite_kv_of_one_sequence_never_reaches_another(codecs, sinks, block_pages):
    """Batch padding must never read another sequence's rows: a NaN stored by sequence A must not
    turn the output of sequence B, batched with it, non-finite or different."""
    alone = make(codecs, sinks=sinks, block_pages=block_pages)
    together = make(codecs, sinks=sinks, block_pages=block_pages)
    # B is short: it has no cold page and no sink, so all of its page and sink table is padding.
    b_alone = Stream(alone, 8, seed=2)
    a, b = Stream(together, 41, seed=1), Stream(together, 8, seed=2)
    a.v[:, 3, 0, 0] = float("nan")
    a.k[:, 5, 1, 2] = float("inf")

    def step(cache, streams, n_new):
        batch = cache.begin_step([s.seq for s in streams], n_new)
        outs = []
        for layer in range(cache.cfg.num_layers):
            sl = [slice(s.seq.length, s.seq.length + n) for s, n in zip(streams, n_new, strict=True)]
            cat = [
                torch.cat([getattr(s, t)[layer, x] for s, x in zip(streams, sl, strict=True)]) for t in "qkv"
            ]
            outs.append(cache.attention(layer, batch, *cat, SCALE))
        cache.end_step(batch)
        return outs

    step(alone, [b_alone], [6])
    step(together, [a, b], [40, 6])
    ref = step(alone, [b_alone], [1])
    got = step(together, [a, b], [1, 1])
    for layer, out in enumerate(got):
        assert torch.isfinite(out[1]).all()
        assert rel_err(out[1:2], ref[layer]) < 1e-6
    together.check_invariants()
