"""The attention kernels' 4-bit decode functions (`kvstrata.quant.kernel_decode`), run through tiny
Triton kernels (under TRITON_INTERPRET=1 on CPU, natively on CUDA) against the codecs' torch decoding:
every byte value through the bit-built E2M1 and integer nibble conversions, and fp4 value rows with
their 32-channel E4M3 block scales at head_dims of one, three (padded to four) and four blocks.
"""

from __future__ import annotations

from pathlib import Path

import kernel_helpers  # first: sets TRITON_INTERPRET=1 on CPU before triton is imported
import pytest
import torch
import triton
import triton.language as tl

from kvstrata.quant.fp4 import _table
from kvstrata.quant.kernel_decode import e2m1_value, fp4_value_codes, fp8_pairs, int8_pairs, nibble_value
from kvstrata.quant.nibbles import unpack
from kvstrata.radix.kernels.decode import fp8_operand_scale, fp8_split


@triton.jit
def _nibbles_kernel(X, E2M1, INT):
    i = tl.arange(0, 256)
    b = tl.load(X + i).to(tl.int32)
    tl.store(E2M1 + 2 * i, e2m1_value(b & 15))
    tl.store(E2M1 + 2 * i + 1, e2m1_value(b >> 4))
    tl.store(INT + 2 * i, nibble_value(b & 15))
    tl.store(INT + 2 * i + 1, nibble_value(b >> 4))


@triton.jit
def _fp4_rows_kernel(CODES, SCALES, ROWS, OK, X0, X1, D: tl.constexpr, BLOCK_C: tl.constexpr):
    n = tl.arange(0, 8)
    row = tl.load(ROWS + n).to(tl.int64)
    ok = tl.load(OK + n) != 0
    x0, x1 = fp4_value_codes(CODES, SCALES, row, ok, D, BLOCK_C, tl.float32)
    at = n[:, None] * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    tl.store(X0 + at, x0)
    tl.store(X1 + at, x1)


@triton.jit
def _fp8_pairs_kernel(X, EVEN, ODD, E5M2: tl.constexpr, ASM: tl.constexpr):
    i = tl.program_id(0) * 1024 + tl.arange(0, 1024)
    even, odd = fp8_pairs(tl.load(X + i), E5M2, ASM, tl.float16 if ASM else tl.float32)
    tl.store(EVEN + i, even.to(tl.float32))
    tl.store(ODD + i, odd.to(tl.float32))


@triton.jit
def _int8_pairs_kernel(X, EVEN, ODD, ASM: tl.constexpr):
    i = tl.program_id(0) * 1024 + tl.arange(0, 1024)
    even, odd = int8_pairs(tl.load(X + i), ASM, tl.float16 if ASM else tl.float32)
    tl.store(EVEN + i, even.to(tl.float32))
    tl.store(ODD + i, odd.to(tl.float32))


@pytest.mark.parametrize("device", kernel_helpers.DEVICES)
def test_every_int8_pair_decodes_as_torch_does(device):
    """`kernel_decode.int8_pairs` (``int8_rows``' key and value codes) over all 65,536 16-bit elements:
    the low byte is the even channel's int8 code, the high byte the odd one's, each equal to its value
    in torch, exactly: on CUDA by the PTX (`INT8_PAIRS_ASM`: sign bits flipped, bytes under an FP16
    exponent, 1,152 taken off), else by the float32 path."""
    x = torch.arange(1 << 16, dtype=torch.int32).to(torch.uint16)
    even, odd = (torch.full((1 << 16,), 999.0, device=device) for _ in range(2))
    _int8_pairs_kernel[(64,)](x.to(device), even, odd, device == "cuda")
    as_bytes = x.view(torch.int8).view(-1, 2)  # little-endian: the low byte first
    for got, column in ((even, 0), (odd, 1)):
        assert torch.equal(got.cpu(), as_bytes[:, column].float())


