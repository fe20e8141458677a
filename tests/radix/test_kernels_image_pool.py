"""Triton kernels with image pages in a pool of their own (``--vision-kv-dtype``), under TRITON_INTERPRET=1
on CPU and natively on CUDA.

Attention: one kernel pass per cold pool (text pool with sinks, ring and new tokens; image pool alone),
merged by log-sum-exp, against float64 dense attention over what both pools store (each page dequantized
by its own pool's codec). Batches mix sequences with image pages, text-only ones and ring-only ones; decode
steps, prefill chunks over an image span read back from the tree, and forced split-KV in both passes.
Store: the Triton page quantize writes each completed page to the pool its tokens call for, byte-identical
to the torch path.
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_helpers import DEVICES, kernel_attend, reference_attend
from radix_helpers import rel_err, small_cache
from test_kernels_page_quantize import same_bytes, tricky

HKV, HQ, D, P = 2, 6, 32, 16
SCALE = 1 / math.sqrt(D)
IMAGE = 100_000  # token ids from here on are image tokens (pad ids past the vocabulary)
# (text codec, image codec): the image pool in BF16, FP8 and INT4 next to another text codec
PAIRS = [("int4", "bf16"), ("int4", "fp8_e4m3"), ("fp8_e4m3", "int4"), ("int8", "fp4_e2m1")]


def image_cache(
    text: str, image: str, device: str, *, sinks: bool = False, dtype=torch.float32, page: int = P
):
    return small_cache(
        num_layers=1,
        kv_heads=HKV,
        head_dim=D,
        page_size=page,
        recent_window=16,
        layer_codecs=[text],
        ring_dtype=dtype,
        num_pages=48,
        max_running=4,
        sinks=sinks,
        device=device,
        image_codec=image,
        image_pages=24,
        image_token_from=IMAGE,
    )


def prompt(i: int, before: int, image: int, total: int) -> list[int]:
    """``before`` text tokens, an image span of ``image`` tokens, text up to ``total`` tokens."""
    text = iter(range(1000 * i + 1, 1000 * i + total + 1))
    return [next(text) for _ in range(before)] + [IMAGE + i] * image + list(text)[: total - before - image]


# (text before the image, image tokens, prefill length): image pages first, text-only, image in the middle
# (two text pages, two image pages cold), ring-only; 64 more tokens for the steps that follow.
SHAPES = [(3, 40, 100), (0, 0, 37), (40, 20, 90), (0, 0, 5)]


def step_qkv(T: int, g: torch.Generator, dev, dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.randn(T, HQ, D, generator=g).to(device=dev, dtype=dtype)
    k, v = (torch.randn(T, HKV, D, generator=g).to(device=dev, dtype=dtype) for _ in range(2))
    return q, k, v


def check(cache, seqs, n_new: int, steps: int, g, tol: float, dtype=torch.float32, splits=None) -> int:
    """``steps`` steps of ``n_new`` tokens: kernels against the float64 reference before the torch path
    stores each step. Returns the number of groups that read image pages."""
    with_images = 0
    for _ in range(steps):
        batch = cache.begin_step(seqs, [n_new] * len(seqs))
        q, k, v = step_qkv(n_new * len(seqs), g, cache.device, dtype)
        got = kernel_attend(cache, batch, q, k, v, SCALE, splits)
        ref = reference_attend(cache, batch, q, k, v, SCALE)
        assert got.dtype == dtype and torch.isfinite(got).all()
        for i in range(len(seqs)):
            rows = slice(i * n_new, (i + 1) * n_new)
            assert rel_err(got[rows].cpu(), ref[rows]) < tol, (i, rel_err(got[rows].cpu(), ref[rows]))
        with_images += sum(grp.image_plan is not None for grp in batch.groups)
        cache.attention(0, batch, q, k, v, SCALE)
        cache.end_step(batch)
    cache.check_invariants()
    return with_images


def prefill(cache, g, dtype=torch.float32):
    seqs = [cache.admit(prompt(i, a, n, total + 64)) for i, (a, n, total) in enumerate(SHAPES)]
    lengths = [total for _, _, total in SHAPES]
    batch = cache.begin_step(seqs, lengths)
    cache.attention(0, batch, *step_qkv(sum(lengths), g, cache.device, dtype), SCALE)
    cache.end_step(batch)
    return seqs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("text", "image"), PAIRS)
def test_decode_reads_both_pools(text, image, device):
    cache = image_cache(text, image, device)
    g = torch.Generator().manual_seed(1)
    seqs = prefill(cache, g)
    image_pages = [sum(cache.is_image_page(p) for p in s.page_ids[: s.ring_start // P]) for s in seqs]
    text_pages = [s.ring_start // P - n for s, n in zip(seqs, image_pages, strict=True)]
    assert image_pages == [3, 0, 2, 0] and text_pages == [2, 1, 2, 0]
    assert check(cache, seqs, 1, steps=3, g=g, tol=2e-5) == 3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits", [2, 3])
def test_split_kv_in_both_passes(splits, device):
    """Forced splits in the text and the image pass (some splits empty), with sinks on: the first page
    of the first sequence is an image page and has a sink too."""
    cache = image_cache("int4", "fp8_e4m3", device, sinks=True)
    g = torch.Generator().manual_seed(2)
    seqs = prefill(cache, g)
    assert cache.is_image_page(seqs[0].page_ids[0]) and seqs[0].page_ids[0] in cache.sinks.of_page
    assert check(cache, seqs, 1, steps=2, g=g, tol=2e-5, splits=splits) == 2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("text", "image"), [("int4", "bf16"), ("fp8_e4m3", "int4")])
def test_extend_chunks_over_a_cached_image_span(text, image, device):
    """Prefill chunks (causal among themselves) in a batch; then a request whose image prefix comes from
    the tree extends a chunk that sees the whole cached image span (cold image pages, empty ring)."""
    cache = image_cache(text, image, device)
    g = torch.Generator().manual_seed(3)
    seqs = prefill(cache, g)
    assert check(cache, seqs, 7, steps=2, g=g, tol=2e-5) == 2
    tokens = seqs[0].token_ids[:64]
    for s in seqs:
        cache.finish(s)
    again = cache.admit([*tokens, *range(7000, 7064)])
    assert again.cached_tokens == 64 and again.ring_start == 64
    assert [cache.is_image_page(p) for p in again.page_ids[:4]] == [True, True, True, False]
    assert check(cache, [again], 20, steps=1, g=g, tol=2e-5) == 1
    cache.finish(again)
    cache.check_invariants()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("text", "image"), [("int4", "bf16"), ("fp8_e4m3", "int4")])
def test_bfloat16_compute_and_8_token_pages(text, image, device):
    cache = image_cache(text, image, device, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    seqs = prefill(cache, g, torch.bfloat16)
    assert check(cache, seqs, 1, steps=2, g=g, tol=1.5e-2, dtype=torch.bfloat16) == 2
    cache = image_cache(text, image, device, page=8)  # cold tiles decoded per element
    seqs = prefill(cache, g)
    assert check(cache, seqs, 1, steps=1, g=g, tol=2e-5) == 1


def test_text_only_group_is_one_pass():
    """A group without image pages keeps the single pass: no image table (so a decode step of it fits the
    whole-step graph's static step), no image plan, the output written directly."""
    cache = image_cache("int4", "bf16", DEVICES[0])
    g = torch.Generator().manual_seed(5)
    seq = cache.admit(list(range(1, 80)))
    batch = cache.begin_step([seq], [60])
    assert batch.groups[0].image_table is None and batch.groups[0].image_plan is None
    cache.attention(0, batch, *step_qkv(60, g, cache.device, torch.float32), SCALE)
    cache.end_step(batch)
    assert check(cache, [seq], 1, steps=1, g=g, tol=2e-5) == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("text", "image"), PAIRS)
