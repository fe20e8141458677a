"""The 4-bit decode kernel (`kvstrata.radix.kernels.decode4`) and its packed nibble decoding
(`kvstrata.quant.kernel_decode.nibble_pairs`), under TRITON_INTERPRET=1 on CPU and natively on CUDA
(there also the inline-PTX path, ``asm``), against the codecs' torch decoding and the float64
reference attention."""

from __future__ import annotations

import kernel_helpers  # first: sets TRITON_INTERPRET=1 on CPU before triton is imported
import pytest
import torch
import triton
import triton.language as tl

from kvstrata.quant.fp4 import _table
from kvstrata.quant.int4 import KEY_SCALE, key_words, scale_offset, value_words
from kvstrata.quant.kernel_decode import (
    INT4_KEY_F16_UNIT,
    int4_key_scale_codes,
    int4_value_scale,
    nibble_pairs,
    nibble_quads,
)
from kvstrata.quant.nibbles import unpack

DEVICE = kernel_helpers.DEVICES[0]
ASM = [False, True] if DEVICE == "cuda" else [False]  # inline PTX runs on a GPU only


@triton.jit
def _pairs_kernel(
    X, S0, O0, S1, O1, OUT0, OUT1, FMT: tl.constexpr, AFFINE: tl.constexpr, ASM: tl.constexpr,
    MAGIC: tl.constexpr = False,
):  # fmt: skip
    i = tl.arange(0, 256)
    x0, x1 = nibble_pairs(
        tl.load(X + i), tl.load(S0 + i), tl.load(O0 + i), tl.load(S1 + i), tl.load(O1 + i),
        FMT, AFFINE, ASM, tl.float16, MAGIC,
    )  # fmt: skip
    tl.store(OUT0 + i, x0)
    tl.store(OUT1 + i, x1)


def _pairs(fmt: int, affine: bool, asm: bool, s, o, magic: bool = False):
    x = torch.randperm(256, generator=torch.Generator().manual_seed(fmt)).to(torch.uint8)
    out = [torch.full((256,), float("nan"), dtype=torch.float16, device=DEVICE) for _ in range(2)]
    args = [t.to(DEVICE) for t in (x, s[0], o[0], s[1], o[1])]
    _pairs_kernel[(1,)](*args, *out, FMT=fmt, AFFINE=affine, ASM=asm, MAGIC=magic)
    return unpack(x), [t.cpu() for t in out]


@pytest.mark.parametrize("asm", ASM)
def test_int4_codes_and_affine_pairs(asm):
    """All 256 bytes: the codes of both nibbles exactly, and ``code * s + o`` (FP16 scale and offset,
    a different pair per nibble) within FP16 rounding of the float64 value."""
    g = torch.Generator().manual_seed(5)
    s = [(torch.rand(256, generator=g) * 4 + 1e-3).half() for _ in range(2)]
    o = [(torch.randn(256, generator=g) * 8).half() for _ in range(2)]
    codes, got = _pairs(5, False, asm, s, o)
    for half in range(2):
        assert torch.equal(got[half].float(), codes[half::2].float())
    codes, got = _pairs(5, True, asm, s, o)
    for half in range(2):
        want = codes[half::2].double() * s[half].double() + o[half].double()
        assert ((got[half].double() - want).abs() <= want.abs() * 2**-10 + 2**-14).all(), half


@pytest.mark.parametrize("asm", ASM)
def test_fp4_pairs_times_block_scales_exact(asm):
    """All 256 bytes times E4M3 block scales across their range (subnormal to 448): E2M1 value times
    scale times 2**-14, exact in FP16 (the codec's table, code 8 -0 equal to +0)."""
    g = torch.Generator().manual_seed(6)
    e4m3 = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn)  # every positive finite scale
    s = [e4m3[torch.randint(0, 126, (256,), generator=g)].half() for _ in range(2)]
    codes, got = _pairs(6, True, asm, s, s)
    table = _table(torch.device("cpu")).double()
    for half in range(2):
        want = table[codes[half::2]] * s[half].double() * 2**-14
        assert torch.equal(got[half].double(), want), half


@triton.jit
def _quads_kernel(X, S, OUT, FMT: tl.constexpr, ASM: tl.constexpr, MAGIC: tl.constexpr = False):
    i = tl.program_id(0) * 1024 + tl.arange(0, 1024)
    x0, x1, x2, x3 = nibble_quads(tl.load(X + i), tl.load(S + i), FMT, ASM, tl.float16, MAGIC)
    tl.store(OUT + 4 * i, x0)
    tl.store(OUT + 4 * i + 1, x1)
    tl.store(OUT + 4 * i + 2, x2)
    tl.store(OUT + 4 * i + 3, x3)


