"""Triton attention kernels (under TRITON_INTERPRET=1 on CPU, natively on CUDA) against float64 dense
attention over what the cache stores: the codec's dequantized cold pages, the sink page and the ring.

Covers every codec, sinks on and off, cold-only (window 0) and ring-only sequences, mixed lengths and
padding in one batch, decode steps that cross page boundaries, prefill chunks (causal among the new
tokens) and forced split-KV with its log-sum-exp merge.
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_helpers import DEVICES, fill, kernel_attend, reference_attend
from radix_helpers import rel_err, small_cache

CODECS = ["fp32", "bf16", "fp8_e4m3", "fp8_e5m2", "int8", "int8_asym", "int4", "fp4_e2m1"]
# A layer of a precision plan may store keys and values in different codecs.
CODECS += ["int4/fp4_e2m1", "int8_asym/fp8_e4m3"]
HKV, HQ, D, P = 2, 6, 32, 16  # head_dim 32: fp4 values use 32-channel blocks
SCALE = 1 / math.sqrt(D)


def make_cache(
    codec: str,
    device: str,
    *,
    sinks: bool = False,
    window: int = 16,
    dtype=torch.float32,
    page: int = P,
    max_running: int = 4,
):
    return small_cache(
        num_layers=1,
        kv_heads=HKV,
        head_dim=D,
        page_size=page,
        recent_window=window,
        layer_codecs=[codec],
        ring_dtype=dtype,
        num_pages=48,
        max_running=max_running,
        sinks=sinks,
        device=device,
    )


def check_steps(cache, lengths, steps, n_new, tol, dtype=torch.float32, splits=None) -> int:
    """Fill sequences to ``lengths``, then run ``steps`` steps of ``n_new`` tokens each, comparing the
    kernels with the float64 reference before every store. Returns the outputs compared."""
    g = torch.Generator().manual_seed(len(lengths) * 7 + steps)
    seqs = fill(cache, lengths, g, HQ, SCALE)
    compared = 0
    for _ in range(steps):
        batch = cache.begin_step(seqs, [n_new] * len(seqs))
        T = n_new * len(seqs)
        dev = cache.device
        q = torch.randn(T, HQ, D, generator=g).to(device=dev, dtype=dtype)
        k = torch.randn(T, HKV, D, generator=g).to(device=dev, dtype=dtype)
        v = torch.randn(T, HKV, D, generator=g).to(device=dev, dtype=dtype)
        got = kernel_attend(cache, batch, q, k, v, SCALE, splits)
        ref = reference_attend(cache, batch, q, k, v, SCALE)
        assert got.dtype == dtype and torch.isfinite(got).all()
        for i in range(len(seqs)):
            rows = slice(i * n_new, (i + 1) * n_new)
            assert rel_err(got[rows].cpu(), ref[rows]) < tol, (i, rel_err(got[rows].cpu(), ref[rows]))
            compared += 1
        cache.attention(0, batch, q, k, v, SCALE)  # the torch path stores the step
        cache.end_step(batch)
    cache.check_invariants()
    return compared


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec", CODECS)
def test_decode_every_codec_mixed_lengths(codec, device):
    """Ring-only (5), one page + ring (37) and several pages (70, 101) in one padded batch; three decode
    steps, so 101 -> 104 crosses nothing and 37 -> 40 the ring, 70 -> 73 keeps its cold pages."""
    cache = make_cache(codec, device)
    assert check_steps(cache, [5, 37, 70, 101], steps=3, n_new=1, tol=2e-5) == 12


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec", ["fp8_e4m3", "int4", "fp4_e2m1"])
def test_decode_with_sinks(codec, device):
    cache = make_cache(codec, device, sinks=True)
    assert check_steps(cache, [9, 40, 95], steps=2, n_new=1, tol=2e-5) == 6


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec", ["fp8_e4m3", "int8"])
def test_cold_only_and_page_boundary(codec, device):
    """Window 0: lengths that are multiples of the page read cold pages only; the decode step that
    completes a page (63 -> 64) quantizes it, and the next step reads it back cold."""
    cache = make_cache(codec, device, window=0)
    assert check_steps(cache, [32, 63, 64], steps=2, n_new=1, tol=2e-5) == 6


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits", [2, 3])
def test_split_kv_merge(splits, device):
    """Forced splits: some splits of the shorter sequences have no cold page at all (empty partials)."""
    cache = make_cache("int4", device, sinks=True)
    assert check_steps(cache, [20, 90, 140], steps=2, n_new=1, tol=2e-5, splits=splits) == 6


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits", [1, 3, 128, 129, 300])
def test_merge_partials_in_blocks(splits, device):
    """The split merge reads at most `attend.MERGE_BLOCK_S` partials at once and rescales what earlier
    blocks added by the running maximum: equal to the log-sum-exp weighted mean over all splits, also
    where a whole first block (row 0) or scattered splits (row 1) saw no key (lse -inf), and where the
    largest lse comes last (row 2)."""
    from kvstrata.radix.kernels import attend

    g = torch.Generator().manual_seed(splits)
    out = torch.randn(3, 2, splits, D, generator=g)
    lse = torch.randn(3, 2, splits, generator=g) * 8
    if splits > 1:
        lse[0, :, : min(splits - 1, attend.MERGE_BLOCK_S)] = -math.inf
        lse[1, :, 1::3] = -math.inf
    lse[2, :, -1] = 60.0
    weights = torch.softmax(lse.double() * math.log(2), dim=2)
    ref = (out.double() * weights[..., None]).sum(2)
    got = attend.merge_partials(
        [attend.Partials(out.to(device), lse.to(device))], torch.empty(3, 2, D, device=device)
    )
    assert attend.merge_block(splits) == min(triton_pow2(splits), 128)
    assert torch.allclose(got.cpu().double(), ref, rtol=1e-5, atol=1e-5), (got.cpu() - ref).abs().max()


def triton_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec", ["bf16", "fp8_e4m3", "int4", "fp4_e2m1"])
def test_bfloat16_compute(codec, device):
    """BF16 q/k/v and ring (tensor cores in BF16, float32 accumulate): BF16-level error."""
    cache = make_cache(codec, device, dtype=torch.bfloat16)
    check_steps(cache, [12, 50, 99], steps=2, n_new=1, tol=1.5e-2, dtype=torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec", ["fp32", "fp8_e5m2", "int4"])
def test_extend_chunks_causal(codec, device):
    """Chunks of 7 and 20 new tokens (several query blocks) over cold + ring + themselves."""
    cache = make_cache(codec, device, sinks=codec == "int4")
    check_steps(cache, [3, 44, 80], steps=2, n_new=7, tol=2e-5)
    cache = make_cache(codec, device)
    check_steps(cache, [17, 66], steps=1, n_new=20, tol=2e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page", [16, 32, 64])
def test_int8_decode_in_page_aligned_tiles(page, device):
    """Symmetric int8 history decodes in 16-key tiles, each inside one page, the page's key scales on
    the decoded codes (`decode._int8_rows_tile`): pages of 16, 32 and 64 tokens (one, two and four
    tiles a page: the tile's page is found among its keys), forced splits, sinks."""
    cache = make_cache("int8", device, page=page, window=page, sinks=True)
    assert check_steps(cache, [9, 70, 300], steps=2, n_new=1, tol=2e-5, splits=2) == 6


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec", ["fp8_e4m3", "int4", "int8_asym"])
def test_pages_not_a_multiple_of_16(codec, device):
    """8-token pages: cold tiles cross pages and decode per element (decode and extend)."""
    cache = make_cache(codec, device, page=8, window=8)
    assert check_steps(cache, [5, 30, 61], steps=2, n_new=1, tol=2e-5) == 6
    cache = make_cache(codec, device, page=8, window=8)
    check_steps(cache, [9, 44], steps=1, n_new=7, tol=2e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("block_n", [None, 32])
@pytest.mark.parametrize("codec", ["bf16", "fp8_e4m3", "int8", "int8_asym/fp8_e4m3"])
def test_extend_8_and_16_bit_tiles(codec, block_n, prefetch, device, monkeypatch):
    """Extend over 8/16-bit codes reads cold keys in tiles across pages (codes straight into the dot,
    FP8 key exponents on the score columns, value scales on the weights): whole tiles unmasked, then
    the partial last one. 300 tokens span two full 128-key tiles and a partial one; ``block_n`` 32
    makes several full tiles of the shorter sequences too; ``prefetch`` loads page-table entries a
    tile ahead."""
    from kvstrata.radix.kernels import attend

    for kind in ("raw", "8bit"):
        monkeypatch.setitem(attend.EXTEND_LAUNCH[kind], "prefetch", prefetch)
        if block_n is not None:
            monkeypatch.setitem(attend.EXTEND_LAUNCH[kind], "block_n", block_n)
    cache = make_cache(codec, device, sinks=codec == "fp8_e4m3")
    assert check_steps(cache, [3, 70, 300], steps=1, n_new=9, tol=2e-5) == 3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("way", ["keys", "keys, prefetch", "blocks"])
@pytest.mark.parametrize("codec", ["bf16", "fp8_e5m2", "int8_asym", "int4/fp4_e2m1"])
def test_decode_cold_tiles_both_ways(codec, way, device, monkeypatch):
    """Decode with cold pages read by keys across pages (page-table entries loaded in the tile or a
    tile ahead) and by 16-token blocks, whichever the launch table picks for the codec, with split-KV
    (splits that start past the first page) and sinks."""
    from kvstrata.radix.kernels import attend

    for four_bit in (False, True):
        monkeypatch.setitem(attend.DECODE_LAUNCH[four_bit], "by_blocks", way == "blocks")
        monkeypatch.setitem(attend.DECODE_LAUNCH[four_bit], "prefetch", way == "keys, prefetch")
    monkeypatch.setitem(attend.DECODE_LAUNCH[True], "module", "decode")  # not decode4: its own tests
    cache = make_cache(codec, device, sinks=True)
    assert check_steps(cache, [9, 70, 300], steps=2, n_new=1, tol=2e-5, splits=2) == 6


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec", ["fp8_e4m3", "fp8_e5m2", "int8", "int8_asym/fp8_e4m3"])
def test_bfloat16_model_with_fp16_code_operands(codec, device, monkeypatch):
    """``f16_codes``: 8-bit codes enter the dots as FP16 (on CUDA; float32 under the interpreter),
    the scaled value weights normalised by the tile's largest value scale. Decode with splits and
    sinks, and extend (partial last tiles): BF16-level error."""
    from kvstrata.radix.kernels import attend

    for table, key in ((attend.DECODE_LAUNCH, False), (attend.EXTEND_LAUNCH, "8bit")):
        monkeypatch.setitem(table[key], "f16_codes", True)
    cache = make_cache(codec, device, dtype=torch.bfloat16, sinks=True)
    check_steps(cache, [12, 50, 99], steps=2, n_new=1, tol=1.5e-2, dtype=torch.bfloat16, splits=2)
    cache = make_cache(codec, device, dtype=torch.bfloat16)
    check_steps(cache, [30, 70], steps=1, n_new=9, tol=1.5e-2, dtype=torch.bfloat16)


def _history_and_fresh_prompts(device, dtype, seed: int):
    """An fp8 cache with sinks holding two 40-token sequences with history and three fresh 40-token
    prompts admitted; the tolerance for ``dtype`` and the generator for q/k/v."""
    tol = 2e-5 if dtype == torch.float32 else 1.5e-2
    g = torch.Generator().manual_seed(seed)
    cache = make_cache("fp8_e4m3", device, sinks=True, dtype=dtype, max_running=5)
    old = fill(cache, [40, 40], g, HQ, SCALE)
    fresh = [cache.admit(list(range(5000 * i, 5000 * i + 40))) for i in range(1, 4)]
    return tol, g, cache, old, fresh


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompts_without_history_take_causal_sdpa(device, dtype):
    """Fresh prompts (no cold page, ring row or sink) in groups of 20 and 7 new tokens go through
    torch SDPA (`prompt_only`); the same groups through the kernel, and a group where one sequence
    has history (kernel only), agree with the float64 reference."""
    from kvstrata.radix.kernels import attend

    tol, g, cache, old, fresh = _history_and_fresh_prompts(device, dtype, seed=5)
    for seqs, n_new, want in (
        (fresh, [20, 20, 7], [True, True]),
        ([*fresh[:2], old[0]], [20, 20, 20], [False]),
    ):
        batch = cache.begin_step(seqs, n_new)
        assert [attend.prompt_only(grp) for grp in batch.groups] == want
        T = sum(n_new)
        q, k, v = (torch.randn(T, n, D, generator=g).to(cache.device, dtype) for n in (HQ, HKV, HKV))
        ref = reference_attend(cache, batch, q, k, v, SCALE)
        got = kernel_attend(cache, batch, q, k, v, SCALE)
        by_kernel = kernel_attend(cache, batch, q, k, v, SCALE, splits=1)  # attend_group per group
        assert got.dtype == dtype
        assert rel_err(got.cpu(), ref) < tol and rel_err(by_kernel.cpu(), ref) < tol
        cache.cancel_step(batch)
    cache.check_invariants()


def _both_backends(cache, batch, q, k, v) -> list[torch.Tensor]:
    from kvstrata.radix import attention as torch_backend

    by_torch = torch_backend.attend(0, batch, q, k, v, SCALE, cache.pool, cache.ring, cache.sinks, 2)
    return [kernel_attend(cache, batch, q, k, v, SCALE), by_torch]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_groups_in_one_run_are_sliced_not_gathered(device, dtype):
    """Groups are runs of adjacent sequences with equal new-token counts, so each reads q/k/v as a slice
    (``span``) and writes its slice of the output in place. Steps of fresh prompts (SDPA), of equal
    lengths apart (two groups), of a continuation over history (the kernel), and of a prompt, a decode
    and a continuation (kernel groups at row offsets; q/k/v not contiguous): equal to the float64
    reference, and bit-equal to the same step with every group gathered (``span`` None, the rows
    gathered and scattered), in both backends (Triton and torch)."""
    tol, g, cache, old, fresh = _history_and_fresh_prompts(device, dtype, seed=7)
    for seqs, n_new, spans, heads_major in (
        (fresh, [20, 20, 7], [(0, 40), (40, 47)], False),  # whole prompts then a partial one
        (fresh, [20, 7, 20], [(0, 20), (20, 27), (27, 47)], False),  # equal lengths apart: two groups
        ([old[0], *fresh[:2]], [9, 20, 20], [(0, 9), (9, 49)], False),  # a continuation, then prompts
        ([fresh[2], *old], [20, 1, 9], [(0, 20), (20, 21), (21, 30)], True),  # kernel groups at offsets
    ):
        batch = cache.begin_step(seqs, n_new)
        assert [grp.span for grp in batch.groups] == spans
        T = sum(n_new)
        # heads_major: q/k/v stored [heads, T, D] and viewed [T, heads, D], so their rows are not contiguous
        q, k, v = (
            torch.randn(n, T, D, generator=g).to(cache.device, dtype).transpose(0, 1)
            if heads_major
            else torch.randn(T, n, D, generator=g).to(cache.device, dtype)
            for n in (HQ, HKV, HKV)
        )
        for grp in batch.groups:  # a run is read as a view of q (no copy)
            if grp.span is not None:
                assert grp.take(q).data_ptr() == q[grp.span[0]].data_ptr()
        ref = reference_attend(cache, batch, q, k, v, SCALE)
        sliced = _both_backends(cache, batch, q, k, v)
        for grp in batch.groups:
            grp.span = None
        gathered = _both_backends(cache, batch, q, k, v)
        for got, again in zip(sliced, gathered, strict=True):
            assert rel_err(got.cpu(), ref) < tol
            assert torch.equal(got, again)
        cache.cancel_step(batch)
    cache.check_invariants()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("prefetch", [False, True, "late blocks first"])
@pytest.mark.parametrize("block_n", [None, 16])
@pytest.mark.parametrize("codec", ["fp32", "bf16", "fp8_e4m3", "fp8_e5m2", "int8_asym/fp8_e4m3"])
def test_flash_extend_kernel(codec, block_n, prefetch, device, monkeypatch):
    """``module`` "extend" (`kvstrata.radix.kernels.extend`): chunks of 9 and 20 tokens (several query
    blocks; with 16-key tiles new-token tiles both before and on each block's diagonal) over whole and
    partial cold tiles, sinks and ring, with and without forced splits; BF16 with FP16 code operands;
    with ``prefetch``, also with ``late_blocks_first`` (query blocks started in reverse; 16-row blocks,
    two to four a sequence). int8 keys are not its layout: they keep the attend kernel."""
    from kvstrata.radix.kernels import attend, extend

    launched = []
    kernel = extend._flash_extend_kernel

    class Counted:
        def __getitem__(self, grid):
            launched.append(grid)
            return kernel[grid]

    late = prefetch == "late blocks first"
    options = extend.extend_options
    seen_late = set()

    def recorded(*args):
        got = options(*args)
        seen_late.add(got["LATE_FIRST"])
        return got

    monkeypatch.setattr(extend, "_flash_extend_kernel", Counted())
    monkeypatch.setattr(extend, "extend_options", recorded)
    for kind in ("raw", "8bit"):
        monkeypatch.setitem(attend.EXTEND_LAUNCH[kind], "module", "extend")
        monkeypatch.setitem(attend.EXTEND_LAUNCH[kind], "prefetch", bool(prefetch))
        monkeypatch.setitem(attend.EXTEND_LAUNCH[kind], "late_blocks_first", late)
        if late:  # 16-row query blocks: two to four a sequence
            monkeypatch.setitem(attend.EXTEND_LAUNCH[kind], "block_m", 16)
        if block_n is not None:
            monkeypatch.setitem(attend.EXTEND_LAUNCH[kind], "block_n", block_n)
    cache = make_cache(codec, device, sinks=True)
    assert check_steps(cache, [3, 70, 300], steps=1, n_new=9, tol=2e-5) == 3
    cache = make_cache(codec, device)
    assert check_steps(cache, [17, 150], steps=1, n_new=20, tol=2e-5, splits=2) == 2
    cache = make_cache(codec, device, dtype=torch.bfloat16)
    assert check_steps(cache, [30, 140], steps=1, n_new=9, tol=1.5e-2, dtype=torch.bfloat16) == 2
    assert bool(launched) == ("int8" not in codec)
    assert seen_late == ({late} if launched else set())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec", ["fp8_e4m3", "int8", "int4", "fp4_e2m1", "int4/fp4_e2m1"])
def test_extend_dequantized_first(codec, device, monkeypatch):
    """``dequant_bytes``: an extend pass of several query blocks over coded history dequantizes its
    cold pages (padding included) to the model dtype and the flash kernel reads them as raw history
    through the identity page table; with sinks and forced splits, float32 and BF16 models. A cap
    below the pages' bytes, or one query block a sequence, keeps the codes (4-bit layers: by blocks, the
    flash kernel not being theirs)."""
    from kvstrata.radix.kernels import attend

    made = []
    parts = attend.dequantized_parts

    def counted(pool, layer, table, heads, dtype):
        made.append(table.numel())
        return parts(pool, layer, table, heads, dtype)

    monkeypatch.setattr(attend, "dequantized_parts", counted)
    launch_of = attend.pass_launch
    dequantizing = []

    def recorded(g, *args, **kwargs):
        launch = launch_of(g, *args, **kwargs)
        if launch.dequant:  # the identity table's plan keeps the plan's device lengths: no new upload
            dequantizing.append(launch)
            assert launch.g.lengths is not None and launch.g.page_table is not g.page_table
            assert torch.equal(launch.g.kernel_lengths, g.kernel_lengths)
        return launch

    monkeypatch.setattr(attend, "pass_launch", recorded)
    for kind in ("8bit", "4bit"):
        entry = dict(attend.EXTEND_LAUNCH[kind], module="extend", block_m=16, block_n=16)  # 4-bit by blocks
        monkeypatch.setitem(attend.EXTEND_LAUNCH, kind, dict(entry, dequant_bytes=1 << 30))
    cache = make_cache(codec, device, sinks=True)
    assert check_steps(cache, [3, 70, 300], steps=1, n_new=9, tol=2e-5) == 3
    # A float32 model's extend on CUDA takes `attend.EXTEND_FLOAT32` (this module's kernel, which reads
    # the codes), so only the BF16 model dequantizes there.
    expected = 1 if device == "cuda" else 2
    assert len(made) == expected - 1 and len(dequantizing) == expected - 1
    cache = make_cache(codec, device, dtype=torch.bfloat16)
    assert check_steps(cache, [17, 150], steps=1, n_new=20, tol=1.5e-2, dtype=torch.bfloat16, splits=2) == 2
    assert len(made) == expected and len(dequantizing) == expected
    monkeypatch.setitem(attend.EXTEND_LAUNCH["8bit"], "dequant_bytes", 1024)
    monkeypatch.setitem(attend.EXTEND_LAUNCH["4bit"], "dequant_bytes", 1024)
    cache = make_cache(codec, device)
    assert check_steps(cache, [40, 150], steps=1, n_new=9, tol=2e-5) == 2
    monkeypatch.setitem(attend.EXTEND_LAUNCH["8bit"], "block_m", 128)
    monkeypatch.setitem(attend.EXTEND_LAUNCH["4bit"], "block_m", 128)
    cache = make_cache(codec, device)
    assert check_steps(cache, [40, 150], steps=1, n_new=9, tol=2e-5) == 2
    assert len(made) == expected