def test_triton_store_writes_each_pool_like_torch(text, image, device):
    """Two caches, one storing through the torch path and one through the Triton page quantize: every
    part of every page of both pools, the sink pages and the ring are byte-identical after each step."""
    caches = [image_cache(text, image, device, sinks=True) for _ in range(2)]
    g = torch.Generator().manual_seed(6)
    seqs = [[c.admit(prompt(i, a, n, t + 64)) for i, (a, n, t) in enumerate(SHAPES)] for c in caches]
    plan = [[t for _, _, t in SHAPES], [9] * 4, [1] * 4]
    completed = 0
    for n_step in plan:
        T = sum(n_step)
        q = torch.randn(T, HQ, D, generator=g).to(device)
        k, v = (tricky(T, g, torch.float32).to(device) for _ in range(2))
        for c, s, kernels in zip(caches, seqs, (False, True), strict=True):
            batch = c.begin_step(s, n_step)
            if kernels and batch.write.image_split is not None:
                completed += batch.write.image_split[1].numel()
            c.attention(0, batch, q, k, v, SCALE, kernels=kernels)
            c.end_step(batch)
        ref, got = caches
        for a, b in ((ref.pool, got.pool), (ref.image_pool, got.image_pool)):
            for kind in ("k", "v"):
                for name, buf in getattr(a, kind)[0].items():
                    assert same_bytes(buf, getattr(b, kind)[0][name]), (kind, name)
        for kind in ("k", "v"):
            assert ref.nonfinite[kind] == got.nonfinite[kind] and ref.absmax[kind] == got.absmax[kind]
        assert same_bytes(ref.sinks.k, got.sinks.k) and same_bytes(ref.ring.k, got.ring.k)
        assert same_bytes(ref.sinks.v, got.sinks.v) and same_bytes(ref.ring.v, got.ring.v)
    assert completed == 5  # the prefill completes 3 image pages of the first prompt, 2 of the third
    for c in caches:
        c.check_invariants()