@pytest.mark.parametrize("asm", ASM)
@pytest.mark.parametrize("fmt", [5, 6])
def test_nibble_quads_every_half_word(fmt, asm):
    """All 65,536 16-bit elements, in a random order (so that the PTX's element pairs differ): code
    position i (bits 4i to 4i + 3) out as output i, exactly: int4 the code, fp4 the E2M1 value times
    its element's E4M3 scale (subnormal to 448) times 2**-14."""
    g = torch.Generator().manual_seed(40 + fmt)
    half = torch.randperm(65536, generator=g).to(torch.int32)
    e4m3 = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn)
    s = e4m3[torch.randint(0, 126, (65536,), generator=g)].half()
    out = torch.full((65536 * 4,), float("nan"), dtype=torch.float16, device=DEVICE)
    x = torch.where(half >= 32768, half - 65536, half).to(torch.int16)  # the same 16 bits, signed
    _quads_kernel[(64,)](x.to(DEVICE), s.to(DEVICE), out, FMT=fmt, ASM=asm)
    codes = torch.stack([(half >> (4 * i)) & 15 for i in range(4)], 1)
    if fmt == 6:
        want = _table(torch.device("cpu")).double()[codes] * s.double()[:, None] * 2**-14
    else:
        want = codes.double()
    assert torch.equal(out.cpu().view(65536, 4).double(), want)


@pytest.mark.parametrize("asm", ASM)
def test_int4_magic_codes(asm):
    """``MAGIC`` int4 codes: every byte's low nibble as ``1024 + code`` and high nibble as ``64 + code``
    (`nibble_pairs`), every 16-bit element's code positions 0 and 2 as ``1024 + code`` and 1 and 3 as
    ``64 + code`` (`nibble_quads`), exactly: the FP16 values the PTX leaves before its subtraction."""
    ones = [torch.ones(256, dtype=torch.float16)] * 2
    codes, got = _pairs(5, False, asm, ones, ones, magic=True)
    for half, offset in ((0, 1024.0), (1, 64.0)):
        assert torch.equal(got[half].double(), codes[half::2].double() + offset), half
    half = torch.randperm(65536, generator=torch.Generator().manual_seed(45)).to(torch.int32)
    out = torch.full((65536 * 4,), float("nan"), dtype=torch.float16, device=DEVICE)
    x = torch.where(half >= 32768, half - 65536, half).to(torch.int16)
    _quads_kernel[(64,)](
        x.to(DEVICE), torch.ones(65536, dtype=torch.float16, device=DEVICE), out, 5, asm, True
    )
    offsets = torch.tensor([1024.0, 64.0, 1024.0, 64.0], dtype=torch.float64)
    want = torch.stack([(half >> (4 * i)) & 15 for i in range(4)], 1).double() + offsets
    assert torch.equal(out.cpu().view(65536, 4).double(), want)


@triton.jit
def _key_codes_kernel(W, S, Z):
    i = tl.arange(0, 256)
    s, z = int4_key_scale_codes(tl.load(W + i).to(tl.int32))
    tl.store(S + i, s)
    tl.store(Z + i, z)


def test_int4_key_scale_codes_exact():
    """Every int4 key scale code, read as FP16 bits, is its E3M5 value over INT4_KEY_F16_UNIT exactly
    (subnormal codes too), beside a zero point from -128 to 127 in the word's high byte."""
    code = torch.arange(256, dtype=torch.int32)
    zero = torch.randperm(256, generator=torch.Generator().manual_seed(7)).to(torch.int32) - 128
    out = [torch.empty(256, device=DEVICE) for _ in range(2)]
    _key_codes_kernel[(1,)](key_words(code, zero).to(DEVICE), *out)
    assert torch.equal(out[0].cpu() * INT4_KEY_F16_UNIT.value, KEY_SCALE.decode(code))
    assert torch.equal(out[1].cpu(), zero.float())


@triton.jit
def _value_scale_kernel(W, S, OFF):
    i = tl.arange(0, 1024)
    s, o = int4_value_scale(tl.load(W + i).to(tl.int32))
    tl.store(S + i, s)
    tl.store(OFF + i, o)


def test_int4_value_scale_exact():
    """Every int4 value scale code (E5M5: subnormal codes, FP16's binades and the one above them),
    read from the float32 bits it is shifted under, beside zero points 0 to 63: the codec's scale and
    offset exactly."""
    code = torch.arange(1024, dtype=torch.int32)
    zero = torch.randint(0, 64, (1024,), generator=torch.Generator().manual_seed(8), dtype=torch.int32)
    words = value_words(code, zero)
    out = [torch.empty(1024, device=DEVICE) for _ in range(2)]
    _value_scale_kernel[(1,)](words.to(DEVICE), *out)
    scale, offset = scale_offset(words, "token", 0)
    assert torch.equal(out[0].cpu(), scale) and torch.equal(out[1].cpu(), offset)
    assert scale[1] > 0 and scale[-1] > 65504  # a subnormal code and the binade above FP16's


