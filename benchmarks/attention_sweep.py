"""Launch-shape sweep of the Triton attention kernels on one GPU (picks `DECODE_LAUNCH`/`EXTEND_LAUNCH`).

    python benchmarks/attention_sweep.py            # time every variant, print a table
    python benchmarks/attention_sweep.py --warm I   # compile variant I only (run several in parallel)

Times `kvstrata.radix.kernels.attend.attend_group` at the 8B layer geometry (32 query / 8 KV heads,
head_dim 128; SWEEP_GEOMETRY=default: the default model's) on the same strata as
`benchmarks/attention_gpu.py` builds, for several launch shapes:
extend (a 2,048-token chunk over 30,720 cached tokens) and decode at B=64 and B=1, context 32K. Each
line gives milliseconds and the ratio to SDPA BF16 measured in the same run. ``--warm`` compiles one
variant into Triton's on-disk cache (same specializations as the timed run), so that a GPU call can
compile all variants in parallel processes before timing them one after another.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import attention_gpu as bench  # noqa: E402

from kvstrata.quant.kernel_decode import kernel_format  # noqa: E402
from kvstrata.quant.registry import get_codec  # noqa: E402
from kvstrata.radix.kernels import attend as kernels  # noqa: E402

CONTEXT, CHUNK = 32768, 2048
WIDE_DECODE = dict(kernels.FP8_WIDE_DECODE)  # the default wide shape; a variant's ``wide`` goes over it
FOUR_BIT = ("int4", "fp4_e2m1")


def shape(
    m: int,
    n: int,
    warps: int,
    stages: int,
    by_blocks: bool,
    blocks: int = 4,
    prefetch: bool = False,
    programs: int = 512,
    f16: bool = False,
    swap: bool = False,
    maxnreg: int | None = None,
    halves: bool = False,
    module: str = "decode",
    min_pages: int = 16,
    merged_tail: bool = True,
    scaled_keys_by_blocks: bool = False,
    tail_apart: bool = False,
    codes_asm: bool | str = False,
    lazy_rescale: bool = False,
    fp8_dot: bool | str = False,
    dequant_bytes: int = 0,
) -> dict:
    return dict(
        block_m=m,
        block_n=n,
        blocks=blocks,
        num_warps=warps,
        num_stages=stages,
        by_blocks=by_blocks,
        prefetch=prefetch,
        programs=programs,
        f16_codes=f16,
        swap_ab=swap,
        maxnreg=maxnreg,
        halves=halves,
        module=module,
        min_pages=min_pages,
        merged_tail=merged_tail,
        scaled_keys_by_blocks=scaled_keys_by_blocks,
        tail_apart=tail_apart,
        codes_asm=codes_asm,
        lazy_rescale=lazy_rescale,
        fp8_dot=fp8_dot,
        # 0: an extend variant reads the codes (not `attend.EXTEND_DEQUANT`, which takes entries without it)
        dequant_bytes=dequant_bytes,
    )


# Prefetched page-table entries (Triton 3.6, sm_90, read from the compiled code): 128 x 64 with 4
# stages keeps three tiles of copies in flight without spills; 128 x 128 with 3 stages spills.
# ``f16``: 8-bit codes enter the dots as FP16 (FP8 E4M3 -> FP16 two codes an instruction).
# Pass 9 (prepared offline; docs/kernels-h200.md): ``module`` "extend", the flash-shaped extend kernel
# (`kvstrata.radix.kernels.extend`: q unscaled in the products, the scale in the exponent's FMA, FP8
# value scales in the exponent, FP8 scale bytes a tile ahead, causal mask on diagonal tiles only).
# Predicted from the sm_90 code Triton 3.6 compiles (cold loop: instructions a warp a tile, registers,
# shared memory), BF16 / FP8 history; the pass-4 kernel at 128 x 64, 4 stages, prefetch: 431 / 971
# (255 registers, 72 bytes of stack for FP8), at 128 x 128, 3 stages: 1,674 for FP8 (152 of stack).
def _ext(m: int, n: int, warps: int, stages: int, prefetch: bool = False, dequant_bytes: int = 0) -> dict:
    """A pass-9 extend shape: the flash kernel, FP16 code operands, ``dequant_bytes`` 0 unless given."""
    return shape(m, n, warps, stages, False, prefetch=prefetch, programs=0, f16=True, module="extend",
                 dequant_bytes=dequant_bytes)  # fmt: skip


# Measured (H200, one run, 2K chunk over 30K; SDPA BF16 1.775 ms), BF16 / FP8 history in list order:
# 2.928 / 4.947, 2.670 / 9.756 (pass 4's raw default), 2.490 / 5.202, 2.315 / 6.954 (BF16's default
# since: 0.77x SDPA), 2.634 / 6.425, 2.918 / 4.815, 2.734 / 4.868; int4 and the dequantize-first line
# did not run (the sweep stopped at EXTEND_DEQUANT: `GroupPlan.kernel_lengths` copied host lengths to
# the device inside the CUDA-graph capture of the timing; the dequantizing pass now keeps the plan's).
EXTEND_PASS9 = [
    shape(128, 128, 8, 3, False, programs=0, f16=True),
    shape(128, 64, 8, 4, False, prefetch=True, programs=0, f16=True),
    # The default's shape in the new kernel: 426 / 849 (215 / 252 registers, no spills): a few % from
    # the loop, more from the new tokens (unmasked tiles 368 instructions instead of 613).
    _ext(128, 64, 8, 4, prefetch=True),
    # 128-key tiles: BF16 700 a tile (5.5 a key against 6.7: the rescale and waits once per 128 keys),
    # 255 registers, 32 bytes of stack outside the loop, 224 KB shared; FP8 spills in the loop (40
    # local loads and stores a tile): expected slower for FP8.
    _ext(128, 128, 8, 3, prefetch=True),
    _ext(128, 128, 8, 2, prefetch=True),  # 693 a tile, 160 KB shared (1 tile ahead)
    # Without prefetch: FP8 1,523 a tile (11.9 a key against 13.3), no spills (scales loaded in the
    # tile); BF16 690 with 32 bytes of stack outside the loop.
    _ext(128, 128, 8, 3),
    # 64 rows, one warp group: 235 / 240 registers and 112 KB shared, so two programs share an SM and
    # one's softmax can overlap the other's products (Triton 3.6 gives neither warp specialization nor
    # an asynchronous Q.K across the softmax here); K/V read from L2 twice as often. 490 / 956 a tile.
    _ext(64, 64, 4, 3, prefetch=True),
    # One warp group for the default's 128 x 128 tiles (each warp 32 rows; not compiled offline).
    _ext(128, 128, 4, 3, prefetch=True),
]
# Pass 13: BF16's default (`attend.EXTEND_LAUNCH["raw"]`, 2.315 ms = 1.304x SDPA BF16 in pass 9) with
# ``late_blocks_first``: the 64 query blocks of a head start last block first, so that the causal
# chunk's heaviest programs (240 cold tiles of 128 keys, a ring tile and up to 16 new-token tiles) run
# in the first waves and the lightest fill the last (512 programs of one an SM: 3.9 waves on 132
# SMs). For BF16 history: SWEEP_KINDS=extend SWEEP_CODECS=bf16. Measured (H200, two runs; SDPA BF16
# 1.781 / 1.769 ms): the default 2.304 / 2.296 ms (1.29x / 1.30x SDPA), ``late_blocks_first`` 2.495 /
# 2.482: slower, left off.
_RAW = _ext(128, 128, 8, 3, prefetch=True)
EXTEND = [_RAW, dict(_RAW, late_blocks_first=True)]
EXTEND_4BIT = [shape(128, 64, 8, 2, True, 4, programs=0)]
# Coded history dequantized to BF16 first (`attend.dequantizes`, up to 1 GiB of K/V a pass: the case's
# 30,592 cold keys make 125 MB), then the flash kernel's BF16 loop at the default's shape: each of the
# 64 query blocks a head no longer decodes every code again. Expected about the BF16 line plus one
# read of the codes and a write of 125 MB by `attend._dequant_kernel` (~0.05 ms at 4 TB/s); FP8, int4.
EXTEND_DEQUANT = [
    _ext(128, 64, 8, 4, prefetch=True, dequant_bytes=1 << 30),
    _ext(128, 128, 8, 3, prefetch=True, dequant_bytes=1 << 30),  # BF16's default shape after the decode
]
# Decode. Sweeps of pass 4 (H200, Triton 3.6, FP8 at 32K; registers of the compiled kernels): 128-key
# tiles with 4 warps 1.777 ms at B=64 (255 registers); ``halves`` 2.24-2.58; swapped operands 3.710;
# 8 warps 4.845; 64 or 32 keys 2.27-3.82; 4-bit codes by keys 24-45 ms against 4.6-5.3 by blocks; 512
# programs 0.046 ms at B=1 (hence ``min_pages``). Pass 6 (docs/kernels-h200.md): channel-major value
# codes as a probe 1.890 ms against 1.688 (capped at 168 registers 1.720); below, the tail and the
# register cap (1.628 / 1.602 / 1.562 ms at B=64, 0.472 / 0.483 / 0.418 at B=256, 2K) and int8 keys
# by keys or blocks (3.729 / 2.221 / 2.970 ms).
# Pass 8 (FP8, prepared offline; docs/kernels-h200.md): the default first (every variant's output is
# checked against it), then fewer warps a program and smaller tiles, so more programs share an SM and
# no tile waits on a cross-warp barrier (pass 7's one-warp shape for 4-bit). Predicted from the sm_90
# code Triton 3.6 compiles (registers, cold loop in warp instructions a key, programs an SM by
# registers and shared memory; the default: 168 registers, 35.5 a key, 3 programs of 4 warps, spills):
# 1 warp, 32 keys: 255 registers, 32.0 a key, no spills, 8 programs (programs target 8 x 132 x ~4);
# the same with `halves`: 248 registers, 30.6 a key (value byte loads 160 -> 36 a tile), 8 programs;
# 1 warp capped at 200: 33.9 a key, 9 spill stores a tile, 10 programs; 2 warps, 64 keys capped at
# 200: 34.7 a key, no spills, 5 programs; 1 warp, 16 keys capped at 128: 46.7 a key, 2 spill stores
# a tile, 16 programs (16 warps an SM, the most of any; 2 warps of 32 keys at 128 registers: 47 a
# key, 8 programs, cross-warp barriers). The programs targets are about 4 waves of each shape's
# programs an SM over the H200's 132 SMs (B=64 at 32K: 8, 10, 5 and 16 splits).
# Pass 8's measured pick (H200, B=64 32K / B=256 2K / B=1,024 2K): 1 warp, 32 keys, 4,096 programs
# 1.300 / 0.355 / 1.416 ms against the 4-warp entry's 1.573 / 0.430 / 1.580; `halves` 1.720, caps of
# 200 / 128 registers 1.538 / 1.501, 2 warps of 64 keys 1.610 (B=64, 32K). It is `attend.FP8_WIDE_DECODE`
# where a step has `FP8_WIDE_PROGRAMS` (sequence, KV head) programs or more.
# Pass 9 (FP8, prepared offline; docs/kernels-h200.md): every variant is the 4-warp entry below with
# ``wide_programs`` (`attend.FP8_WIDE_PROGRAMS` for the variant; 1: the wide shape at every batch, B=1
# included) and pass 9's options (`decode.fp8_options`), the default first. Predicted from the sm_90 code
# (`decode_compiled.py`, Triton 3.6; the wide shape's cold loop in warp instructions a 32-key tile and
# shared-memory wavefronts, 254-255 registers, no spill, 8 programs an SM in each): default 920 (28.8 a
# key), 253 wavefronts; ``codes_asm`` "values" 703 (22.0), 249: value codes and the softmax weights
# converted to FP16 by PTX, so values load by transposing ldmatrix instead of 130 byte loads and 64 byte
# packs, and P.V's operands take FP16 register layouts; ``codes_asm`` True (keys too) 652 (20.4) but 377
# wavefronts (keys staged as FP16: q's operand then loads without ~90 register moves); ``lazy_rescale``
# skips 74 on the tiles that keep the running max: 661 / 595 (18.6 a key) with the two. At pass 8's
# issue share (1.300 ms for 920) B=64 at 32K would take 0.99 / 0.92 / 0.84 ms (values / keys too / keys
# too and lazy), under or at the 0.96 ms its 4.33 GB of FP8 history take at SDPA BF16's ~4.5 TB/s; keys
# staged as FP16 would use ~80% of an SM's shared-memory bandwidth there, which may cap them. The
# 4-warp shape (B=1): 1,025 a warp a 128-key tile, 707 with ``codes_asm`` True but 77.8 KB of shared
# memory instead of 73.7 (2 programs an SM, not 3). The last variant also splits B=1's 32K into 256
# splits of 8 pages (min_pages 8; 2,048 one-warp programs of 4 tiles) instead of 65 of 32 (520 programs
# of 16 tiles); it changes nothing at B >= 64.
_F16 = dict(f16=True)
_NEW = dict(min_pages=32, tail_apart=True, **_F16)
_FP8 = dict(_NEW, blocks=8, scaled_keys_by_blocks=True, programs=1024, maxnreg=168)  # the entry's shape
# Measured (H200, one run; ms at B=64 32K / B=256 2K / B=1,024 2K / B=1 32K): the default 1.309 / 0.358 /
# 1.429 / 0.046; the wide shape at B=1 too 1.309 / 0.358 / 1.429 / 0.046; values asm + lazy rescale 1.330 /
# 0.355 / 1.365 / 0.045; codes asm 1.666 / 0.432 / 1.643 / 0.048, with lazy rescale 1.694 / 0.441 / 1.701 /
# 0.048, and at B=1 in 256 splits of 8 pages 0.043: the offline prediction (0.84-0.99 ms at B=64 32K) did
# not hold, the default stays. ``wide_formats`` (`attend.WIDE_DECODE_FORMATS`) adds BF16/FP32 history
# (format 0) to the wide shape: BF16 at B=256 2K / B=128 2K / B=64 32K 0.498 / 0.263 / 1.900 ms against
# the 4-warp entry's 0.498 / 0.254 / 1.878 (4.3-4.6 TB/s, SDPA's 0.96-0.99x: BF16 is at the bandwidth
# already), so BF16 stays on the entry; values asm + lazy rescale FP8 0.352 / 0.193 / 1.309 against
# 0.354 / 0.197 / 1.292 (a second run of the table above's option).
# Pass 13's options are named in every variant (a key a variant leaves out is the shipped entry's, `apply`).
_DEFAULT = dict(
    shape(64, 128, 4, 2, False, **_FP8),
    wide_programs=512,
    wide_formats=(1, 2),
    keys_as_rows=True,
    value_pairs=False,
    heads_together=False,
    ring_ahead=False,
    tail_keys_as_rows=False,
    raw_many_programs=kernels.RAW_MANY_PROGRAMS,  # the shipped rule (BF16 variants turn it off)
)
# ``fp8_dot`` (prepared offline, `decode._fp8_dot_tile`): q.K^T on FP8 operands (q split in two FP8
# parts), True P.V too (weights split). On the one-warp wide shape Triton 3.6 promotes FP8 dots to FP16
# for sm_90 (MMAv2: 1,120 / 1,521 instructions a 32-key tile against 920, spills); FP8 tensor cores on
# sm_90 are warp-group products only, so the last two variants are the 4-warp entry with ``swap_ab``
# and 64-key tiles (keys the product's M side), wide shape off: 581 / 870 warp instructions a 64-key
# tile (36.3 / 54.4 a key against the default's 28.8), 152 / 158 registers, 3 programs an SM; keys only
# with 128-key tiles 858 a warp a tile (26.8 a key), 255 registers, 72 KB of shared memory, 2 programs.
_SWAP_FP8 = dict(_DEFAULT, wide_programs=10**9, block_n=64, swap_ab=True, maxnreg=None)
# Pass 11 (docs/kernels-h200.md): Nsight Compute on the default (H200, B=64 32K: 70% of DRAM peak, 8
# warps an SM, issue 41%): 30% of the warps' stall samples sit on the loop's one barrier after
# ``DEPBAR.LE SB0, 0x0`` (every async copy of the tile waited for: at 2 stages nothing of the next tile
# is in flight while one computes) and the page-table and value-scale loads stall their users
# (``long_scoreboard``). Candidates: page-table entries a tile ahead (``prefetch``), a third and fourth
# stage (7 and 6 programs an SM by shared memory). Pass 9's and 10's variants (measured above, or
# offline: ``fp8_dot`` on the one-warp shape) left the list.
# Measured (H200, one run; ms at B=64 32K / B=256 2K / B=1,024 2K / B=1 32K): pass 10's default 1.299 /
# 0.356 / 1.418 / 0.046; ``prefetch`` 1.278 / 0.350 / 1.354 / 0.045; 3 stages 1.502 / 0.404 / 1.663 /
# 0.049; 3 stages and ``prefetch`` 1.192 / 0.337 / 1.275 / 0.045 (`attend.FP8_WIDE_DECODE` since); 4
# stages and ``prefetch`` 1.528 / 0.432 / 1.579 / 0.046; ``fp8_dot`` keys at 128 keys 1.919 / 0.540 /
# 2.092 / 0.049. Nsight Compute on the new default: 75% of DRAM peak, and now 26% of the stall samples
# on the tile's single-byte scale loads (``LDG.E.U8``, not copied ahead by the pipeliner), so the
# second step loads the FP8 scale exponents a tile ahead beside the page-table entries (``bits_ahead``,
# `decode._fp8_scale_bits`); ``wide`` variants over the default's wide shape: without it, at 2 and at
# 4 stages.
# Measured (H200, one run, same cases): the default (``bits_ahead``) 1.202 / 0.333 / 1.303 / 0.046;
# without it 1.246 / 0.341 / 1.316 / 0.046; at 2 stages 1.324 / 0.357 / 1.377; at 4 stages 1.490 /
# 0.421 / 1.480. Nsight Compute on that default: 78% of DRAM peak; the largest stall now (21% of the
# samples) is the first use of the value codes' byte pairs (``LDS.U8``, ``IMAD x, 0x100, y``), which
# pass 9's ``codes_asm`` "values" removes; it gained nothing while the loop waited on its copies, so
# it is listed again over the new default (it takes `decode._fp8_tile`, which reads its scales in the
# tile). Measured over the new default (H200, a later session, cases B=64 32K / B=256 2K): default
# 1.160 / 0.327, ``codes_asm`` "values" 1.397 / 0.394, with ``lazy_rescale`` 1.367 / 0.389: both lose.
# Pass 13 (prepared offline; docs/kernels-h200.md): ``value_pairs`` (`decode._fp8_pairs_tile`) reads
# the value codes as uint16 channel pairs, so that P.V's operand loads by a transposing ldmatrix and
# one byte permute and two conversions make four codes' even and odd FP16 pairs (the cold loop of the
# wide shape, Triton 3.6 for sm_90: 968 -> 734 instructions a 32-key tile, LDS.U8 130 -> 2, no stack;
# the 4-warp entry's 1,025 -> 841). ``keys_as_rows`` (the same function's ``ROWS``) turns the products
# over (scores ``k . q^T``, 8 query rows instead of 16) with key and value codes both as channel pairs,
# loaded transposed so that both come by async copies and ldmatrix: 567 a tile (HMMA 64 -> 32, the
# softmax's FMUL 80 -> 40), 213 registers, 20.7 KB of shared memory (9 programs an SM by registers,
# 10 by shared memory); capped at 200 registers 564 (10 programs); two stages and 168 registers 542
# (11 programs by shared memory); the 4-warp entry 559 (from 1,025).
# Measured (H200, one run of this list; ms at B=64 32K / B=256 2K / B=1,024 2K / B=1 32K; SDPA BF16
# 1.859 / 0.478 / 1.857 / 0.046): pass 11's default 1.160 / 0.325 / 1.244 / 0.046; ``value_pairs`` 1.008 /
# 0.291 / 1.099 / 0.041; ``keys_as_rows`` 1.006 / 0.288 / 1.093 / 0.037 (the default since); two stages
# and 168 registers 1.001 / 0.299 / 1.117 / 0.037 (34 spills). An earlier run (B=64 32K only: the list then
# left the options out of variants that did not set them, so its later cases ran the last one's): capped
# at 200 registers 1.020 (22 spills).
DECODE = [
    _DEFAULT,
    dict(_DEFAULT, keys_as_rows=False),  # pass 11's default
    dict(_DEFAULT, keys_as_rows=False, value_pairs=True),
    dict(_DEFAULT, wide=dict(num_stages=2, maxnreg=168)),
    # Pass 16: the wide shape without ``heads_together`` (`attend.FP8_WIDE_DECODE`'s since; the
    # wide shape's own keys win over the entry's, so its runs set it there). Measured with the two
    # roles the other way round (this variant had them, the default not): docs/kernels-h200.md.
    dict(_DEFAULT, wide=dict(heads_together=False)),
    # The wide shape at every batch (B=16 at 8 KV heads has 128 programs before splitting): for the
    # small-batch cases, SWEEP_CASES=16x32768,16x4096,64x4096,1x32768,1x4096. Measured (H200, one run):
    # 0.268 / 0.049 / 0.156 / 0.031 / 0.022 ms against the 4-warp entry's 0.307 / 0.057 / 0.156 / 0.037 /
    # 0.015, hence `attend.takes_wide_decode` (programs counted once split; B=1 at 4K keeps the entry).
    dict(_DEFAULT, wide_programs=1),
    # Small batches on the wide shape (same SWEEP_CASES): splits of at least 16 or 8 pages (the wide
    # shape takes the 4-warp entry's 32; more programs at B=1 and B=16, fewer tiles each) and a fourth
    # pipeline stage (fewer warps an SM to keep loads in flight at B=1). Measured (H200, one run; ms at
    # B=16 4K / B=1 32K / B=16 32K / B=64 4K / B=1 4K): the default 0.049 / 0.037 / 0.267 / 0.155 / 0.015
    # (B=1 32K then missed the wide rule, since counted by whole tiles: 0.031); >= 16 pages 0.056 / 0.030 /
    # 0.268 / 0.162 / 0.015; >= 8 pages 0.057 / 0.036 / 0.267 / 0.162; 4 stages 0.055 / 0.037 / 0.287 /
    # 0.163; both 0.059 / 0.038 / 0.286 / 0.177. The default stays.
    dict(_DEFAULT, wide=dict(min_pages=16)),
    dict(_DEFAULT, wide=dict(min_pages=8)),
    dict(_DEFAULT, wide=dict(num_stages=4)),
    dict(_DEFAULT, wide=dict(min_pages=16, num_stages=4)),
    # The default model's geometry (SWEEP_GEOMETRY=default: 3 KV heads, head_dim 64): a 32-key tile is
    # half the 8B layer's bytes; 64 keys a tile keep them. Measured (H200, one run, SWEEP_CASES=16x4096,
    # 16x32768,64x4096,64x32768,256x4096): the default 0.021 / 0.073 / 0.044 / 0.261 / 0.143 ms; 64-key
    # tiles 0.021 / 0.074 / 0.049 / 0.266 / 0.153; with splits of >= 64 pages 0.021 / 0.079 / 0.046 /
    # 0.266 / 0.147; every variant within 0.019-0.025 / 0.073-0.079 / 0.044-0.057 / 0.255-0.271 /
    # 0.136-0.160 (two stages at 168 registers: 0.255 at B=64 32K, 0.136 at B=256 4K). No change.
    dict(_DEFAULT, wide=dict(block_n=64)),
    dict(_DEFAULT, wide=dict(block_n=64, min_pages=64)),
    # Pass 17 (prepared offline, Triton 3.6 for sm_90, B=256 2K): the decode tail's loop (sink page,
    # ring rows, new key; 32 keys a tile on the wide shape) waits for all its copies (0x0) and takes 951
    # instructions a tile; with its ring row ids a tile ahead (``ring_ahead``) 0x2 and 670. The ring is
    # 128 BF16 rows a sequence at fp8's shipped window: about 5 of a 2K sequence's 64 tiles. Measured
    # (H200, 2026-12-05, one run): slower at every case, B=256 2K 0.306 ms against 0.287, B=1,024 2K
    # 1.082 against 1.051, B=64 32K 1.081 against 1.002, B=16 4K 0.056 against 0.042.
    dict(_DEFAULT, ring_ahead=True, wide=dict(ring_ahead=True)),
    # Pass 17 (offline, as above): launches under the wide rule run the 4-warp entry, whose loop waits
    # with 0x0 at two stages (the default model's geometry, B=16 4K: 432 programs, 463 instructions a
    # 128-key tile); page-table entries a tile ahead at three stages: 0x2, 483. For
    # SWEEP_GEOMETRY=default SWEEP_CASES=16x4096,1x4096,1x32768 (and the 8B layer's B=1 4K). Measured
    # (H200, 2026-12-05, one run, the default model's geometry): B=16 4K 0.020 ms against 0.021, B=1 4K
    # 1.12x against 1.22x SDPA BF16, B=1 32K 0.012 against 0.014: mixed at 3 digits, not adopted.
    dict(_DEFAULT, prefetch=True, num_stages=3),
    # Pass 19 (prepared offline, Triton 3.6 for sm_90, B=256 2K; B=64 32K the same): the merged tail's
    # products turned over (``tail_keys_as_rows``, `decode._tail_tile`'s ``TURNED``): its loop 951 -> 752
    # instructions a 32-key tile (HMMA 64 -> 32, the rescale's FMUL 64 -> 32, IMAD 246 -> 118), the
    # cold loop 570 -> 568, 255 -> 238 registers. Not for BF16's 4-warp 64-key shape (its tail 523 ->
    # 656) or int8's 16-key tiles (tail 536 -> 538, cold loop 644 -> 661), so the wide shape only.
    # Measured on an H100 (sixteenth session): B=256 2K 0.416 ms against 0.419, B=64 32K 1.494 against
    # 1.481: no gain, not adopted.
    dict(_DEFAULT, wide=dict(tail_keys_as_rows=True)),
]
# BF16 history (format 0) reads the 4-warp entry's shape (FP8 takes the wide shape from 512 programs).
# At the serving step (B=256, 2K) it ran at 0.93-0.96x SDPA BF16's bandwidth (0.509-0.527 ms against
# 0.489; B=64 at 32K 0.99x): 0.6-1.2 ms of a 32-layer step. Candidates: page-table entries a tile
# ahead; ``heads_together`` (a sequence's 8 KV heads run together, so a page's 2 KB token rows are read
# at about the same time instead of one head's 256 bytes of every row, the others a wave later);
# smaller tiles and more stages, so that two or more programs share an SM (the entry's two 64 KB
# stages leave one an SM, whose first loads and tail tile then run with nothing else in flight); 8
# warps; split in two at B=256 (``programs`` 4,096, merged in the kernel). For BF16 alone:
# SWEEP_CODECS=bf16; the engine's BF16 ring holds one partial page (window 0): SWEEP_WINDOW=16. The
# variants run as written (not `attend.RAW_MANY_DECODE` from `attend.RAW_MANY_PROGRAMS` programs) and
# are not part of the fastest-shape pick: BF16's shape at many programs is that rule's, not the entry's.
_BF16 = dict(_DEFAULT, raw_many_programs=10**9)
# Measured (H200, 2026-12-04, one run, window 16; ms at B=256 2K / B=256 1,600 / B=64 4K / B=64 32K /
# B=16 4K; SDPA BF16 0.478 / 0.380 / 0.247 / 1.860 / 0.072): the entry 0.527 / 0.427 / 0.265 / 1.882 /
# 0.085; ``prefetch`` 0.519 / 0.421 / 0.266 / 1.907 / 0.084; ``heads_together`` 0.516 / 0.416 / 0.267 /
# 1.903 / 0.085; 64 keys, 3 stages, ``prefetch`` 0.501 / 0.405 / 0.270 / 1.996 / 0.082; the same at 2
# stages 0.540 / 0.428 / 0.278 / 2.065 / 0.086; 2 warps, 64 keys, 3 stages, ``prefetch`` 0.499 / 0.402 /
# 0.265 / 1.957 / 0.079; 1 warp, 32 keys, 3 stages, ``prefetch`` 0.500 / 0.408 / 0.268 / 1.975 / 0.084;
# 8 warps 0.735 / 0.600 / 0.396 / 2.874 / 0.117; 3 stages of 128 keys, ``prefetch`` 0.565 / 0.460 / 0.295
# / 2.008 / 0.091; 4,096 programs (B=256 in 2 splits) 0.550 / 0.464 / 0.282 / 1.913 / 0.082; 64 keys, 3
# stages, ``prefetch`` and ``heads_together`` **0.490 / 0.395** / 0.271 / 1.952 / 0.084. The last wins
# where a launch has many short programs (B=256 at 2K: 2,048 programs of 100-128 pages, 7% faster) and
# loses at B=64 32K (1,024 programs of 1,024 pages). The list below places the boundary.
_BF16_64 = dict(_BF16, block_n=64, num_stages=3, prefetch=True, heads_together=True)
DECODE_BF16 = [
    _BF16,
    dict(_BF16, heads_together=True),
    _BF16_64,
    dict(_BF16_64, num_warps=2),
]
# int8 keys (per-channel scales); not part of the fastest-shape pick (it would set the entry FP8 shares).
# The shipped entry without ``int8_rows`` first (by 16-token blocks in `attend._attend_kernel`: the shape
# before, measured, H200, B=64 32K 2.221 ms; every other variant's output is checked against the first),
# then with it (`attend.INT8_DECODE`: 16-key tiles in FP8's ``keys_as_rows`` layout, the page's key scales
# on the codes; prepared offline on 2026-12-05, Triton 3.6 for sm_90, B=64 32K: 644 instructions a 16-key
# tile, 198 registers, no spills, copies in flight with 0x6; the table's row shows the entry's shape, not
# the 16-key, one-warp tiles that run), by keys and by 4 blocks.
DECODE_INT8 = [
    dict(_DEFAULT, int8_rows=False),
    dict(_DEFAULT, int8_rows=True),
    dict(shape(64, 128, 4, 2, False, programs=1024, **_NEW), int8_rows=False),
    dict(
        shape(64, 128, 4, 2, False, blocks=4, scaled_keys_by_blocks=True, programs=1024, **_NEW),
        int8_rows=False,
    ),
]
# 4-bit decode: the `decode4` kernel (whole-byte tiles of ``blocks`` 16-token blocks, FP16 operands,
# ``asm``: packed PTX nibble decoding, ``prefetch``: page-table entries and the scales Triton does not
# pipeline loaded a tile ahead) against the previous by-blocks path of `attend._attend_kernel` (last).
# First call (H200, B=64, 32K; no prefetch, 2 stages): 2 / 4 / 8 blocks int4 5.21 / 3.79 / 2.69 ms
# (255 registers), 4 blocks capped at 128 registers (90 spills) 2.66, fp4 3.17; previous path 5.27
# and 4.59. Second call (these shapes): 8 blocks, 3 stages, prefetch int4 2.52 (best for int4 at
# B=64) but fp4 3.90 and B=1 0.11; 4 blocks at 128 registers 2.74-2.82 / fp4 3.13-3.19 / B=1 0.086-0.092
# with or without prefetch or a third stage; 16 blocks with 8 warps 3.44 / 5.73. Docs: kernels-h200.md.
# Pass 7, first call (H200, B=64 32K / B=1 32K / B=256 2K, int4 then fp4): pass 5's shape 3.368 / 0.090
# / 1.153 and 3.127 / 0.090 / 1.113 ms; the same with the keys' scales folded into the query per block
# (``fold_key_scales``) 2.510 / 0.079 / 0.943 and 2.356 / 0.076 / 0.906; folded with one warp a program
# (4096 programs) and 2 blocks 1.788 / 0.074 / 0.752 and 1.994 / 0.078 / 0.803 (the default), 4 blocks
# 1.910 / 0.079 / 0.777 and 2.196 / 0.081 / 0.859. Second call (int4 at B=1 32K / 2K): the
# default's split sizes, 16 / 8 / 4 pages at least 0.073 / 0.062, 0.113 / 0.058, 0.183 / 0.054 ms, and the
# decode tail in a split of its own 0.066 / 0.048 (now the default; fp4 the same within 0.01 ms).
# Pass 8 (docs/kernels-h200.md): ``heads_together``, ``tail_rows`` and ``value_offsets_apart`` together
# took 32-41% off the serving shapes (B=256 and 1,024 at 2K) and are the default since; register caps
# (168, 128) lost everywhere (spills).
# Pass 9 (docs/kernels-h200.md). Predictions from the sm_90 code (Triton 3.6,
# offline, int4 / fp4 instructions of the cold loop, a 32-key tile, B=64 32K and B=256 2K alike): the
# default 1,453 / 1,597 at 255 registers (8 programs an SM; int4 1,578 before its value scales were read
# from their bits). ``keys_as_rows`` (scores k . q^T, 8 query columns instead of 16 padded rows: half
# the products and accumulator) 1,294 / 1,319; with ``value_reference`` (the accumulator in units of a
# running value scale, no per-tile product rescale) 1,257 / 1,297; one stage (no cp.async pipeline)
# 1,050 / 1,290 (-28% / -19%); capped at 168 registers (12 programs an SM) 1,079 / 1,302 without
# spills in the cold loop (the ring tile spills: about 1,070 against 976); at 144 (14 programs) 1,138 /
# 1,329 (19 / 12 reloads a tile); two stages at 168: 1,379 (65 reloads, 22 stores) / 1,321 (no spill).
# Measured (H200, one run, int4 / fp4 ms at B=64 32K, B=256 2K, B=1,024 2K): pass 8's default 1.710 /
# 1.839, 0.461 / 0.499, 1.720 / 1.874; keys as rows + value reference 1.689 / 1.529, 0.453 / 0.415,
# 1.700 / 1.537 (fp4's default since); the same with one stage at 168 registers 1.326 / 1.533, 0.404 /
# 0.446, 1.434 / 1.632 (int4's default since, `attend.INT4_DECODE`); one stage uncapped 1.526 / 1.713,
# at 144 registers 1.441 / 1.579, two stages at 168 1.840 / 1.596. The list: fp4's default, int4's,
# pass 8's (every entry sets every option; one left out is the shipped entry's, `apply`; a 4-bit
# variant runs as written for int4 too).
_D4 = dict(
    shape(64, 32, 1, 2, True, 2, programs=4096, module="decode4", tail_apart=True),
    asm=True,
    fold_key_scales=True,
    heads_together=True,
    tail_rows=True,
    value_offsets_apart=True,
    keys_as_rows=False,
    value_reference=False,
    value_quads=False,
    table_ahead=False,
    wide_scales=False,
    tail_n=32,
    tail_keys_as_rows=False,
)
_D4_ROWS = dict(_D4, keys_as_rows=True, value_reference=True)
_D4_ROWS_1 = dict(_D4_ROWS, num_stages=1)
# Pass 11: fp4's default waits on its plain byte loads in the tile (Nsight Compute, B=64 32K: 33% of DRAM
# peak, ``long_scoreboard`` on the byte packs); a third stage and ``prefetch`` (page-table entries and
# scales a tile ahead) with it. Measured (H200, one run; B=64 32K / B=256 2K / B=1,024 2K): the default
# 1.534 / 0.416 / 1.544 ms, int4's shape 1.532 / 0.447 / 1.634, ``prefetch`` 1.586 / 0.440 / 1.718, with
# 3 stages 1.545 / 0.424 / 1.591: no gain, fp4's default unchanged.
# Pass 12 (prepared offline, Triton 3.6 for sm_90, cold loop a 32-key tile at B=1,024 2K): fp4's PTX
# decoding writes E5M2 bytes four codes an instruction before spreading them (18 -> 11 instructions an
# instance, every launch: fp4's default 1,294 -> 1,069); ``value_quads`` reads the value codes as 16-bit
# elements, so that P.V's operand comes from a transposing ldmatrix instead of 64 one-byte shared loads
# and their packing (fp4 1,069 -> 959; int4 at its shape 1,072 -> 951).
# Pass 17 (prepared offline, Triton 3.6 for sm_90, cold loop a 32-key tile, B=64 32K; B=1,024 2K the
# same within 17): every 4-bit default waits for all its copies at the top of each tile (``DEPBAR.LE
# SB0, 0x0``): the next tile's codes are copied at the end of the tile, after the page-table entries
# they need come back, so no copy is in flight while a tile computes (FP8's wide loop waits with 0x2).
# ``table_ahead`` (the entries and the small scale words a tile ahead) at three stages: 0x3, the next
# tile's copies in flight through the tile; fp4 959 -> 1,011 instructions, no spill at 168 registers
# (1,027 uncapped); four stages 0x6, 1,016. ``wide_scales`` (fp4 key block scales as channel pairs,
# copied ahead with the codes): 0x4, 1,131 (values' block scales as 32-bit words were tried: 128 more
# shared stores a tile, left out). int4 at three stages spills at 168 registers (1,210 with 59 reloads
# a tile); uncapped 1,083 at 0x1 (its one-stage default 948, no copies). The ring's tiles (32 BF16
# keys, B=1,024 2K) likewise wait with 0x0, and spill (939 instructions, 56 reloads and 53 stores a
# tile); ``table_ahead`` loads their rows a tile ahead too: 0x2, 942; with ``tail_n`` 16, 575 a 16-key
# tile, 6 reloads.
# Measured (H200, pass 17's two calls; B=64 32K / B=256 2K / B=1,024 2K at window 256; docs pass 17):
# pass 12's fp4 default (4) 1.204 / 0.357 / 1.346 ms; 5-9 slower (the capped table ahead with 32-key ring
# tiles spills: 5 at 128's window 1.636 / 0.470 / 1.686 at B=1,024); 10 1.137 / 0.336 / 1.218; 11 (16-key
# ring tiles alone) 1.205 / 0.341 / 1.264; 12 (10 at two stages, fp4's default since) 1.099 / 0.316 /
# 1.192; 13 1.191 / 0.339 / 1.252; 14 1.151 / 0.331 / 1.242. int4: 15 1.286 against 3's 1.268 at B=64
# 32K, 1.356 against 1.389 at B=1,024 2K (window 128).
_D4_AHEAD = dict(_D4_ROWS, maxnreg=168, value_quads=True, num_stages=3, table_ahead=True)
DECODE_4BIT: list[dict] = [
    _D4_ROWS,
    dict(_D4_ROWS_1, maxnreg=168),
    dict(_D4_ROWS, value_quads=True),
    dict(_D4_ROWS_1, maxnreg=168, value_quads=True),
    dict(_D4_ROWS, maxnreg=168, value_quads=True),
    _D4_AHEAD,
    dict(_D4_AHEAD, wide_scales=True),
    dict(_D4_AHEAD, num_stages=4),
    dict(_D4_AHEAD, maxnreg=None),
    dict(_D4_AHEAD, maxnreg=None, wide_scales=True),
    dict(_D4_AHEAD, tail_n=16),
    dict(_D4_ROWS, maxnreg=168, value_quads=True, tail_n=16),
    dict(_D4_AHEAD, num_stages=2, tail_n=16),
    dict(_D4_AHEAD, table_ahead=False, tail_n=16),
    dict(_D4_AHEAD, tail_n=16, wide_scales=True),
    dict(_D4_ROWS_1, maxnreg=168, value_quads=True, tail_n=16),
    # fp4's default since pass 17 (12) at 144 registers: 14 one-warp programs an SM instead of 12
    # (offline, B=1,024 2K: cold loop 975 -> 1,035 instructions with 15 reloads a tile, ring tile 572
    # -> 636 with 34).
    dict(_D4_AHEAD, num_stages=2, tail_n=16, maxnreg=144),
    # 12 with 64-key tiles in two-warp programs (6 programs an SM at 168 registers), and 12 uncapped.
    # Measured on an H100 (nineteenth session, window 256; B=64 32K / B=256 2K / B=1,024 2K): 12 1.146 /
    # 0.388 / 1.392 ms, 17 1.491 / 0.455 / 1.597, 18 1.190 / 0.365 / 1.347 (docs/kernels-h200.md pass 21).
    dict(_D4_AHEAD, num_stages=2, tail_n=16, blocks=4, num_warps=2),
    dict(_D4_AHEAD, num_stages=2, tail_n=16, maxnreg=None),
    # Pass 19 (prepared offline, Triton 3.6 for sm_90, B=1,024 2K unless said): the decode tail's tiles
    # turned over (``tail_keys_as_rows``, `decode4._tail_tile_t`: keys as the products' M side, 8 query
    # columns instead of 16 padded rows, whole K and V rows by asynchronous copies and ldmatrix, no split
    # into channel halves). fp4's default (12) with it: the ring loop a 16-key tile 572 -> 475
    # instructions (HMMA 32 -> 16, the rescale's FMUL 64 -> 32, shared loads 51 -> 19, no spill stores);
    # in 32-key tiles 538 a tile, 16.8 a key against 35.8 (568 at B=64 32K and B=256 2K, which split);
    # the cold loop 975 -> 977-979. int4's default (3) with it: the ring loop a 32-key tile 1,071 -> 571
    # (77 reloads and 39 stores -> none), cold loop 948 -> 952. Measured on an H100 (sixteenth session,
    # window 256): fp4 B=1,024 2K / B=64 32K / B=256 2K 12: 1.394 / 1.146 / 0.387 ms, 19: 1.395 / 1.145 /
    # 0.386, 20: 1.419 / 1.162; int4 B=1,024 2K / B=256 2K / B=64 32K 3: 1.726 / 0.463 / 1.352, 21: 1.592 /
    # 0.439 / 1.410 (B=1,024 2K and B=64 32K twice, within 0.004 ms). Shorter loops, no faster for fp4;
    # int4 mixed: the defaults stay.
    dict(_D4_AHEAD, num_stages=2, tail_n=16, tail_keys_as_rows=True),
    dict(_D4_AHEAD, num_stages=2, tail_n=32, tail_keys_as_rows=True),
    dict(_D4_ROWS_1, maxnreg=168, value_quads=True, tail_keys_as_rows=True),
    # 21 in 16-key ring tiles. 21's turned 32-key tiles take 16 KB of shared memory a program (int4's
    # default 4 KB; 12 one-warp programs an SM, so 192 KB against 48 KB, less left for L1), a possible
    # cause of its B=64 32K loss where the ring is under 1% of the keys; 16-key tiles take 8 KB, as fp4's
    # default does (offline: ring loop 402 instructions a 16-key tile, cold loop 952). Measured on an H100
    # (seventeenth session, window 256), 3 / 22: B=256 2K 0.462 / 0.431-0.433 ms, B=1,024 2K 1.714-1.724 /
    # 1.542-1.545, B=64 32K 1.351 / 1.351, B=256 4K 0.782 / 0.752, B=16 4K 0.091 / 0.096: int4's launch
    # from 512 rows at head_dim 128 (`attend.INT4_TURNED_TAIL`).
    dict(_D4_ROWS_1, maxnreg=168, value_quads=True, tail_keys_as_rows=True, tail_n=16),
    # Occupancy against spills (prepared offline, eighteenth session, Triton 3.6 for sm_90): one-warp
    # programs at 168 registers are 12 an SM, 3 warps a scheduler, and the 4-bit loop issues at about
    # 38% of the schedulers' rate at B=64 32K (H200, 1.26 ms against 0.48 for its 952 instructions a
    # 32-key tile at one a cycle), so latency, not instruction count, is the gap. int4's launch from 512
    # rows (22) at 144 registers (14 an SM): cold loop 952 -> 983 instructions, 18 reloads a tile; at
    # 128 (16 an SM): 1,003, 36 reloads, 2 stores. fp4's default (12) at 128: cold loop 975 -> 1,049
    # with 32 reloads, its 16-key ring tile 572 -> 661 with 52 reloads and 45 stores; with the tail
    # turned over (``tail_keys_as_rows``) the ring tile is 548 with 41 / 19 (B=1,024 2K). Measured (H200,
    # window 256; B=64 32K / B=256 2K / B=1,024 2K): int4 22 1.258 / 0.400 / 1.394 ms, 23 1.425 / 0.437 /
    # 1.529, 24 1.200 / 0.345 / 1.304 (int4's launch from 512 rows on an H200 since,
    # `attend.INT4_TURNED_MAXNREG`; on an H100 it lost); fp4 12 1.095 / 0.335 / 1.213, 16 1.150 / 0.382 /
    # 1.324, 25 1.316 / 0.410 / 1.458, 26 1.292 / 0.375 / 1.411.
    dict(_D4_ROWS_1, maxnreg=144, value_quads=True, tail_keys_as_rows=True, tail_n=16),
    dict(_D4_ROWS_1, maxnreg=128, value_quads=True, tail_keys_as_rows=True, tail_n=16),
    dict(_D4_AHEAD, num_stages=2, tail_n=16, maxnreg=128),
    dict(_D4_AHEAD, num_stages=2, tail_n=16, maxnreg=128, tail_keys_as_rows=True),
    # int4 codes with their FP16 offsets (``magic_codes``, `decode4._cold_tile4`; prepared offline,
    # twentieth session, Triton 3.6 for sm_90): the packed decoding's subtractions (HADD2 136 -> 16 a
    # 32-key tile) go; the scores' product starts from minus the offsets times the query (8 more HMMA),
    # the value parts from minus the offsets times the weights' column sums. Cold loop a tile, int4's
    # launch from 512 rows (22, 168 registers): 952 -> 885 instructions at B=64 32K and B=256 2K, no
    # spills either way; at the H200's 128 registers (24): 1,003 -> 962, but reloads 36 -> 48 and spill
    # stores 2 -> 13. Below 512 rows (3's shape, int4's launch there, B=16 4K): 951 -> 881 (29). H100
    # (twenty-first session, window 256): 22 / 27 at B=64 32K 1.342 / 1.353 ms, off; the sweep's other
    # pairs ran with it on both sides (it leaked from 27 into later variants, since fixed: `apply`).
    dict(_D4_ROWS_1, maxnreg=168, value_quads=True, tail_keys_as_rows=True, tail_n=16, magic_codes=True),
    dict(_D4_ROWS_1, maxnreg=128, value_quads=True, tail_keys_as_rows=True, tail_n=16, magic_codes=True),
    dict(_D4_ROWS_1, maxnreg=168, value_quads=True, magic_codes=True),
]


def picked(variants: list[dict], env: str) -> list[dict]:
    """The variants at the indices the environment variable ``env`` lists (e.g. "0,4"), all without it."""
    if not os.environ.get(env):
        return variants
    return [variants[int(i)] for i in os.environ[env].split(",")]


# SWEEP_4BIT (environment): indices into DECODE_4BIT, e.g. "3,4,5": only those 4-bit variants.
DECODE_4BIT = picked(DECODE_4BIT, "SWEEP_4BIT")
# SWEEP_GEOMETRY (environment): an `attention_gpu.GEOMETRIES` key, the 8B layer ("8b") by default.
GEOMETRY = os.environ.get("SWEEP_GEOMETRY", "8b")
# SWEEP_KINDS (environment): the kinds swept, "decode,extend" by default.
KINDS = os.environ.get("SWEEP_KINDS", "decode,extend").split(",")
# SWEEP_WINDOW (environment): the ring's recent window of the built strata (`attention_gpu.WINDOW`, 128).
if os.environ.get("SWEEP_WINDOW"):
    bench.WINDOW = int(os.environ["SWEEP_WINDOW"])
# Decode cases (batch, context): the 32K long-context pair and the serving step (B=256, 2K).
DECODE_CASES = [(64, CONTEXT), (1, CONTEXT), (256, 2048)]
if os.environ.get("SWEEP_CASES"):  # e.g. "1x2048,1x32768": these (batch, context) cases instead
    DECODE_CASES = [(int(b), int(n)) for b, n in (c.split("x") for c in os.environ["SWEEP_CASES"].split(","))]

# (kind, codec, batch, context, launch shape)
# Coded history's dequantizing variants follow the codec's others (each output is checked against
# the codec's first variant).
VARIANTS = [("extend", "bf16", 1, CONTEXT, s) for s in EXTEND]
VARIANTS += [("extend", "fp8_e4m3", 1, CONTEXT, s) for s in EXTEND + EXTEND_DEQUANT]
# int4's keeps the 4-bit entry's blocks (the flash kernel ignores them; chunks of one query block keep
# the codes and read them by blocks).
_DEQUANT_4BIT = [dict(s, by_blocks=True, blocks=4) for s in EXTEND_DEQUANT]
VARIANTS += [("extend", "int4", 1, CONTEXT, s) for s in EXTEND_4BIT + _DEQUANT_4BIT]
# BF16 history shares FP8's launch table entry (left out by SWEEP_CODECS=fp8_e4m3), with its own variants.
# SWEEP_FP8 (environment): indices into DECODE, e.g. "0,4": only those FP8 variants.
VARIANTS += [("decode", "fp8_e4m3", b, n, s) for b, n in DECODE_CASES for s in picked(DECODE, "SWEEP_FP8")]
VARIANTS += [("decode", "bf16", b, n, s) for b, n in DECODE_CASES for s in DECODE_BF16]
VARIANTS += [("decode", "int8", b, n, s) for b, n in DECODE_CASES if b > 1 for s in DECODE_INT8]
VARIANTS += [("decode", c, b, n, s) for c in FOUR_BIT for b, n in DECODE_CASES for s in DECODE_4BIT]
# Compiled by --warm too: the default shapes of every codec `attention_gpu.py` times.
WARM = VARIANTS + [("decode", c, b, n, None) for c in bench.CODECS for b, n in DECODE_CASES]
WARM += [("extend", c, 1, CONTEXT, None) for c in ("bf16", "fp8_e4m3", "int4")]
VARIANTS = [v for v in VARIANTS if v[0] in KINDS]
WARM = [v for v in WARM if v[0] in KINDS]
if os.environ.get("SWEEP_CODECS"):  # e.g. "int4,fp4_e2m1": only these codecs' variants
    CODECS = os.environ["SWEEP_CODECS"].split(",")
    VARIANTS = [v for v in VARIANTS if v[1] in CODECS]
    WARM = [v for v in WARM if v[1] in CODECS]


def case(kind: str, codec: str, batch: int, context: int = CONTEXT):
    hq, hkv, d = bench.GEOMETRIES[GEOMETRY]
    tokens = CHUNK if kind == "extend" else 1
    cache, plan, q, k, v, moved = bench.build(codec, batch, context, hq, hkv, d, tokens=tokens)
    return (0, plan, q, k, v, 1 / math.sqrt(d), cache.pool, cache.ring, None), moved


def entry(kind: str, codec: str) -> tuple[str, bool | str]:
    """The launch table entry a variant of ``codec`` uses: (kind, 4-bit codes) for decode, (kind,
    `extend_kind`) for extend."""
    if kind == "decode":
        return kind, codec in FOUR_BIT
    fmt = kernel_format(get_codec(codec))[0]
    return kind, kernels.extend_kind(fmt, fmt)


def table_of(key: tuple[str, bool | str]) -> dict:
    kind, which = key
    return (kernels.EXTEND_LAUNCH if kind == "extend" else kernels.DECODE_LAUNCH)[which]


# The launch table entries as shipped: a variant goes over these, not over the variant before it.
SHIPPED = {("decode", w): dict(e) for w, e in kernels.DECODE_LAUNCH.items()}
SHIPPED |= {("extend", w): dict(e) for w, e in kernels.EXTEND_LAUNCH.items()}


def use(kind: str, codec: str, launch: dict | None) -> None:
    if launch is not None:
        apply(entry(kind, codec), launch)


def apply(key: tuple[str, bool | str], launch: dict) -> None:
    """Set launch table entry ``key`` to ``launch`` over the shipped entry (a key the variant leaves out
    is the shipped one, not the previous variant's); a decode variant's ``wide_programs`` goes to
    `attend.FP8_WIDE_PROGRAMS` (from how many programs FP8 history takes `attend.FP8_WIDE_DECODE`),
    its ``wide`` over `attend.FP8_WIDE_DECODE`'s own entries (which win over the table's), its
    ``raw_many_programs`` to `attend.RAW_MANY_PROGRAMS`, its ``wide_formats`` to
    `attend.WIDE_DECODE_FORMATS`. Those module rules are set only by a variant that names them and
    otherwise keep what the last one set (the variant lists name them in every variant of an entry
    or in none)."""
    launch = dict(launch)
    if key == ("decode", True):  # a 4-bit variant runs as written, int4 too: not `attend.INT4_DECODE`,
        kernels.INT4_DECODE = {}  # nor, from 512 rows, its turned tail or the card's register cap
        kernels.INT4_TURNED_TAIL = {}
        kernels.INT4_TURNED_MAXNREG = {}
        kernels.FP4_UNCAPPED_MAX_PAGES = {}  # nor fp4's uncapped short tables
    if "wide_programs" in launch:
        kernels.FP8_WIDE_PROGRAMS = launch.pop("wide_programs")
    if "raw_many_programs" in launch:
        kernels.RAW_MANY_PROGRAMS = launch.pop("raw_many_programs")
    if "wide_formats" in launch:
        kernels.WIDE_DECODE_FORMATS = tuple(launch.pop("wide_formats"))
    if key == ("decode", False):  # the entry whose wide shape it is
        kernels.FP8_WIDE_DECODE = {**WIDE_DECODE, **launch.pop("wide", {})}
    table = table_of(key)
    table.clear()
    table.update(SHIPPED[key], **launch)


def warm(index: int) -> None:
    """Compile one variant. A decode variant at B=64 runs on B=4 with the split count B=64 would get
    (same specializations: 16-byte aligned length rows, the same split arguments) at a fraction of
    the memory."""
    kind, codec, batch, context, launch = WARM[index]
    use(kind, codec, launch)
    args, _ = case(kind, codec, 4 if batch >= 64 else batch, context)
    splits = None
    if kind == "decode" and batch >= 64:
        plan = args[1]
        launch = dict(kernels.DECODE_LAUNCH[codec in FOUR_BIT])
        hkv, n_pages = bench.GEOMETRIES[GEOMETRY][1], plan.page_table.shape[1]
        fmt = kernel_format(get_codec(codec))[0]
        least = launch.get("min_pages", kernels.MIN_PAGES_PER_SPLIT)
        if kernels.takes_wide_decode(fmt, fmt, batch * hkv, n_pages, None, least, bench.P):
            launch.update(kernels.FP8_WIDE_DECODE)  # the shape `batch` gets, at B=4 too
            kernels.FP8_WIDE_PROGRAMS = 0
            least = launch.get("min_pages", least)
        elif kernels.takes_raw_many_decode(fmt, fmt, batch * hkv, True, 2):  # BF16: its shape at B=4 too
            kernels.RAW_MANY_PROGRAMS = 0
        elif kernels.takes_int8_decode(fmt, fmt, bench.GEOMETRIES[GEOMETRY][2], bench.P, launch):
            launch.update(kernels.INT8_DECODE)  # its programs target, as `attend.pass_launch` takes it
        splits = kernels._num_splits(batch * hkv, n_pages, launch["programs"], least)
    kernels.attend_group(*args, splits=splits)
    torch.cuda.synchronize()


_REPORTED: set[int] = set()


def compiled_report() -> str:
    """Registers, spills and shared memory of the attention kernels compiled since the last call
    (Triton's per-device kernel caches; empty where this Triton keeps them elsewhere)."""
    from kvstrata.radix.kernels import decode, decode4, extend

    got = []
    kernels_run = (decode._decode_kernel, decode4._decode4_kernel, kernels._attend_kernel)
    try:
        for fn in (*kernels_run, kernels._extend_kernel, extend._flash_extend_kernel):
            for cache in getattr(fn, "device_caches", {}).values():
                compiled = cache[0] if isinstance(cache, tuple) else cache
                for k in list(compiled.values()):
                    if id(k) not in _REPORTED:
                        _REPORTED.add(id(k))
                        k._init_handles()
                        shared = k.metadata.shared
                        got.append(f"{k.name}: {k.n_regs} regs, {k.n_spills} spills, {shared} B shared")
    except Exception as e:  # noqa: BLE001  (a report, never a failure)
        got.append(f"{type(e).__name__}: {e}")
    return "; ".join(got)


def sdpa(kind: str, batch: int, context: int) -> float:
    hq, hkv, d = bench.GEOMETRIES[GEOMETRY]
    fn, _ = bench.sdpa_case(batch, context, hq, hkv, d, tokens=CHUNK if kind == "extend" else 1)
    return bench.bench(fn)


def sweep() -> dict[tuple[str, bool | str], dict]:
    """Time every variant; returns the fastest shape of each launch table entry (`entry`), by the sum
    of its milliseconds over the swept batches."""
    rows = []
    base: dict[tuple[str, int, int], float] = {}
    built = first = None
    for kind, codec, batch, context, launch in VARIANTS:
        if (kind, batch, context) not in base:
            base[kind, batch, context] = sdpa(kind, batch, context)
            print(f"SDPA bf16 {kind} B={batch} {context}: {base[kind, batch, context]:.3f} ms", flush=True)
        if built is None or built[0] != (kind, codec, batch, context):
            built = first = None
            torch.cuda.empty_cache()
            built = ((kind, codec, batch, context), *case(kind, codec, batch, context))
        _, args, moved = built
        use(kind, codec, launch)
        ratio = base[kind, batch, context]
        # A variant that fails to run, or disagrees with the case's first variant beyond BF16 rounding,
        # is reported and left out.
        try:
            out = kernels.attend_group(*args).float()
        except Exception as e:  # noqa: BLE001  (a compile or launch failure of one variant)
            print(f"  {kind} B={batch} {codec} {launch}: FAILED {type(e).__name__}: {e}", flush=True)
            continue
        first = out if first is None else first
        err = ((out - first).norm() / first.norm()).item()
        if not err < 2e-2:
            print(f"  {kind} B={batch} {codec} {launch}: WRONG (rel. error {err:.3g})", flush=True)
            continue
        ms = bench.bench(partial(kernels.attend_group, *args))
        rows.append((kind, codec, batch, context, launch, ms, moved, ratio / ms))
        print(f"  {kind} B={batch} {context} {codec} {launch}: {ms:.3f} ms x{ratio / ms:.2f}")
        print(f"    compiled: {compiled_report()}", flush=True)
    head = "kind | B | context | codec | block_m x n | warps | stages | by blocks (n) | ms | TB/s | vs SDPA"
    print(f"\n| {head} |")
    print("|---|---:|---:|---|---|---:|---:|---|---:|---:|---:|")
    for kind, codec, batch, context, s, ms, moved, ratio in rows:
        blocks = f"yes ({s['blocks']})" if s["by_blocks"] else ("no, prefetch" if s["prefetch"] else "no")
        blocks += f", {s['programs']} programs" if kind == "decode" else ""
        blocks += ", fp16 codes" if s["f16_codes"] else ""
        blocks += ", swap_ab" if s.get("swap_ab") else ""
        blocks += f", maxnreg {s['maxnreg']}" if s.get("maxnreg") else ""
        blocks += ", halves" if s.get("halves") else ""
        blocks += ", attend kernel" if kind == "decode" and s.get("module") == "attend" else ""
        blocks += ", extend kernel" if kind == "extend" and s.get("module") == "extend" else ""
        blocks += ", dequantized first" if kind == "extend" and s.get("dequant_bytes") else ""
        blocks += ", tail by parts" if kind == "decode" and not s.get("merged_tail", True) else ""
        blocks += ", tail apart" if kind == "decode" and s.get("tail_apart") else ""
        int8_rows = codec == "int8" and s.get("int8_rows")
        blocks += ", int8 rows (16-key tiles)" if int8_rows else ""
        blocks += (
            f", int8 keys by {s['blocks']} blocks" if s.get("scaled_keys_by_blocks") and not int8_rows else ""
        )
        blocks += ", decode4" + (" asm" if s.get("asm") else "") if s.get("module") == "decode4" else ""
        blocks += ", folded key scales" if s.get("fold_key_scales") else ""
        blocks += ", heads together" if s.get("heads_together") else ""
        blocks += ", tail rows" if s.get("tail_rows") else ""
        blocks += ", value offsets apart" if s.get("value_offsets_apart") else ""
        blocks += f", fp8 wide from {s['wide_programs']} programs" if "wide_programs" in s else ""
        blocks += ", BF16 wide too" if 0 in s.get("wide_formats", ()) else ""
        blocks += {True: ", codes asm", "values": ", values asm"}.get(s.get("codes_asm"), "")
        blocks += ", lazy rescale" if s.get("lazy_rescale") else ""
        blocks += {True: ", fp8 dots", "keys": ", fp8 key dots"}.get(s.get("fp8_dot"), "")
        blocks += ", keys as rows" if s.get("keys_as_rows") else ""
        blocks += ", value reference" if s.get("value_reference") else ""
        blocks += ", value quads" if s.get("value_quads") else ""
        blocks += ", table ahead" if s.get("table_ahead") else ""
        blocks += ", ring ahead" if s.get("ring_ahead") else ""
        blocks += ", wide scales" if s.get("wide_scales") else ""
        blocks += f", {s['tail_n']}-key tail tiles" if s.get("tail_n", 32) != 32 else ""
        blocks += ", tail turned over" if s.get("tail_keys_as_rows") else ""
        blocks += f", wide shape with {s['wide']}" if s.get("wide") else ""
        print(
            f"| {kind} | {batch} | {context} | {codec} | {s['block_m']} x {s['block_n']} | "
            f"{s['num_warps']} | "
            f"{s['num_stages']} | {blocks} | {ms:.3f} | {moved / ms / 1e9:.2f} | {ratio:.2f}x |"
        )
    total: dict[tuple, float] = {}
    timed: dict[tuple, int] = {}
    shapes: dict[tuple, dict] = {}
    for kind, codec, _, _, s, ms, _, _ in rows:
        if codec in ("int8", "bf16"):  # their variants would set the entry FP8 shares
            continue
        key = (entry(kind, codec), repr(s))  # a variant's ``wide`` is a dict: not hashable itself
        shapes[key] = s
        total[key] = total.get(key, 0.0) + ms
        timed[key] = timed.get(key, 0) + 1
    # Only shapes that ran in every case of their entry (a failure at one batch is no saving).
    most = {k[0]: max(n for kk, n in timed.items() if kk[0] == k[0]) for k in timed}
    best: dict[tuple[str, bool | str], dict] = {}
    for key in sorted(total, key=total.get, reverse=True):
        if timed[key] == most[key[0]]:
            best[key[0]] = shapes[key]
    print("\nfastest shapes (table entry): " + "; ".join(f"{k}: {v}" for k, v in best.items()), flush=True)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--warm", type=int, help="compile variant WARM only")
    ap.add_argument("--count", action="store_true", help="print the number of variants")
    ap.add_argument(
        "--then-bench",
        nargs=argparse.REMAINDER,
        help="then run attention_gpu.py (these arguments) with the fastest shapes",
    )
    args = ap.parse_args()
    if args.count:
        print(len(WARM))
    elif args.warm is not None:
        warm(args.warm)
    else:
        best = sweep()
        if args.then_bench is not None:
            for which, launch in best.items():
                apply(which, launch)
            sys.argv = ["attention_gpu.py", *args.then_bench]
            bench.main()


if __name__ == "__main__":
    main()