@pytest.mark.parametrize("device", kernel_helpers.DEVICES)
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_every_fp8_pair_decodes_as_torch_does(dtype, device):
    """`kernel_decode.fp8_pairs` (``value_pairs``' value codes) over all 65,536 16-bit elements: the low
    byte is the even channel's FP8 code, the high byte the odd one's, each equal to torch's FP8 value:
    on CUDA by the PTX (`E4M3_PAIRS_ASM` / `E5M2_PAIRS_ASM`), NaNs and infinities included; else by the
    float32 path, finite codes only (Triton's interpreter converts FP8 NaN and infinity codes to finite
    numbers; the codecs saturate, so they never write those codes)."""
    x = torch.arange(1 << 16, dtype=torch.int32).to(torch.uint16)
    even, odd = (torch.full((1 << 16,), -1.0, device=device) for _ in range(2))
    _fp8_pairs_kernel[(64,)](x.to(device), even, odd, dtype == torch.float8_e5m2, device == "cuda")
    as_bytes = x.view(torch.uint8).view(-1, 2)  # little-endian: the low byte first
    for got, column in ((even, 0), (odd, 1)):
        want = as_bytes[:, column].contiguous().view(dtype).float()
        kept = torch.ones_like(want, dtype=torch.bool) if device == "cuda" else want.isfinite()
        assert kept.sum() >= (1 << 16) - (1 << 11)  # E5M2: 8 of 256 codes are infinite or NaN
        assert torch.allclose(got.cpu()[kept], want[kept], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("device", kernel_helpers.DEVICES)
def test_every_byte_decodes_as_the_codecs_do(device):
    """Both nibbles of all 256 bytes: E2M1 values equal to the fp4 codec's table (code 8, -0, equal
    to +0), integer codes equal to `nibbles.unpack`."""
    x = torch.arange(256, dtype=torch.uint8, device=device)
    e2m1 = torch.full((512,), float("nan"), device=device)
    ints = torch.full((512,), float("nan"), device=device)
    _nibbles_kernel[(1,)](x, e2m1, ints)
    codes = unpack(x.cpu())
    assert torch.equal(e2m1.cpu(), _table(torch.device("cpu"))[codes].float())
    assert torch.equal(ints.cpu(), codes.float())


@pytest.mark.parametrize("device", kernel_helpers.DEVICES)
@pytest.mark.parametrize("d", [32, 96, 128])
def test_fp4_value_rows_with_block_scales(d, device):
    """Rows gathered out of order, two of them masked (decode to 0), head_dim 96 padded to four
    16-byte groups: each channel is its E2M1 value times its 32-channel block's E4M3 scale."""
    g = torch.Generator().manual_seed(d)
    n_rows, block_c = 12, triton.next_power_of_2(d) // 2
    codes = torch.randint(0, 256, (n_rows, d // 2), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n_rows, d // 32, generator=g) * 8 + 2**-6).to(torch.float8_e4m3fn)
    rows = torch.tensor([3, 0, 11, 7, 7, 1, 5, 9])
    ok = torch.tensor([1, 1, 1, 0, 1, 1, 0, 1], dtype=torch.int32)
    out = [torch.full((8, block_c), float("nan"), device=device) for _ in range(2)]
    _fp4_rows_kernel[(1,)](
        codes.to(device), scales.view(torch.uint8).to(device), rows.to(device), ok.to(device),
        *out, D=d, BLOCK_C=block_c,
    )  # fmt: skip
    ref = _table(torch.device("cpu"))[unpack(codes)].float()
    ref = ref * scales.float().repeat_interleave(32, dim=1)
    ref = ref[rows] * ok[:, None]
    for half, got in enumerate(out):
        want = torch.zeros(8, block_c)
        want[:, : d // 2] = ref[:, half::2]
        assert torch.equal(got.cpu(), want), half


LAYOUTS = {"plain": {}, "swap_ab": dict(swap_ab=True), "halves": dict(halves=True)}
LAYOUTS["swap_ab, halves"] = dict(swap_ab=True, halves=True)
LAYOUTS["attend kernel"] = dict(module="attend")  # decode by `attend._attend_kernel` instead
LAYOUTS["tail by parts"] = dict(merged_tail=False)  # sink page, ring rows and new key in tiles of their own
_KEYS = (("swap_ab", False), ("halves", False), ("module", "decode"), ("merged_tail", True))
_KEYS += (("scaled_keys_by_blocks", False),)  # int8 keys through the decode module too
_KEYS += (("int8_rows", False),)  # int8 keys and values as the layout reads them (not `attend.INT8_DECODE`)


@pytest.mark.parametrize("device", kernel_helpers.DEVICES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("codec", ["fp32", "fp8_e4m3", "int8", "int8_asym/fp8_e4m3", "int4/fp4_e2m1"])
def test_decode_module_layouts(codec, layout, device, monkeypatch):
    """`kvstrata.radix.kernels.decode` (cold pages read by keys, every codec through the launch table's
    ``by_blocks`` off) in both orientations, scores ``q . k^T`` and scores ``k . q^T`` (``swap_ab``),
    with value codes in channel-pair order (``halves``), through the extend kernel (``module``), and
    with the sink page, ring rows and new key in tiles of their own instead of one run (``merged_tail``).
    32-key tiles: full and partial tiles, forced splits (some with no cold page) and sinks (the run's
    tiles then start in the sink page and cross into the ring)."""
    from test_kernels_attend import check_steps, make_cache

    from kvstrata.radix.kernels import attend

    for four_bit in (False, True):
        monkeypatch.setitem(attend.DECODE_LAUNCH[four_bit], "by_blocks", False)
        monkeypatch.setitem(attend.DECODE_LAUNCH[four_bit], "block_n", 32)
        for key, off in _KEYS:
            monkeypatch.setitem(attend.DECODE_LAUNCH[four_bit], key, LAYOUTS[layout].get(key, off))
    cache = make_cache(codec, device, sinks=True)
    assert check_steps(cache, [9, 70, 300], steps=2, n_new=1, tol=2e-5, splits=3) == 6


@pytest.mark.parametrize("device", kernel_helpers.DEVICES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("codec", ["bf16", "fp8_e4m3", "fp8_e5m2", "int8_asym"])
def test_decode_module_bfloat16(codec, layout, device, monkeypatch):
    """BF16 model (8-bit codes as FP16 operands on CUDA), every layout, without splits (the kernel
    writes the output directly): BF16-level error."""
    from test_kernels_attend import check_steps, make_cache

    from kvstrata.radix.kernels import attend

    for key, off in _KEYS:
        monkeypatch.setitem(attend.DECODE_LAUNCH[False], key, LAYOUTS[layout].get(key, off))
    monkeypatch.setitem(attend.DECODE_LAUNCH[False], "f16_codes", True)
    cache = make_cache(codec, device, dtype=torch.bfloat16)
    check_steps(cache, [12, 50, 99], steps=2, n_new=1, tol=1.5e-2, dtype=torch.bfloat16)


def test_split_counts_keep_min_pages():
    """Split-KV counts of the decode launch table: every split reads at least ``min_pages`` cold pages
    and the launch stays near its ``programs`` target. At the 8B geometry (8 KV heads) and 32K
    context (2,040 cold pages): B=1 gets 63 splits of 33 pages, B=64 two, B=256 none."""
    from kvstrata.radix.kernels.attend import DECODE_LAUNCH, _num_splits

    launch = DECODE_LAUNCH[False]
    target, least = launch["programs"], launch["min_pages"]
    for programs in (1, 3, 8, 64, 512, 2048):
        for pages in (0, 1, least, 2 * least, 2040, 8191):
            splits = _num_splits(programs, pages, target, least)
            assert splits == 1 or (pages // splits >= least and programs * splits <= target + programs)
    assert [_num_splits(b * 8, 2040, target, least) for b in (1, 64, 256)] == [2040 // least, 2, 1]


def test_few_programs_split_below_min_pages():
    """`attend.split_floor`: a decode launch whose splits of ``min_pages`` leave it under
    ``fill_programs`` programs splits further, down to ``fill_pages``. 8B layer (8 KV heads), B=1 at 4K
    (247 cold pages): 31 splits of 8 pages (248 programs) where 32 pages gave 7 and 16-page 4-bit
    splits 15; B=1 at 32K and B=16 at 4K keep ``min_pages``; the default model's 3 KV heads at 32K
    split 8-bit history in 23 pages (88 splits, 264 programs) and 4-bit in its 16 (381 programs)."""
    from kvstrata.radix.kernels.attend import DECODE_LAUNCH, cold_splits, split_floor, tile_pages

    for four_bit in (False, True):
        launch = DECODE_LAUNCH[four_bit]
        least, fill, floor = launch["min_pages"], launch["fill_programs"], launch["fill_pages"]
        assert split_floor(8, 247, launch) == floor == 8
        assert split_floor(8, 2040, launch) == least
        assert split_floor(16 * 8, 247, launch) == least
        for programs in (1, 3, 8, 24, 64, 512):
            for pages in (0, 1, 7, 8, 17, 100, 247, 2040, 8191):
                got = split_floor(programs, pages, launch)
                assert floor <= got <= least
                assert got == least or programs * (pages // least) < fill
        whole = tile_pages(launch["blocks"] * 16 if four_bit else launch["block_n"], 16)
        assert cold_splits(8, 247, launch, whole) == (31, 8)
    assert split_floor(3, 2040, DECODE_LAUNCH[False]) == 23
    assert split_floor(3, 2040, DECODE_LAUNCH[True]) == 16


def test_splits_hold_whole_tiles():
    """Pages a split round down to whole 128-key tiles (8 pages of 16 tokens) when the launch stays
    within its programs target and each split keeps ``min_pages``: B=1 at 32K (2,040 cold pages) reads
    64 splits of 32 pages (4 tiles each) instead of 63 of 33 (5 tiles, the last for one page); B=64
    keeps its 2 splits (a third would pass the target); a split that is already whole tiles stays."""
    from kvstrata.radix.kernels.attend import DECODE_LAUNCH, _num_splits, _whole_tiles

    launch = DECODE_LAUNCH[False]
    target, least = launch["programs"], launch["min_pages"]
    tile_pages = launch["block_n"] // 16
    for batch, want in ((1, (64, 32)), (64, (2, 1020)), (256, (1, 2040))):
        programs = batch * 8
        splits = _num_splits(programs, 2040, target, least)
        got = _whole_tiles(programs, 2040, splits, tile_pages, target, least)
        assert got == want, batch
        assert got[0] * got[1] >= 2040 and programs * got[0] <= max(target, programs)
    assert _whole_tiles(8, 512, 8, tile_pages, target, least) == (8, 64)
    assert _whole_tiles(8, 2040, 63, 0, target, least) == (63, 33)  # tiles of part of a page
    assert _whole_tiles(8, 2040, 63, tile_pages, target, 33) == (63, 33)  # min_pages kept


@pytest.mark.parametrize("device", kernel_helpers.DEVICES)
@pytest.mark.parametrize("codec", ["int8", "int8_asym/fp8_e4m3", "fp8_e4m3"])
def test_scaled_keys_by_blocks(codec, device, monkeypatch):
    """``scaled_keys_by_blocks``: int8 keys (per-channel scales) read by 16-token blocks while FP8
    keys in the same launch table entry stay read by keys; both against the float64 reference. (With
    ``int8_rows`` on, the shipped entry, int8 keys and values take `attend.INT8_DECODE` instead.)"""
    from test_kernels_attend import check_steps, make_cache

    from kvstrata.radix.kernels import attend

    monkeypatch.setitem(attend.DECODE_LAUNCH[False], "scaled_keys_by_blocks", True)
    monkeypatch.setitem(attend.DECODE_LAUNCH[False], "int8_rows", False)
    cache = make_cache(codec, device, sinks=True)
    assert check_steps(cache, [9, 70, 300], steps=2, n_new=1, tol=2e-5, splits=3) == 6


def launches_made(monkeypatch) -> list:
    """The `attend.PassLaunch` of every kernel pass launched from now on: their split counts, whether
    their kernel merges its splits itself or `attend.merge_partials` does."""
    from kvstrata.radix.kernels import attend

    made = []
    launch = attend.pass_launch

    def recorded(*args):
        made.append(launch(*args))
        return made[-1]

    monkeypatch.setattr(attend, "pass_launch", recorded)
    return made


@pytest.mark.parametrize("device", kernel_helpers.DEVICES)
@pytest.mark.parametrize("apart", [True, False])
@pytest.mark.parametrize("codec", ["fp8_e4m3", "int4/fp4_e2m1"])
def test_heuristic_splits_with_the_tail_apart(codec, apart, device, monkeypatch):
    """The split heuristic (no forced count: splits of 2 pages, a target the launch stays within)
    with the sink page, ring rows and new key in a split of their own (``tail_apart``: one more split,
    past every cold page) or in the last cold split, by keys and by blocks."""
    from test_kernels_attend import check_steps, make_cache

    from kvstrata.radix.kernels import attend

    for four_bit in (False, True):
        for key, value in (("min_pages", 2), ("programs", 4096), ("tail_apart", apart)):
            monkeypatch.setitem(attend.DECODE_LAUNCH[four_bit], key, value)
    made = launches_made(monkeypatch)
    cache = make_cache(codec, device, sinks=True)
    assert check_steps(cache, [9, 70, 300], steps=2, n_new=1, tol=2e-5) == 6
    assert made and max(m.splits for m in made) > 2


# Pass 9's FP8 options of the decode module (`decode.fp8_options`): key and value codes converted by PTX
# (CUDA only; the interpreter runs the plain conversion) and the lazy rescale of the softmax state.
PASS9 = {
    "plain": {},
    "lazy rescale": dict(lazy_rescale=True),
    "values asm": dict(codes_asm="values"),
    "codes asm": dict(codes_asm=True),
    "both": dict(lazy_rescale=True, codes_asm=True),
    # ``fp8_dot`` (`decode._fp8_dot_tile`): q.K^T on FP8 operands (q split in two), P.V too (True)
    "fp8 dot keys": dict(fp8_dot="keys"),
    "fp8 dot": dict(fp8_dot=True),
    "fp8 dot, lazy rescale": dict(fp8_dot=True, lazy_rescale=True),
    "fp8 dot, swap_ab, 4 warps": dict(fp8_dot=True, swap_ab=True, num_warps=4, block_n=64),
    "fp8 dot keys, swap_ab, 4 warps": dict(fp8_dot="keys", swap_ab=True, num_warps=4, block_n=64),
    # pass 13 (`decode._fp8_pairs_tile`): codes as uint16 channel pairs
    "value pairs": dict(value_pairs=True),
    "keys as rows": dict(keys_as_rows=True),
}


@pytest.mark.parametrize("device", kernel_helpers.DEVICES)
@pytest.mark.parametrize("options", list(PASS9))
@pytest.mark.parametrize("codec", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_value_scales_far_apart(codec, options, device, monkeypatch):
    """BF16 model, FP8 values whose per-token scales span 2**-60 to 2**40 with some at the all-zero
    tokens' 2**-127, then all at 2**-127 (the scales join the softmax exponent, clamped at 2**-100,
    so the softmax sum stays finite): the decode kernel (unsplit and 3 forced splits) finite and within
    BF16-level error of the float64 reference, with each of pass 9's options (the far-apart scales
    move the lazy rescale's running max on many tiles, the equal ones on the first only)."""
    from radix_helpers import rel_err
    from test_kernels_attend import HQ, SCALE, make_cache

    from kvstrata.radix.kernels import attend

    for key, value in {"block_n": 32, "keys_as_rows": False, **PASS9[options]}.items():
        monkeypatch.setitem(attend.DECODE_LAUNCH[False], key, value)
    cache = make_cache(codec, device, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(11)
    seqs = kernel_helpers.fill(cache, [40, 90, 200], g, HQ, SCALE)
    exp = cache.pool.v[0]["scale_exp"]
    spread = torch.randint(127 - 60, 127 + 41, exp.shape, generator=g)
    spread[torch.rand(exp.shape, generator=g) < 0.1] = 0
    batch = cache.begin_step(seqs, [1] * len(seqs))
    hkv, d = cache.cfg.kv_heads, cache.cfg.head_dim
    q, k, v = (torch.randn(len(seqs), n, d, generator=g).to(device, torch.bfloat16) for n in (HQ, hkv, hkv))
    for exponents in (spread, torch.zeros_like(spread)):
        exp.copy_(exponents.to(exp.dtype))
        ref = kernel_helpers.reference_attend(cache, batch, q, k, v, SCALE)
        for splits in (None, 3):
            got = kernel_helpers.kernel_attend(cache, batch, q, k, v, SCALE, splits)
            assert torch.isfinite(got).all()
            assert rel_err(got.cpu(), ref) < 1.5e-2, splits


# Pass 8's launch shapes of the 8/16-bit decode entry (`attention_sweep.DECODE`): fewer warps a
# program, 16- to 64-key tiles, value codes in channel pairs, register caps, larger programs targets.
FEW_WARPS = {
    "1 warp, 32 keys": dict(num_warps=1, block_n=32, programs=4096, maxnreg=None),
    "1 warp, 32 keys, halves": dict(num_warps=1, block_n=32, programs=4096, maxnreg=None, halves=True),
    "1 warp, 32 keys, 200 registers": dict(num_warps=1, block_n=32, programs=5120, maxnreg=200),
    "2 warps, 64 keys, 200 registers": dict(num_warps=2, block_n=64, programs=2560, maxnreg=200),
    "1 warp, 16 keys, 128 registers": dict(num_warps=1, block_n=16, programs=8192, maxnreg=128),
    # Pass 17: the tail's ring row ids a tile ahead (16-key tiles: the sinks, ring and new key in 2-3).
    "1 warp, 16 keys, ring ahead": dict(num_warps=1, block_n=16, programs=8192, maxnreg=128, ring_ahead=True),
}


@pytest.mark.parametrize("device", kernel_helpers.DEVICES)
@pytest.mark.parametrize("shape", list(FEW_WARPS))
@pytest.mark.parametrize("codec", ["fp8_e4m3", "bf16"])
def test_decode_few_warps(codec, shape, device, monkeypatch):
    """BF16 model, FP8 history (FP16 operands on CUDA) and BF16 history (the launch entry they share),
    sinks on, each shape of `FEW_WARPS` with the split heuristic (splits of 2 pages or more, the tail
    in a split of its own) and with 3 forced splits: BF16-level error against the float64 reference."""
    from test_kernels_attend import check_steps, make_cache

    from kvstrata.radix.kernels import attend

    launch = dict(FEW_WARPS[shape], min_pages=2, tail_apart=True, f16_codes=True)
    for key, value in launch.items():
        monkeypatch.setitem(attend.DECODE_LAUNCH[False], key, value)
    made = launches_made(monkeypatch)
    for splits in (None, 3):
        cache = make_cache(codec, device, sinks=True, dtype=torch.bfloat16)
        check_steps(cache, [9, 70, 300], steps=2, n_new=1, tol=1.5e-2, dtype=torch.bfloat16, splits=splits)
    assert max(m.splits for m in made) > 3


@pytest.mark.parametrize("device", kernel_helpers.DEVICES)
@pytest.mark.parametrize("floats", [2048, 64])
@pytest.mark.parametrize("codec", ["fp8_e4m3", "bf16", "int4", "fp4_e2m1"])
def test_decode_merges_its_own_splits(codec, floats, device, monkeypatch):
    """The decode kernels merging their own splits (launch key ``merge_reads``, `attend.merge_if_last`:
    the last program of a sequence and KV head merges them), 3 and 7 forced splits and the heuristic's,
    sinks on, mixed lengths (the ring-only 5: its cold splits see no key), two steps: within the float64
    reference's bound with no merge launched, and every counter back at 0 after each step (the second
    step's launches count from there). With 64 partial floats a warp the merging program reads one or
    two splits at a time (its loop), with 2,048 16 or 64 (all at once)."""
    from test_kernels_attend import check_steps, make_cache

    from kvstrata.radix.kernels import attend

    monkeypatch.setattr(attend, "FUSED_MERGE_FLOATS", floats)
    for four_bit in (False, True):
        for key, value in (("min_pages", 2), ("programs", 4096), ("merge_reads", 64)):
            monkeypatch.setitem(attend.DECODE_LAUNCH[four_bit], key, value)
    monkeypatch.setitem(attend.INT4_DECODE, "merge_reads", 64)
    merged_apart = []
    monkeypatch.setattr(attend, "merge_partials", lambda parts, out: merged_apart.append(parts))
    merging = launches_made(monkeypatch)
    lengths, bf16 = [5, 37, 70, 101], torch.bfloat16
    for splits in (3, 7, None):
        cache = make_cache(codec, device, sinks=True, dtype=bf16)
        check_steps(cache, lengths, steps=2, n_new=1, tol=1.5e-2, dtype=bf16, splits=splits)
        assert not merged_apart
        assert int(attend.split_counts(torch.device(device), 1).abs().sum()) == 0
    assert all(m.merges and m.options["MERGE_S"] > 0 for m in merging)
    assert {m.splits for m in merging} >= {3, 7} and max(m.splits for m in merging) > 2
    reads = {m.options["MERGE_S"] for m in merging}
    assert reads <= {16, 64} if floats == 2048 else reads <= {1, 2}


# The 8/16-bit decode shapes a layer can take (`attend.pass_launch`): the one-warp 32-key wide shape
# (FP8), int8's 16-key tiles, BF16's 4-warp 64-key shape (2-byte models), each with its launch rule's
# threshold at 1 program, and the 4-warp entry's 128-key tiles, with the thresholds out of reach.
TURNED_CASES = {
    "fp8_e4m3 wide": ("fp8_e4m3", torch.bfloat16, 32),
    "fp8_e5m2 wide": ("fp8_e5m2", torch.bfloat16, 32),
    "fp8_e4m3 entry": ("fp8_e4m3", torch.float32, 128),
    "int8 rows": ("int8", torch.bfloat16, 16),
    "bf16 many programs": ("bf16", torch.bfloat16, 64),
    "bf16 entry": ("bf16", torch.float32, 128),
}


@pytest.mark.parametrize("device", kernel_helpers.DEVICES)
@pytest.mark.parametrize("case", list(TURNED_CASES))
def test_decode_tail_turned_over(case, device, monkeypatch):
    """``tail_keys_as_rows`` (pass 19): the merged tail's products turned over (scores ``k . q^T``, the
    output ``v^T . p``) in each 8/16-bit decode shape (`TURNED_CASES`; sinks on, so the tail spans
    several tiles of the 16- to 64-key shapes, whose rescale between tail tiles is then exercised):
    mixed lengths with a ring-only sequence, the split heuristic and 3 forced splits, two steps, within
    the float64 reference's bound; every launch ran the merged tail turned over, in the case's tiles."""
    from test_kernels_attend import check_steps, make_cache

    from kvstrata.radix.kernels import attend

    codec, dtype, block_n = TURNED_CASES[case]
    rule = 10**9 if block_n == 128 else 1  # the entry: no launch takes the wide or many-programs shape
    monkeypatch.setattr(attend, "FP8_WIDE_PROGRAMS", rule)
    monkeypatch.setattr(attend, "RAW_MANY_PROGRAMS", rule)
    monkeypatch.setitem(attend.DECODE_LAUNCH[False], "tail_keys_as_rows", True)
    for shape in (attend.FP8_WIDE_DECODE, attend.INT8_DECODE, attend.RAW_MANY_DECODE):
        monkeypatch.setitem(shape, "tail_keys_as_rows", True)
    made = launches_made(monkeypatch)
    tol = 2e-5 if dtype == torch.float32 else 1.5e-2
    for splits in (None, 3):
        cache = make_cache(codec, device, sinks=True, dtype=dtype)
        check_steps(cache, [5, 37, 70, 101], steps=2, n_new=1, tol=tol, dtype=dtype, splits=splits)
    assert made and all(m.options["TAIL_T"] and m.options["MERGED_TAIL"] for m in made)
    assert {m.options["BLOCK_N"] for m in made} == {block_n}


@pytest.mark.parametrize("device", kernel_helpers.DEVICES)
@pytest.mark.parametrize("codec", ["fp8_e4m3", "bf16"])
def test_decode_heads_together(codec, device, monkeypatch):
    """``heads_together`` (consecutive programs are one sequence's KV heads, `decode._decode_kernel`'s
    ids remapped): sinks on, mixed lengths, the split heuristic and 3 forced splits merged in the
    kernel, two steps: within the float64 reference's bound, every launch remapped."""
    from test_kernels_attend import check_steps, make_cache

    from kvstrata.radix.kernels import attend

    for key, value in (("heads_together", True), ("min_pages", 2), ("programs", 4096), ("merge_reads", 64)):
        monkeypatch.setitem(attend.DECODE_LAUNCH[False], key, value)
    made = launches_made(monkeypatch)
    for splits in (None, 3):
        cache = make_cache(codec, device, sinks=True, dtype=torch.bfloat16)
        check_steps(cache, [5, 37, 101], steps=2, n_new=1, tol=1.5e-2, dtype=torch.bfloat16, splits=splits)
    assert made and all(m.options["HEADS_TOGETHER"] for m in made)
    assert max(m.splits for m in made) >= 3


def test_merge_chunk_and_options(monkeypatch):
    """`attend.merge_chunk`: the merging program reads `FUSED_MERGE_FLOATS` floats a warp at a time or
    fewer, a power of two of splits (the group padded); `attend.merge_options` gives the kernel the
    counters and that chunk, or without counters the unused tensor and no merge."""
    from kvstrata.radix.kernels import attend

    monkeypatch.setattr(attend, "FUSED_MERGE_FLOATS", 2048)
    assert attend.merge_chunk(group=4, block_d=128, num_warps=1) == 4  # 4 x 4 x 128 = 2,048
    assert attend.merge_chunk(group=4, block_d=128, num_warps=4) == 16
    assert attend.merge_chunk(group=3, block_d=64, num_warps=1) == 8
    assert attend.merge_chunk(group=6, block_d=128, num_warps=1) == 2  # 2,048 / (8 x 128)
    assert attend.merge_chunk(group=16, block_d=256, num_warps=1) == 1
    counts, unused = torch.zeros(8, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    got = attend.merge_options(counts, unused, group=3, chunk=8)
    assert got["COUNT"] is counts and (got["MERGE_S"], got["MERGE_G"]) == (8, 4)
    got = attend.merge_options(None, unused, group=3, chunk=8)
    assert got["COUNT"] is unused and got["MERGE_S"] == 0


@pytest.mark.parametrize("reads", [0, 1, 2])
def test_merge_reads_picks_the_launches_that_merge(reads, monkeypatch):
    """FP8 at the 8B layer's heads, B=16 over 4K tokens (the wide shape: 8 splits, read 4 at a time by
    one warp) merges in the kernel with ``merge_reads`` 2, not 1 or 0; BF16 history of the same step
    (4 warps: 8 splits, one read of 16) with 1 or 2; B=1 over 32K (FP8: 65 splits) with neither."""
    from kvstrata.radix.kernels import attend

    monkeypatch.setattr(attend, "FUSED_MERGE_FLOATS", 2048)
    monkeypatch.setitem(attend.DECODE_LAUNCH[False], "merge_reads", reads)
    for codec, batch, context, merges in (
        ("fp8_e4m3", 16, 4096, reads >= 2),
        ("bf16", 16, 4096, reads >= 1),
        ("fp8_e4m3", 1, 32768, False),
    ):
        launch = _benchmark_launch(codec, batch, context, monkeypatch)
        assert launch.splits > 1 and launch.merges is merges, (codec, batch, context, launch.splits)
        assert (launch.options["MERGE_S"] > 0) is merges


def test_shipped_tables_merge_int4_in_the_kernel_not_fp4(monkeypatch):
    """The launch tables as shipped, B=64 over 4K tokens at the 8B layer's heads (8 splits, read 4 at a
    time): int4 history merges in the kernel (``merge_reads`` 2, `attend.INT4_DECODE`), fp4 apart (0:
    slower in the kernel at B=64 32K on the H200, docs pass 14)."""
    for codec, merges in (("int4", True), ("fp4_e2m1", False)):
        launch = _benchmark_launch(codec, 64, 4096, monkeypatch)
        assert launch.splits == 8 and launch.merges is merges, codec


def test_int8_takes_its_rows_tile(monkeypatch):
    """Symmetric int8 history at the 8B layer decodes by `decode._int8_rows_tile` (`attend.INT8_DECODE`:
    16-key tiles, one warp, the products turned over); with the entry's ``int8_rows`` off, by blocks in
    `attend._attend_kernel` as before. Not taken by int8_asym, pages of 8 tokens or a head_dim that is
    not a power of two (no tile of whole channel halves)."""
    from kvstrata.radix.kernels import attend, decode

    launch = _benchmark_launch("int8", 64, 4096, monkeypatch)
    assert launch.kernel is decode._decode_kernel
    opts = launch.options
    assert opts["INT8_ROWS"] and opts["KEYS_AS_ROWS"] and (opts["BLOCK_N"], opts["num_warps"]) == (16, 1)
    fp8 = _benchmark_launch("fp8_e4m3", 64, 4096, monkeypatch).options
    assert not fp8["INT8_ROWS"] and fp8["KEYS_AS_ROWS"] and fp8["BLOCK_N"] == 32
    monkeypatch.setitem(attend.DECODE_LAUNCH[False], "int8_rows", False)
    assert _benchmark_launch("int8", 64, 4096, monkeypatch).kernel is attend._attend_kernel
    monkeypatch.setitem(attend.DECODE_LAUNCH[False], "scaled_keys_by_blocks", False)
    monkeypatch.setitem(attend.DECODE_LAUNCH[False], "block_n", 16)
    by_keys = _benchmark_launch("int8", 64, 4096, monkeypatch)  # the decode module, 16-key tiles, rows off
    assert by_keys.kernel is decode._decode_kernel and not by_keys.options["INT8_ROWS"]
    entry = dict(attend.DECODE_LAUNCH[False], int8_rows=True)
    assert attend.takes_int8_decode(3, 3, 64, 32, entry)
    assert not attend.takes_int8_decode(4, 4, 128, 16, entry)  # int8_asym
    assert not attend.takes_int8_decode(3, 1, 128, 16, entry)  # int8 keys, fp8 values
    assert not attend.takes_int8_decode(3, 3, 128, 8, entry)
    assert not attend.takes_int8_decode(3, 3, 48, 16, entry)


def _benchmark_launch(codec: str, batch: int, context: int, monkeypatch):
    """The `attend.PassLaunch` of `benchmarks/attention_gpu.py`'s decode step (8B layer), on CPU."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "benchmarks"))
    from attention_gpu import GEOMETRIES, build

    from kvstrata.radix.kernels import attend

    cache, plan, q, k, v = build(codec, batch, context, *GEOMETRIES["8b"], device="cpu", fill=False)[:5]
    k_fmt, _, v_fmt, _ = attend.layer_parts(cache.pool, 0)
    return attend.pass_launch(plan, k_fmt, v_fmt, q, k, v, 0.088, cache.ring, None, None, True, True)


def test_split_counts_grow_and_keep_the_old_sets():
    """`attend.split_counts`: at least `SPLIT_COUNTS_LEAST` zeroed counters a device, the same set while
    it is large enough; a larger request allocates a larger set and keeps the one before allocated
    (graphs captured with it keep its address)."""
    from kvstrata.radix.kernels import attend

    device = torch.device("cpu")
    first = attend.split_counts(device, 1)
    assert first is not None and first.numel() >= attend.SPLIT_COUNTS_LEAST and first.dtype == torch.int32
    assert attend.split_counts("cpu", first.numel()) is first
    larger = attend.split_counts(device, first.numel() + 1)
    assert larger is not None and larger.numel() == first.numel() + 1 and not larger.any()
    assert attend.split_counts(device) is larger and any(t is first for t in attend._SPLIT_COUNTS[device])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="memory ordering between programs: CUDA only")
def test_fused_merge_repeats_bitwise_on_cuda(monkeypatch):
    """FP8 history at the 8B layer's heads (8 KV, 32 query, head_dim 128), 16 sequences of 2,000 to
    4,000 tokens, BF16, 9 splits: 200 launches of the kernel merging its own splits, alternating two
    queries, each after NaN was written to a freed 16 MB block (so partials the caching allocator hands
    out again hold NaN, not the previous launch's): every output has the same bits as the first of its
    query, agrees with the merge launched apart, and every counter is left at 0. A merge that read a
    partial before its program stored it would read NaN or the other query's partial."""
    from radix_helpers import small_cache

    from kvstrata.radix.kernels import attend

    cache = small_cache(
        num_layers=1, kv_heads=8, head_dim=128, page_size=16, recent_window=64, layer_codecs=["fp8_e4m3"],
        ring_dtype=torch.bfloat16, num_pages=4200, max_running=16, device="cuda",
    )  # fmt: skip
    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(2000, 4000, (16,), generator=g).tolist()
    seqs = kernel_helpers.fill(cache, lengths, g, 32, 128**-0.5)
    batch = cache.begin_step(seqs, [1] * 16)
    qs = [torch.randn(16, 32, 128, generator=g).to("cuda", torch.bfloat16) for _ in range(2)]
    k, v = (torch.randn(16, 8, 128, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    made = launches_made(monkeypatch)

    def run(q: torch.Tensor, reads: int) -> torch.Tensor:
        monkeypatch.setitem(attend.DECODE_LAUNCH[False], "merge_reads", reads)
        return kernel_helpers.kernel_attend(cache, batch, q, k, v, 128**-0.5, splits=9)

    apart = [run(q, 0) for q in qs]
    assert not any(m.merges for m in made)
    made.clear()
    first = [run(q, 64) for q in qs]
    for i in range(200):
        torch.full((1 << 22,), float("nan"), device="cuda")  # freed at once: its block holds NaN
        assert torch.equal(run(qs[i % 2], 64), first[i % 2]), i
    assert made and all(m.merges and m.splits == 9 for m in made)
    for got, ref in zip(first, apart, strict=True):
        assert torch.isfinite(got).all() and (got.float() - ref.float()).abs().max() <= 2**-7
    assert not torch.equal(first[0], first[1])
    assert int(attend.split_counts(torch.device("cuda"), 1).abs().sum()) == 0


def test_fp8_wide_decode_counts_programs_once_split():
    """`attend.takes_wide_decode` at 8 KV heads, 16-token pages, splits of at least 32 pages (the
    8/16-bit entry's): B=64 takes the wide shape over any history (512 programs unsplit); B=1 from
    2,017 cold pages, as the launch splits them: 63 splits of 33 pages, rounded to whole 32-key tiles,
    are 64 of 32 (512 programs; 2,040 is the 32K benchmark step's), not at 2,016 (63 splits of 32) nor
    at 1,024 or 256 (4K). B=16 at 97 pages (3 splits of 33, rounded: 4 of 32, 512 programs), not at 96
    (3 of 32) nor at 100 (3 of 34: even, not rounded), from 127 on. Pages of
    64 tokens (a tile holds part of one) are not rounded. Forced splits count as given. Never for BF16,
    int8 or 4-bit history, nor one side FP8 only."""
    from kvstrata.radix.kernels import attend

    def wide(batch: int, pages: int, fmts=(1, 1), splits=None, page_size=16) -> bool:
        return attend.takes_wide_decode(*fmts, batch * 8, pages, splits, 32, page_size)

    assert attend.FP8_WIDE_PROGRAMS == 512 and attend.FP8_WIDE_DECODE["programs"] == 4096
    assert attend.FP8_WIDE_DECODE["block_n"] == 32
    assert wide(64, 1) and wide(64, 4096) and wide(256, 128)
    assert wide(1, 2040) and wide(1, 2017) and wide(1, 4096, fmts=(2, 2)) and wide(1, 2048, fmts=(1, 2))
    assert not wide(1, 2016) and not wide(1, 1024) and not wide(1, 256)
    assert not wide(1, 2040, page_size=64) and wide(1, 2048, page_size=64)
    assert wide(16, 128) and wide(16, 97) and not wide(16, 96) and not wide(16, 100) and not wide(63, 63)
    assert wide(1, 256, splits=64) and not wide(16, 4096, splits=3) and not wide(63, 4096, splits=1)
    for fmts in ((0, 0), (3, 3), (1, 0), (0, 1), (4, 4), (5, 5), (6, 6)):
        assert not wide(64, 4096, fmts=fmts), fmts


@pytest.mark.parametrize(("pages", "warps", "splits"), [(2040, 1, 65), (2016, 4, 64), (256, 4, 33)])
def test_fp8_decode_launch_at_one_sequence(pages, warps, splits):
    """The launch `pass_launch` gives one FP8 sequence at 8 KV heads over ``pages`` 16-token cold pages
    (BF16 model; no kernel runs): the 32K benchmark step's 2,040 take the wide shape (one warp) in 64
    cold splits of 32 pages and the tail's own, as `takes_wide_decode` counts them (`cold_splits`);
    2,016 (63 splits) and 256 (4K) keep the 4-warp entry, 256 in 32 splits of 8 pages (`split_floor`:
    splits of 32 pages would run 64 programs)."""
    from radix_helpers import small_cache

    from kvstrata.radix.kernels import attend
    from kvstrata.radix.plan import GroupPlan

    cache = small_cache(
        num_layers=1,
        kv_heads=8,
        head_dim=32,
        page_size=16,
        recent_window=16,
        layer_codecs=["fp8_e4m3"],
        ring_dtype=torch.bfloat16,
        num_pages=4,
        max_running=1,
    )
    table = torch.zeros(1, pages, dtype=torch.long)
    g = GroupPlan(None, 1, 1, table, [pages], None, [False], torch.zeros(1, 8, dtype=torch.long), [8], 16)
    q, k, v = (torch.zeros(1, h, 32, dtype=torch.bfloat16) for h in (32, 8, 8))
    launch = attend.pass_launch(g, 1, 1, q, k, v, 0.1, cache.ring, None, None, True, True)
    assert (launch.options["num_warps"], launch.splits) == (warps, splits)
    whole = attend.tile_pages(attend.FP8_WIDE_DECODE["block_n"], 16)
    wide = dict(attend.DECODE_LAUNCH[False], **attend.FP8_WIDE_DECODE)
    counted = attend.cold_splits(8, pages, wide, whole)[0]
    assert (counted * 8 >= attend.FP8_WIDE_PROGRAMS) == (warps == 1)
    assert warps == 4 or launch.splits - 1 == counted  # the wide launch's cold splits, its tail's apart


@pytest.mark.parametrize("device", kernel_helpers.DEVICES)
@pytest.mark.parametrize("wide", [True, False])
def test_fp8_decode_shape_by_batch(wide, device, monkeypatch):
    """FP8 history decodes by `attend.FP8_WIDE_DECODE` (one warp, 32-key tiles, three stages, page-table
    entries and scale exponents a tile ahead, heads together) where the step has at least `FP8_WIDE_PROGRAMS`
    (sequence, KV head, split) programs, by the 4-warp entry below that; both at BF16-level error against the
    float64 reference. BF16 history keeps the entry either way."""
    from test_kernels_attend import check_steps, make_cache

    from kvstrata.radix.kernels import attend

    monkeypatch.setattr(attend, "FP8_WIDE_PROGRAMS", 1 if wide else 10**9)
    shapes = []  # (K format, num_warps, BLOCK_N, num_stages, PREFETCH, BITS_AHEAD, HEADS_TOGETHER) a launch
    launch = attend.pass_launch

    def recorded(g, k_fmt, *args, **kwargs):
        got = launch(g, k_fmt, *args, **kwargs)
        if g.tokens == 1:
            o = got.options
            shapes.append(
                (
                    k_fmt,
                    o["num_warps"],
                    o["BLOCK_N"],
                    o["num_stages"],
                    o["PREFETCH"],
                    o["BITS_AHEAD"],
                    o["HEADS_TOGETHER"],
                )
            )
        return got

    monkeypatch.setattr(attend, "pass_launch", recorded)
    for codec in ("fp8_e4m3", "bf16"):
        cache = make_cache(codec, device, sinks=True, dtype=torch.bfloat16)
        check_steps(cache, [9, 70, 300], steps=2, n_new=1, tol=1.5e-2, dtype=torch.bfloat16)
    # forced splits: splits of one masked tile only, and splits past a short sequence's cold pages
    cache = make_cache("fp8_e4m3", device, sinks=True, dtype=torch.bfloat16)
    check_steps(cache, [17, 40, 300], steps=2, n_new=1, tol=1.5e-2, dtype=torch.bfloat16, splits=5)
    entry = attend.DECODE_LAUNCH[False]
    fp8 = {s[1:] for s in shapes if s[0] in attend.FP8_FORMATS}
    raw = {s[1:] for s in shapes if s[0] not in attend.FP8_FORMATS}
    wide_entry = dict(entry, **attend.FP8_WIDE_DECODE)
    wide_shape, entry_shape = (
        (e["num_warps"], e["block_n"], e["num_stages"], e["prefetch"]) for e in (wide_entry, entry)
    )
    assert wide_shape == (1, 32, 3, True)
    # the wide shape loads the FP8 scale exponents a tile ahead with the page-table entries, and runs a
    # sequence's KV heads in consecutive programs (pass 16)
    assert fp8 == ({(*wide_shape, True, True)} if wide else {(*entry_shape, False, False)})
    assert raw == {(*entry_shape, False, False)}


@pytest.mark.parametrize("device", kernel_helpers.DEVICES)
@pytest.mark.parametrize("many", [True, False])
def test_raw_decode_shape_by_programs(many, device, monkeypatch):
    """BF16 history decodes by `attend.RAW_MANY_DECODE` (64-key tiles, three stages, page-table entries
    a tile ahead, a sequence's KV heads together) where a single-pass step has at least
    `RAW_MANY_PROGRAMS` (sequence, KV head) programs, by the entry below that; sinks on, mixed
    lengths, the split heuristic and 3 forced splits (merged in the kernel): BF16-level error against
    the float64 reference either way. FP8 history is not affected."""
    from test_kernels_attend import check_steps, make_cache

    from kvstrata.radix.kernels import attend

    monkeypatch.setattr(attend, "RAW_MANY_PROGRAMS", 1 if many else 10**9)
    monkeypatch.setattr(attend, "FP8_WIDE_PROGRAMS", 10**9)
    made = launches_made(monkeypatch)
    for codec in ("bf16", "fp8_e4m3"):
        for splits in (None, 3):
            cache = make_cache(codec, device, sinks=True, dtype=torch.bfloat16)
            check_steps(
                cache, [9, 70, 300], steps=2, n_new=1, tol=1.5e-2, dtype=torch.bfloat16, splits=splits
            )
    entry = attend.DECODE_LAUNCH[False]
    many_shape = (64, 3, True, True)
    assert (
        tuple(attend.RAW_MANY_DECODE[k] for k in ("block_n", "num_stages", "prefetch", "heads_together"))
        == many_shape
    )
    entry_shape = (
        entry["block_n"],
        entry["num_stages"],
        entry["prefetch"],
        bool(entry.get("heads_together")),
    )

    def shapes(raw: bool) -> set:
        keys = ("BLOCK_N", "num_stages", "PREFETCH", "HEADS_TOGETHER")
        return {tuple(m.options[k] for k in keys) for m in made if (m.options["K_FMT"] == 0) is raw}

    assert shapes(raw=True) == {many_shape if many else entry_shape}
    assert shapes(raw=False) == {entry_shape}
    assert 3 in {m.splits for m in made if m.options["K_FMT"] == 0}
    # a step of two passes (an image or raised pool) keeps the entry
    assert attend.takes_raw_many_decode(0, 0, 4096, direct=False, element_size=2) is False
    assert attend.takes_raw_many_decode(1, 1, 4096, direct=True, element_size=2) is False
    assert attend.takes_raw_many_decode(0, 0, 4096, direct=True, element_size=4) is False  # float32 model


@pytest.mark.parametrize("device", kernel_helpers.DEVICES)
@pytest.mark.parametrize("options", list(PASS9)[1:])
@pytest.mark.parametrize("codec", ["fp8_e4m3", "fp8_e5m2", "bf16"])
def test_fp8_pass9_options(codec, options, device, monkeypatch):
    """Pass 9's options on the one-warp, 32-key shape (`attend.FP8_WIDE_DECODE`'s), BF16 model, sinks
    on, split heuristic and 3 forced splits: BF16-level error against the float64 reference. The
    kernel gets them for FP8 keys and values only (``CODES_ASM`` on CUDA only), never for BF16
    history."""
    from test_kernels_attend import check_steps, make_cache

    from kvstrata.radix.kernels import attend

    launch = dict(attend.FP8_WIDE_DECODE, min_pages=2, tail_apart=True, f16_codes=True, **PASS9[options])
    for key, value in launch.items():
        monkeypatch.setitem(attend.DECODE_LAUNCH[False], key, value)
    got = []  # (CODES_ASM, LAZY_RESCALE, FP8_DOT) of each decode launch
    pass_launch = attend.pass_launch

    def recorded(*args, **kwargs):
        out = pass_launch(*args, **kwargs)
        got.append((out.options["CODES_ASM"], out.options["LAZY_RESCALE"], out.options["FP8_DOT"]))
        return out

    monkeypatch.setattr(attend, "pass_launch", recorded)
    for splits in (None, 3):
        cache = make_cache(codec, device, sinks=True, dtype=torch.bfloat16)
        check_steps(cache, [9, 70, 300], steps=2, n_new=1, tol=1.5e-2, dtype=torch.bfloat16, splits=splits)
    fp8 = codec != "bf16"
    dot = {"keys": 1, True: 2}.get(launch.get("fp8_dot"), 0) if fp8 else 0
    asm = {"values": 1, True: 2}.get(launch.get("codes_asm"), 0) if not dot else 0
    swap = launch.get("swap_ab", False)
    want = (asm if fp8 and device == "cuda" else 0, fp8 and not swap and "lazy_rescale" in launch, dot)
    assert set(got) == {want}


@pytest.mark.parametrize("device", kernel_helpers.DEVICES)
@pytest.mark.parametrize("option", ["value_pairs", "keys_as_rows"])
@pytest.mark.parametrize("wide", [True, False])
@pytest.mark.parametrize("codec", ["fp8_e4m3", "fp8_e5m2", "bf16"])
def test_fp8_value_pairs(codec, wide, option, device, monkeypatch):
    """Pass 13's ``value_pairs`` (`decode._fp8_pairs_tile`) and ``keys_as_rows`` (its ``ROWS``:
    key and value codes as channel pairs, the products turned over, 8 query rows) on the one-warp wide
    shape (scale exponents a tile ahead) and on the 4-warp entry (loaded in the tile), BF16 model,
    sinks on: the split heuristic, 3 forced splits, and 5 over short sequences (splits of one masked
    tile, splits past the cold pages), at BF16-level error against the float64 reference. FP8 keys
    and values take the option (by PTX on CUDA), BF16 history never does."""
    from test_kernels_attend import check_steps, make_cache

    from kvstrata.radix.kernels import attend

    monkeypatch.setattr(attend, "FP8_WIDE_PROGRAMS", 1 if wide else 10**9)
    for name in ("value_pairs", "keys_as_rows"):  # the option alone (the entry's default may name both)
        monkeypatch.setitem(attend.DECODE_LAUNCH[False], name, name == option)
    monkeypatch.setitem(attend.DECODE_LAUNCH[False], "min_pages", 2)
    got = []  # (VALUE_PAIRS, KEYS_AS_ROWS, PAIRS_ASM, BITS_AHEAD, BLOCK_H) of each decode launch
    pass_launch = attend.pass_launch

    def recorded(*args, **kwargs):
        out = pass_launch(*args, **kwargs)
        o = out.options
        got.append((o["VALUE_PAIRS"], o["KEYS_AS_ROWS"], o["PAIRS_ASM"], o["BITS_AHEAD"], o["BLOCK_H"]))
        return out

    monkeypatch.setattr(attend, "pass_launch", recorded)
    for lengths, splits in (([9, 70, 300], None), ([9, 70, 300], 3), ([17, 40, 300], 5)):
        cache = make_cache(codec, device, sinks=True, dtype=torch.bfloat16)
        check_steps(cache, lengths, steps=2, n_new=1, tol=1.5e-2, dtype=torch.bfloat16, splits=splits)
    fp8 = codec != "bf16"
    pairs, rows = fp8 and option == "value_pairs", fp8 and option == "keys_as_rows"
    assert set(got) == {(pairs, rows, fp8 and device == "cuda", fp8 and wide, 8 if rows else 16)}


@triton.jit
def _fp8_split_kernel(
    X, HI, LO, C, FMT: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, SCALE: tl.constexpr
):  # noqa: E501
    at = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    x = tl.load(X + at)
    c = fp8_operand_scale(x, FMT) if SCALE else 1.0
    hi, lo = fp8_split(x, c, FMT)
    tl.store(HI + at, hi.to(tl.float32))
    tl.store(LO + at, lo.to(tl.float32))
    tl.store(C + tl.arange(0, 1), c + tl.zeros([1], tl.float32))


@pytest.mark.parametrize("device", kernel_helpers.DEVICES)
@pytest.mark.parametrize("codec", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_split_bound(codec, device):
    """`decode.fp8_split` (``fp8_dot``'s operands): q (BF16, magnitudes over 2**-30 to 2**30 within a
    tile) scaled by `fp8_operand_scale` so its largest element is in [2**TOP, 2**(TOP+1)) (TOP 7 / 14),
    and softmax weights in [0, 1] at the weights' unit (2**8 / 2**15): ``hi`` and ``lo`` are FP8 values
    of the format and ``|y - hi - lo| <= 2**-(2M+2) |y| + 2**(EMIN-M-1)`` (M mantissa bits, EMIN the
    least normal exponent: 2**-8 and 2**-10 for E4M3, 2**-6 and 2**-17 for E5M2); for E4M3 the split of
    a BF16 value is exact where ``|y| >= 2**-2``."""
    fmt, dtype = {"fp8_e4m3": (1, torch.float8_e4m3fn), "fp8_e5m2": (2, torch.float8_e5m2)}[codec]
    m, emin, top = {1: (3, -6, 7), 2: (2, -14, 14)}[fmt]
    g = torch.Generator().manual_seed(5)
    q = torch.randn(16, 128, generator=g) * 2.0 ** torch.randint(-30, 30, (16, 128), generator=g)
    q = q.to(torch.bfloat16).float()
    w = torch.rand(16, 128, generator=g) * 2.0 ** -torch.randint(0, 40, (16, 128), generator=g).float()
    for x, scale, unit in ((q, True, None), (w, False, 2.0 ** (top + 1))):
        x = x.to(device)
        hi, lo, c = (torch.empty_like(x) for _ in range(3))
        _fp8_split_kernel[(1,)](x if scale else x * unit, hi, lo, c, fmt, 16, 128, scale)
        y = x * c.flatten()[0] if scale else x * unit
        if scale:
            assert 2.0**top <= y.abs().max() < 2.0 ** (top + 1)
        for part in (hi, lo):  # values of the format
            assert torch.equal(part.to(dtype).float(), part)
        err = (y - hi - lo).abs()
        assert (err <= 2.0 ** -(2 * m + 2) * y.abs() + 2.0 ** (emin - m - 1)).all()
        if fmt == 1 and scale:
            assert (err[y.abs() >= 0.25] == 0).all()