LAUNCHES = {
    "2 blocks": dict(blocks=2, prefetch=False),
    "4 blocks, prefetch": dict(blocks=4, prefetch=True),
    "8 blocks, 2 warps, prefetch": dict(blocks=8, num_warps=2, prefetch=True),
    "4 blocks, folded key scales": dict(blocks=4, prefetch=False, fold_key_scales=True),
    "2 blocks, folded, prefetch": dict(blocks=2, prefetch=True, fold_key_scales=True),
    "8 blocks, folded, 2 warps": dict(blocks=8, num_warps=2, prefetch=False, fold_key_scales=True),
    "2 blocks, folded, heads together, tail rows": dict(
        blocks=2,
        num_warps=1,
        prefetch=False,
        fold_key_scales=True,
        heads_together=True,
        tail_rows=True,
        value_offsets_apart=True,
    ),
    "2 blocks, folded, keys as rows": dict(
        blocks=2,
        num_warps=1,
        prefetch=False,
        fold_key_scales=True,
        heads_together=True,
        tail_rows=True,
        value_offsets_apart=True,
        keys_as_rows=True,
    ),
    "4 blocks, folded, keys as rows, prefetch, offsets per tile": dict(
        blocks=4, prefetch=True, fold_key_scales=True, keys_as_rows=True
    ),
    "2 blocks, folded, keys as rows, value reference": dict(
        blocks=2,
        num_warps=1,
        fold_key_scales=True,
        value_offsets_apart=True,
        keys_as_rows=True,
        value_reference=True,
    ),
    "4 blocks, folded, value reference, offsets per tile": dict(
        blocks=4, prefetch=True, fold_key_scales=True, value_reference=True
    ),
    "4 blocks, folded, table ahead, wide scales": dict(
        blocks=4, fold_key_scales=True, table_ahead=True, wide_scales=True
    ),
    "4 blocks, table ahead": dict(blocks=4, table_ahead=True),
}
# Pass 17: the page-table entries and ring rows a tile ahead at three stages, over pass 9's keys-as-rows
# shape.
LAUNCHES["2 blocks, folded, keys as rows, value reference, table ahead, 3 stages, 16-key tail tiles"] = dict(
    LAUNCHES["2 blocks, folded, keys as rows, value reference"],
    num_stages=3,
    heads_together=True,
    table_ahead=True,
    tail_n=16,  # the ring (up to 31 rows here) in two tiles: its rows loaded a tile ahead
)
# Pass 19: the decode tail's tiles turned over (keys as rows, whole rows), over fp4's shipped shape
# (pass 17's at two stages).
TURNED_16 = "2 blocks, folded, keys as rows, value reference, table ahead, 16-key tail tiles turned over"
LAUNCHES[TURNED_16] = dict(
    LAUNCHES["2 blocks, folded, keys as rows, value reference"],
    heads_together=True,
    table_ahead=True,
    tail_n=16,
    tail_keys_as_rows=True,
)
# The same in 32-key tail tiles without the table ahead (int4's shape).
LAUNCHES["2 blocks, folded, keys as rows, value reference, tail tiles turned over"] = dict(
    LAUNCHES["2 blocks, folded, keys as rows, value reference"], heads_together=True, tail_keys_as_rows=True
)
# The ring in 16-key tiles without the table ahead (its row ids loaded in the tile).
LAUNCHES["2 blocks, folded, keys as rows, value reference, 16-key tail tiles"] = dict(
    LAUNCHES["2 blocks, folded, keys as rows, value reference"], heads_together=True, tail_n=16
)


