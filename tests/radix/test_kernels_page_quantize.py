"""Triton page quantize (under TRITON_INTERPRET=1 on CPU, natively on CUDA): the pages a step completes,
encoded from ring rows + new rows, are byte-identical to the torch codecs' pages, for every codec.

Two caches run the same steps, one storing through the torch path, one through the kernel; after each
step every part of every page, the sink pages, the ring and the NaN/Inf and absmax accounting are equal.
The data mixes Gaussian rows, rows with outlier channels, exact rounding ties, all-zero and constant
groups, and NaN/Inf elements.
"""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEVICES
from radix_helpers import small_cache


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality; NaN in raw float storage only needs to be NaN in both (CUDA casts may pick
    another NaN pattern than the CPU)."""
    if a.dtype.is_floating_point and a.element_size() > 1:
        nan = a.isnan()
        if not torch.equal(nan, b.isnan()):
            return False
        a, b = a.masked_fill(nan, 0), b.masked_fill(nan, 0)
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


CODECS = ["fp32", "bf16", "fp8_e4m3", "fp8_e5m2", "int8", "int8_asym", "int4", "fp4_e2m1"]
# A layer of a precision plan may store keys and values in different codecs.
CODECS += ["int4/fp4_e2m1", "int8_asym/fp8_e4m3"]
HKV, HQ, D, P = 2, 4, 32, 16


def tricky(n: int, g: torch.Generator, dtype: torch.dtype, d: int = D) -> torch.Tensor:
    x = torch.randn(n, HKV, d, generator=g) * torch.exp2(torch.randint(-6, 7, (n, HKV, 1), generator=g))
    x[::5, :, 3] *= 40.0  # outlier channel
    x[1::7] = torch.randint(-8, 9, (HKV, d), generator=g) * 0.25  # exact ties of several grids
    x[2::11] = 0.0  # all-zero tokens
    x[3::13] = 1.5  # constant tokens
    x[4::17, 0, 5] = float("nan")
    x[4::19, 1, 7] = float("inf")
    return x.to(dtype)


def run_both(
    codec: str,
    device: str,
    lengths: list[int],
    steps: int,
    n_new: int,
    sinks: bool,
    dtype,
    head_dim: int = D,
    page_size: int = P,
    window: int = 16,
):
    caches = [
        small_cache(
            num_layers=1,
            kv_heads=HKV,
            head_dim=head_dim,
            page_size=page_size,
            recent_window=window,
            layer_codecs=[codec],
            ring_dtype=dtype,
            num_pages=40,
            max_running=4,
            sinks=sinks,
            device=device,
        )
        for _ in range(2)
    ]
    g = torch.Generator().manual_seed(sum(lengths) + steps)
    seqs = [
        [c.admit(list(range(1000 * i, 1000 * i + n + 64))) for i, n in enumerate(lengths)] for c in caches
    ]
    plan = [lengths] + [[n_new] * len(lengths)] * steps
    pages = 0
    for n_step in plan:
        T = sum(n_step)
        q = torch.randn(T, HQ, head_dim, generator=g).to(device, dtype)
        k, v = (tricky(T, g, dtype, head_dim).to(device) for _ in range(2))
        for c, s, kernels in zip(caches, seqs, (False, True), strict=True):
            batch = c.begin_step(s, n_step)
            pages += batch.write.page_ids.numel() if kernels else 0
            c.attention(0, batch, q, k, v, 0.25, kernels=kernels)
            c.end_step(batch)
        ref, got = caches
        for kind in ("k", "v"):
            for name, buf in getattr(ref.pool, kind)[0].items():
                assert same_bytes(buf, getattr(got.pool, kind)[0][name]), (kind, name)
            assert ref.nonfinite[kind] == got.nonfinite[kind]
            assert ref.absmax[kind] == got.absmax[kind]
        if sinks:
            assert same_bytes(ref.sinks.k, got.sinks.k) and same_bytes(ref.sinks.v, got.sinks.v)
        assert same_bytes(ref.ring.k, got.ring.k) and same_bytes(ref.ring.v, got.ring.v)
    for c in caches:
        c.check_invariants()
    return pages


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec", CODECS)
def test_page_codes_equal_torch_codecs(codec, device):
    """Prefill (pages from new rows only), then decode steps that complete pages from ring rows + one
    new row, and chunks that straddle a page boundary."""
    pages = run_both(codec, device, [20, 47, 64], steps=2, n_new=9, sinks=False, dtype=torch.float32)
    assert pages >= 8
    pages = run_both(codec, device, [15, 31], steps=1, n_new=1, sinks=True, dtype=torch.float32)
    assert pages == 3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec", ["fp8_e4m3", "int4", "fp4_e2m1"])
def test_page_codes_equal_from_bfloat16_rows(codec, device):
    pages = run_both(codec, device, [40, 17], steps=2, n_new=8, sinks=True, dtype=torch.bfloat16)
    assert pages >= 4


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("codec", "head_dim", "page_size"),
    [("bf16", 80, 8), ("fp8_e4m3", 80, 16), ("int8", 96, 8), ("int8_asym", 48, 16), ("fp4_e2m1", 96, 16)],
)
def test_page_codes_equal_at_other_geometries(codec, head_dim, page_size, device):
    """Head dims that are not a power of two (the kernel's rows padded to the next one: the channel
    masks of its whole-row loads and stores) and pages smaller than the kernel's 16-row tile (the row
    masks), BF16 rows with sinks."""
    pages = run_both(
        codec, device, [40, 17], steps=2, n_new=8, sinks=True, dtype=torch.bfloat16, head_dim=head_dim,
        page_size=page_size,
    )  # fmt: skip
    assert pages >= 4


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("codec", "dtype", "window"),
    [
        ("fp8_e4m3", torch.float32, 16),
        ("int4", torch.float32, 0),
        ("bf16", torch.bfloat16, 0),
        ("fp4_e2m1", torch.bfloat16, 16),
    ],
)
def test_decode_ring_rows_in_the_encoder_launch(codec, dtype, window, device, monkeypatch):
    """Decode steps write their new rows into the ring in the page-quantize launch (`ring_rows_fused`),
    not by `write_ring` after it: over 40 steps the ring wraps (a page and ``window`` rows a sequence;
    at window 0 a token that completes its page stays out of the ring, and the next takes the row its
    page's first token left) while pages complete from ring rows, and pages, sinks and ring stay equal
    to the torch path's. Only the prefill step (several new rows a sequence) writes the ring apart."""
    from kvstrata.radix.kernels import page_quantize

    calls = []
    apart = page_quantize.write_ring
    monkeypatch.setattr(page_quantize, "write_ring", lambda *a: calls.append(a) or apart(*a))
    pages = run_both(codec, device, [5, 16, 33], steps=40, n_new=1, sinks=True, dtype=dtype, window=window)
    assert pages == 9
    assert len(calls) == 1


def test_ring_rows_fused_only_for_one_token_each_in_the_rings_dtype():
    """The launch writes the ring only in a step of one new token a sequence whose rows are in the
    ring's dtype (they copy as they are); a prefill step, or BF16 rows over a float32 ring, keep
    `write_ring` after it."""
    from kvstrata.radix.kernels.page_quantize import ring_rows_fused

    cache = small_cache(
        num_layers=1,
        kv_heads=HKV,
        head_dim=D,
        page_size=P,
        recent_window=0,
        layer_codecs=["bf16"],
        max_running=2,
    )
    seqs = [cache.admit(list(range(1000 * i, 1000 * i + 80))) for i in range(2)]
    for n_new in ([5, 3], [1, 1]):
        T = sum(n_new)
        batch = cache.begin_step(seqs, n_new)
        k = torch.randn(T, HKV, D)
        assert ring_rows_fused(batch, k, cache.ring, P) == (T == 2)
        assert not ring_rows_fused(batch, k.to(torch.bfloat16), cache.ring, P)
        cache.attention(0, batch, torch.randn(T, HQ, D), k, torch.randn(T, HKV, D), 0.25)
        cache.end_step(batch)