def _use(monkeypatch, launch: dict, asm: bool) -> list[tuple]:
    """Set the 4-bit decode launch; returns the grids `_decode4_kernel` ran with (attention dispatched
    elsewhere would otherwise pass these tests unnoticed: the other kernels read 4-bit codes too)."""
    from kvstrata.radix.kernels import attend, decode4

    # Every option off unless the entry sets it (the defaults turn several on: an entry's name says
    # all that it runs with).
    options = ("fold_key_scales", "heads_together", "tail_rows", "value_offsets_apart")
    options += ("keys_as_rows", "value_reference", "value_quads", "table_ahead", "wide_scales")
    options += ("tail_keys_as_rows", "magic_codes")
    shape = {"module": "decode4", "asm": asm, "num_stages": 2, "tail_n": 32}  # pass 12's unless set
    for key, value in {**shape, **dict.fromkeys(options, False), **launch}.items():
        monkeypatch.setitem(attend.DECODE_LAUNCH[True], key, value)
    # The entry's pass 17 keys run on int4 layers too (`attend.decode4_launch` sets them back there).
    int4 = {k: v for k, v in attend.INT4_DECODE.items() if k not in attend.DECODE4_PASS12}
    monkeypatch.setattr(attend, "INT4_DECODE", int4)
    monkeypatch.setattr(attend, "DECODE4_PASS12", {})
    grids: list[tuple] = []
    kernel = decode4._decode4_kernel

    class Counted:  # `kernel[grid](...)`, recording the grid
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(decode4, "_decode4_kernel", Counted())
    return grids


@pytest.mark.parametrize("launch", list(LAUNCHES))
@pytest.mark.parametrize("codec", ["int4", "fp4_e2m1", "int4/fp4_e2m1", "fp4_e2m1/int4"])
def test_decode4_float32(codec, launch, monkeypatch):
    """float32 model (float32 operands): ring-only, one page, several pages with full and partial
    tiles, forced splits (some with no cold page) and sinks, within float32 rounding of the float64
    reference read of the same codes."""
    from test_kernels_attend import check_steps, make_cache

    grids = _use(monkeypatch, LAUNCHES[launch], False)
    cache = make_cache(codec, DEVICE, sinks=True)
    assert check_steps(cache, [9, 70, 300], steps=2, n_new=1, tol=2e-5, splits=3) == 6
    assert grids and all(g[2] == 3 for g in grids)  # every decode pass ran it, with the splits asked


@pytest.mark.parametrize(
    "launch",
    [
        "4 blocks, prefetch",
        "4 blocks, folded key scales",
        "2 blocks, folded, heads together, tail rows",
        "2 blocks, folded, keys as rows, value reference",
        "4 blocks, folded, table ahead, wide scales",
        TURNED_16,
    ],
)
@pytest.mark.parametrize("asm", ASM)
@pytest.mark.parametrize("codec", ["int4", "fp4_e2m1", "int4/fp4_e2m1"])
def test_decode4_bfloat16(codec, asm, launch, monkeypatch):
    """BF16 model (FP16 code operands on CUDA, through the PTX decoding with ``asm``), without splits
    (the kernel writes the output directly) and with the split heuristic: BF16-level error."""
    from test_kernels_attend import check_steps, make_cache

    grids = _use(monkeypatch, LAUNCHES[launch], asm)
    cache = make_cache(codec, DEVICE, dtype=torch.bfloat16)
    check_steps(cache, [12, 50, 299], steps=2, n_new=1, tol=1.5e-2, dtype=torch.bfloat16)
    assert grids


@pytest.mark.parametrize("k_scale", [2.0**-12, 2.0**12])
@pytest.mark.parametrize("codec", ["int4", "fp4_e2m1"])
def test_decode4_folded_query_range(codec, k_scale, monkeypatch):
    """Folded key scales with keys ``k_scale`` times a unit normal and queries ``1 / k_scale`` times
    one (the scores as usual): the scales folded into q do not follow the keys' magnitude (int4 scale
    codes up to 31, fp4 block scales up to 448, in units of a page-wide scale), so at 2**-12 q times
    them would pass FP16's 65504 and at 2**12 fall to FP16 subnormals without the kernel's
    power-of-two division of q. BF16 model (FP16 operands and the PTX decoding on CUDA)."""
    from radix_helpers import rel_err
    from test_kernels_attend import HKV, HQ, SCALE, D, make_cache

    grids = _use(monkeypatch, LAUNCHES["4 blocks, folded key scales"], ASM[-1])
    cache = make_cache(codec, DEVICE, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(12)

    def qkv(tokens: int) -> list[torch.Tensor]:
        q, k, v = (torch.randn(tokens, n, D, generator=g) for n in (HQ, HKV, HKV))
        return [x.to(DEVICE, torch.bfloat16) for x in (q / k_scale, k * k_scale, v)]

    lengths = [40, 300]
    seqs = [cache.admit(list(range(1000 * i, 1000 * i + n + 64))) for i, n in enumerate(lengths)]
    batch = cache.begin_step(seqs, lengths)
    cache.attention(0, batch, *qkv(sum(lengths)), SCALE)  # the prompts, through the torch path
    cache.end_step(batch)
    batch = cache.begin_step(seqs, [1, 1])
    q, k, v = qkv(2)
    got = kernel_helpers.kernel_attend(cache, batch, q, k, v, SCALE)
    assert torch.isfinite(got).all() and grids
    assert rel_err(got.cpu(), kernel_helpers.reference_attend(cache, batch, q, k, v, SCALE)) < 1.5e-2


# ``value_quads`` over the two keys-as-rows launches above (each option on or off in one of them).
QUAD_LAUNCHES = {
    f"{name}, value quads": dict(LAUNCHES[name], value_quads=True)
    for name in (
        "2 blocks, folded, keys as rows, value reference",
        "4 blocks, folded, keys as rows, prefetch, offsets per tile",
        "2 blocks, folded, keys as rows, value reference, table ahead, 3 stages, 16-key tail tiles",
        TURNED_16,
    )
}
# int4 codes with their FP16 offsets (``magic_codes``, `decode4._cold_tile4`), over the value-quads shapes
# with the value reference (fp4 layers run these without it).
MAGIC_LAUNCHES = {
    f"{name}, magic codes": dict(QUAD_LAUNCHES[f"{name}, value quads"], magic_codes=True)
    for name in ("2 blocks, folded, keys as rows, value reference", TURNED_16)
}
# Pass 17's shapes with value quads and the fp4 key scales read as channel pairs.
QUAD_LAUNCHES["2 blocks, folded, keys as rows, table ahead, 3 stages, wide scales, value quads"] = dict(
    LAUNCHES["2 blocks, folded, keys as rows, value reference, table ahead, 3 stages, 16-key tail tiles"],
    value_quads=True,
    wide_scales=True,
)


def _at_head_dim(monkeypatch, head_dim: int) -> list[tuple[dict, dict]]:
    """`test_kernels_attend`'s caches and steps at ``head_dim``; returns the ``(launch, options)`` of
    every `decode4.decode4_options` call from then on, for a test to check what its launches ran with."""
    import test_kernels_attend

    from kvstrata.radix.kernels import decode4

    monkeypatch.setattr(test_kernels_attend, "D", head_dim)
    monkeypatch.setattr(test_kernels_attend, "SCALE", head_dim**-0.5)
    seen: list[tuple[dict, dict]] = []
    options_of = decode4.decode4_options

    def recorded(group, launch, *args, **kwargs):
        options = options_of(group, launch, *args, **kwargs)
        seen.append((launch, options))
        return options

    monkeypatch.setattr(decode4, "decode4_options", recorded)
    return seen


@pytest.fixture
def head_dim_64(monkeypatch):
    """Head_dim 64, where ``value_quads`` applies (parts of D/4 channels, the product's M of 16 at
    least); `_at_head_dim`'s record of the launches, for the test to check that the quads path ran."""
    return _at_head_dim(monkeypatch, 64)


@pytest.mark.parametrize("launch", list(QUAD_LAUNCHES))
@pytest.mark.parametrize("codec", ["int4", "fp4_e2m1", "int4/fp4_e2m1", "fp4_e2m1/int4"])
def test_decode4_value_quads_float32(codec, launch, monkeypatch, head_dim_64):
    """``value_quads`` (values as 16-bit elements, the output in four channel parts put together after
    the cold tiles), float32 model: sinks, forced splits, full and partial tiles, against the float64
    reference within float32 rounding."""
    from test_kernels_attend import check_steps, make_cache

    grids = _use(monkeypatch, QUAD_LAUNCHES[launch], False)
    cache = make_cache(codec, DEVICE, sinks=True)
    assert check_steps(cache, [9, 70, 300], steps=2, n_new=1, tol=2e-5, splits=3) == 6
    assert grids and all(g[2] == 3 for g in grids)
    assert head_dim_64 and all(options["VALUE_QUADS"] for _, options in head_dim_64)


@pytest.mark.parametrize("launch", list(QUAD_LAUNCHES))
@pytest.mark.parametrize("asm", ASM)
@pytest.mark.parametrize("codec", ["int4", "fp4_e2m1", "fp4_e2m1/int4"])
def test_decode4_value_quads_bfloat16(codec, asm, launch, monkeypatch, head_dim_64):
    """``value_quads`` with a BF16 model (FP16 operands and `nibble_quads`' PTX on CUDA): BF16-level
    error, with and without splits."""
    from test_kernels_attend import check_steps, make_cache

    grids = _use(monkeypatch, QUAD_LAUNCHES[launch], asm)
    cache = make_cache(codec, DEVICE, dtype=torch.bfloat16)
    check_steps(cache, [12, 50, 299], steps=2, n_new=1, tol=1.5e-2, dtype=torch.bfloat16)
    assert grids and head_dim_64 and all(options["VALUE_QUADS"] for _, options in head_dim_64)


@pytest.mark.parametrize("launch", list(MAGIC_LAUNCHES))
# float32 operands: the offsets (1024 times the query) take about 2**-10 of the products' precision.
@pytest.mark.parametrize(
    ("dtype", "tol", "splits"), [(torch.float32, 1e-4, 3), (torch.bfloat16, 1.5e-2, None)]
)
@pytest.mark.parametrize("codec", ["int4", "int4/fp4_e2m1", "fp4_e2m1/int4"])
def test_decode4_magic_codes(codec, dtype, tol, splits, launch, monkeypatch, head_dim_64):
    """``magic_codes``: int4 keys and values decoded with their FP16 offsets, taken off in the products'
    accumulators, give the reference's output: a float32 model with sinks and forced splits within 1e-4
    (2e-5 without), a BF16 model with the split heuristic within the same bound as without (on CUDA
    through the PTX decoding). Layers of int4 keys and fp4 values, or the reverse, run without it."""
    from test_kernels_attend import check_steps, make_cache

    asm = DEVICE == "cuda"
    grids = _use(monkeypatch, MAGIC_LAUNCHES[launch], asm)
    cache = make_cache(codec, DEVICE, sinks=dtype == torch.float32, dtype=dtype)
    lengths = [9, 70, 300] if dtype == torch.float32 else [12, 50, 299]
    compared = check_steps(cache, lengths, steps=2, n_new=1, tol=tol, splits=splits, dtype=dtype)
    assert compared == 6 and grids and head_dim_64
    assert splits is None or all(g[2] == splits for g in grids)
    assert all(options["MAGIC"] == (codec == "int4") for _, options in head_dim_64)


H100 = "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize(
    ("codec", "head_dim", "card", "cap"),
    [
        ("fp4_e2m1", 128, "", 168),
        ("fp4_e2m1", 128, H100, None),
        ("fp4_e2m1", 256, "", None),
        ("int4", 256, "", 168),
        ("int4/fp4_e2m1", 128, "", 168),
        ("int4/fp4_e2m1", 128, H100, 168),
    ],
)
def test_register_cap_by_head_dim(codec, head_dim, card, cap, monkeypatch):
    """The 4-bit decode's 168-register cap (`attend.DECODE_LAUNCH[True]`) holds up to
    `attend.DECODE4_CAPPED_HEAD_DIM`; wider heads run uncapped (their capped loop spills), except int4,
    whose one-stage shape (`attend.INT4_DECODE`) keeps it, and fp4 on a card of
    `attend.FP4_UNCAPPED_MAX_PAGES` (the step's short page table, passed through `pass_launch`). Pass
    17's table ahead and 16-key ring tiles are fp4's up to that head_dim only, not int4's on either
    side. The default launch, float32 model, against the float64 reference at that head_dim; the card
    is the name `attend.cuda_name` reports, so the test runs the same on any device."""
    from test_kernels_attend import check_steps, make_cache

    from kvstrata.radix.kernels import attend

    monkeypatch.setattr(attend, "cuda_name", lambda t: card)
    seen = _at_head_dim(monkeypatch, head_dim)
    cache = make_cache(codec, DEVICE)
    assert check_steps(cache, [12, 40], steps=1, n_new=1, tol=2e-5) == 2
    assert seen and all(launch.get("maxnreg") == cap for launch, _ in seen)
    pass17 = codec == "fp4_e2m1" and head_dim <= 128
    stages = 1 if codec == "int4" else 2
    assert all(launch["num_stages"] == stages and launch["table_ahead"] == pass17 for launch, _ in seen)
    assert all(options["TAIL_N"] == (16 if pass17 else 32) for _, options in seen)


@pytest.mark.parametrize(
    ("head_dim", "min_rows", "turned"), [(128, 6, True), (128, 7, False), (64, 1, False), (256, 1, False)]
)
def test_int4_turned_tail_rule(head_dim, min_rows, turned, monkeypatch):
    """int4's decode tail runs turned over in 16-key tiles (`attend.INT4_TURNED_TAIL`) at head_dim 128
    from `attend.INT4_TURNED_MIN_ROWS` sequence x KV-head rows a launch, and nowhere else (32-key
    tail); its one-stage shape stays. Three sequences of `test_kernels_attend`'s 2 KV heads are 6 rows
    (3 if the rule counted sequences). The launch takes the card's register cap from the device name
    `pass_launch` reads (here an H200's: 128 where turned, else 168). The default launch, float32
    model, against the float64 reference."""
    from test_kernels_attend import check_steps, make_cache

    from kvstrata.radix.kernels import attend

    monkeypatch.setattr(attend, "INT4_TURNED_MIN_ROWS", min_rows)
    monkeypatch.setattr(attend, "cuda_name", lambda t: "NVIDIA H200")
    seen = _at_head_dim(monkeypatch, head_dim)
    cache = make_cache("int4", DEVICE)
    assert check_steps(cache, [12, 40, 70], steps=2, n_new=1, tol=2e-5) == 6
    assert seen and all(launch["num_stages"] == 1 and launch.get("merge_reads") == 2 for launch, _ in seen)
    tail_n, cap = (16, 128) if turned else (32, 168)
    assert all(options["TAIL_T"] == turned and options["TAIL_N"] == tail_n for _, options in seen)
    assert all(launch["maxnreg"] == options["maxnreg"] == cap for launch, options in seen)


def test_int4_turned_tail_threshold():
    """The rule's threshold counts sequence x KV-head rows: 511 keeps the 32-key tail, 512 turns it. The
    register cap goes by card: 128 on an H200 where the tail turns, 168 below the threshold, on an H100
    and off CUDA (measured per card, `attend.INT4_TURNED_MAXNREG`)."""
    from kvstrata.radix.kernels import attend

    entry, int4, h200 = attend.DECODE_LAUNCH[True], attend.INT4_FORMAT, "NVIDIA H200"
    below = attend.decode4_launch(entry, int4, int4, 128, 16, attend.INT4_TURNED_MIN_ROWS - 1, h200)
    at = attend.decode4_launch(entry, int4, int4, 128, 16, attend.INT4_TURNED_MIN_ROWS, h200)
    assert attend.INT4_TURNED_MIN_ROWS == 512
    assert not below.get("tail_keys_as_rows") and below["tail_n"] == 32 and below["maxnreg"] == 168
    assert at["tail_keys_as_rows"] and at["tail_n"] == 16 and at["maxnreg"] == 128
    assert {k: v for k, v in at.items() if k not in (*attend.INT4_TURNED_TAIL, "maxnreg")} == {
        k: v for k, v in below.items() if k not in (*attend.INT4_TURNED_TAIL, "maxnreg")
    }
    for name in (H100, ""):
        other = attend.decode4_launch(entry, int4, int4, 128, 16, attend.INT4_TURNED_MIN_ROWS, name)
        assert other == {**at, "maxnreg": 168}
    wide = attend.decode4_launch(entry, int4, int4, 64, 16, 4 * attend.INT4_TURNED_MIN_ROWS, h200)
    assert wide["maxnreg"] == 168 and not wide.get("tail_keys_as_rows")


def test_cuda_name_off_cuda():
    """Tensors off CUDA have no card name: no per-card launch choice applies."""
    from kvstrata.radix.kernels import attend

    assert attend.cuda_name(torch.zeros(1)) == ""


def test_value_quads_options():
    """``value_quads`` needs ``keys_as_rows`` (refused without) and applies from head_dim 64 (ignored
    below: parts of D/4 channels are the product's M)."""
    from kvstrata.radix.kernels.decode4 import decode4_options

    launch = dict(blocks=2, num_warps=1, num_stages=2, fold_key_scales=True, value_quads=True)
    with pytest.raises(ValueError, match="keys_as_rows"):
        decode4_options(4, launch, True, dict(DOT_DTYPE=tl.float32, D=64))
    launch["keys_as_rows"] = True
    assert decode4_options(4, launch, True, dict(DOT_DTYPE=tl.float32, D=64))["VALUE_QUADS"]
    assert not decode4_options(4, launch, True, dict(DOT_DTYPE=tl.float32, D=32))["VALUE_QUADS"]


def test_magic_codes_options():
    """``magic_codes`` applies to int4 keys and values in the keys-as-rows shape with value quads and the
    value reference, and is ignored elsewhere (fp4 or mixed layers, head_dim 32, no value reference)."""
    from kvstrata.radix.kernels.decode4 import decode4_options

    launch = dict(
        blocks=2, num_warps=1, num_stages=2, fold_key_scales=True, keys_as_rows=True, value_quads=True
    )
    launch.update(value_reference=True, magic_codes=True)

    def magic(launch: dict, k_fmt: int = 5, v_fmt: int = 5, d: int = 64) -> bool:
        meta = dict(DOT_DTYPE=tl.bfloat16, D=d, K_FMT=k_fmt, V_FMT=v_fmt)
        return decode4_options(4, launch, False, meta)["MAGIC"]

    assert magic(launch)
    assert not magic(launch, v_fmt=6) and not magic(launch, k_fmt=6) and not magic(launch, k_fmt=6, v_fmt=6)
    assert not magic(launch, d=32)
    assert not magic(dict(launch, value_reference=False))
    assert not magic(dict(launch, magic_codes=False))


def test_applies_only_to_4bit_layers():
    """The 4-bit kernel reads 4-bit keys and values at power-of-two head_dims of 32 or more and pages
    of whole 16-token blocks; other layers keep the other decode paths."""
    from kvstrata.radix.kernels.decode4 import applies

    assert applies(5, 6, 128, 16) and applies(6, 5, 32, 64)
    assert not applies(5, 3, 128, 16) and not applies(1, 6, 128, 16)
    assert not applies(5, 5, 96, 16) and not applies(5, 5, 16, 16) and not applies(5, 5, 128, 8)


def test_keys_as_rows_needs_folded_key_scales():
    """``keys_as_rows`` turns the folded product over (the query side 8 rows at least, the product's
    N, instead of 16); without ``fold_key_scales`` it is refused."""
    from kvstrata.radix.kernels.decode4 import decode4_options

    launch = dict(blocks=2, num_warps=1, num_stages=2, keys_as_rows=True)
    meta = dict(DOT_DTYPE=tl.float32)
    with pytest.raises(ValueError, match="fold_key_scales"):
        decode4_options(4, launch, True, meta)
    options = decode4_options(4, dict(launch, fold_key_scales=True), True, meta)
    assert options["BLOCK_H"] == 8 and options["SLOT_R"] == 4 and options["KEYS_AS_ROWS"]
    options = decode4_options(1, dict(launch, fold_key_scales=True), True, meta)  # N at least 8
    assert options["BLOCK_H"] == 8 and options["SLOT_R"] == 4
    options = decode4_options(4, dict(launch, fold_key_scales=True, keys_as_rows=False), True, meta)
    assert options["BLOCK_H"] == 16 and options["SLOT_R"] == 8 and not options["KEYS_AS_ROWS"]


def test_wide_scales_needs_folded_key_scales():
    """``wide_scales`` reads the fp4 key block scales that `decode4._folded_query` folds into the query;
    without ``fold_key_scales`` it would do nothing, so it is refused; ``table_ahead`` reaches the
    kernel as its constexpr."""
    from kvstrata.radix.kernels.decode4 import decode4_options

    launch = dict(blocks=2, num_warps=1, num_stages=3, wide_scales=True, table_ahead=True)
    meta = dict(DOT_DTYPE=tl.float32)
    with pytest.raises(ValueError, match="fold_key_scales"):
        decode4_options(4, launch, True, meta)
    options = decode4_options(4, dict(launch, fold_key_scales=True), True, meta)
    assert options["WIDE_SCALES"] and options["TABLE_AHEAD"] and options["num_stages"] == 3
    assert not decode4_options(4, dict(blocks=2, num_warps=1, num_stages=2), True, meta)["TABLE_AHEAD"]


@pytest.mark.parametrize("tail_n", [8, 24])
def test_tail_n_is_a_power_of_two_of_16_or_more(tail_n):
    """The decode tail's tiles of ``tail_n`` keys: its P.V product has K = ``tail_n``, which a GPU's
    `tl.dot` needs at 16 or more, and `tl.arange` a power of two; anything else is refused here (the
    interpreter would run it)."""
    from kvstrata.radix.kernels.decode4 import TAIL_N, decode4_options

    launch = dict(blocks=2, num_warps=1, num_stages=2)
    meta = dict(DOT_DTYPE=tl.float32)
    with pytest.raises(ValueError, match="tail_n"):
        decode4_options(4, dict(launch, tail_n=tail_n), True, meta)
    assert decode4_options(4, launch, True, meta)["TAIL_N"] == TAIL_N
    assert decode4_options(4, dict(launch, tail_n=16), True, meta)["TAIL_N"] == 16


@pytest.mark.parametrize("page", [32, 64])
@pytest.mark.parametrize("codec", ["fp4_e2m1", "int4/fp4_e2m1", "fp4_e2m1/int4"])
def test_decode4_wide_scales_pages_of_several_blocks(codec, page, monkeypatch):
    """``wide_scales`` and ``table_ahead`` where a page holds 2 or 4 16-token blocks (each block's key
    scales in its own row of the page's; at 16-token pages the block within the page is always 0):
    float32 model, sinks, a window of a page, forced splits, against the float64 reference."""
    from test_kernels_attend import check_steps, make_cache

    name = "2 blocks, folded, keys as rows, value reference, table ahead, 3 stages, 16-key tail tiles"
    grids = _use(monkeypatch, dict(LAUNCHES[name], wide_scales=True), False)
    cache = make_cache(codec, DEVICE, sinks=True, page=page, window=page)
    assert check_steps(cache, [9, 2 * page + 5, 5 * page + 17], steps=2, n_new=1, tol=2e-5, splits=3) == 6
    assert grids
