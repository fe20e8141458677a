"""Triton attention over the strata: cold pages decoded in registers, the sink page, ring rows, new tokens.

One program takes ``BLOCK_M`` query rows of one sequence and one KV head; rows are (token, query head
of the group) so a KV head's keys are read once for all the query heads that share it (GQA). It walks
the sequence's keys in the order the torch reference concatenates them: cold pages through the page
table (codes + scales decoded by `kvstrata.quant.kernel_decode`), the sink page, the ring rows, then
the step's new tokens (causal among themselves), with one online softmax in float32. Q·K and P·V run
on the tensor cores in the model dtype (BF16 in, float32 accumulate; IEEE float32 for a float32 model).

Cold pages are read one of two ways (the launch table's ``by_blocks``). By keys across pages
(`_cold_tile`; 8/16-bit codes, and pages that are not a multiple of 16 tokens): codes with one scale
per key go straight into the dot, FP8 key exponents multiply the score columns and value scales the
softmax weights. By whole 16-token blocks (4-bit codes): a key block's per-channel scales load once
and broadcast over its tokens, value scales fold into the softmax weights, and 4-bit codes load once
per byte, their low/high nibbles being the even/odd channels; q and the output are then split into
even/odd channel halves (``HALF_K``/``HALF_V``) instead of interleaving codes.

Split-KV: when a step has too few (sequence, head) pairs to fill the GPU (decode at small batch), the
cold pages of each sequence are cut into ``splits`` ranges; each program writes its partial output
and log-sum-exp, and `merge_partials` (a second kernel) combines them, or, where the partials fit the
launch's ``merge_reads`` chunks, the decode kernel itself: the last program of each sequence and KV
head to finish merges them (`merge_if_last`). The last split also reads sink, ring and new tokens, so
every row has at least one key in it.

One pass per cold pool: image pages kept in a pool of their own (``image_pool``, the vision codec) are
read by a second launch of the same kernel over the group's image page table (`GroupPlan.image_plan`),
which reads no sink, ring or new token (``tail_split`` -1). Both passes write split partials and one
log-sum-exp merge combines them. The raised pool (the drift fallback's wider codecs) is one more entry
in `_cold_passes` (`GroupPlan.raised_plan`), read the same way.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple
from weakref import WeakKeyDictionary

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kvstrata.quant.kernel_decode import (
    fp4_value_codes,
    fp8_value,
    kernel_format,
    key_block_scales,
    load_decoded,
    pow2_scale,
    tile_codes,
    value_tile_scales,
)
from kvstrata.radix.attention import layer_kv
from kvstrata.radix.kernels.jit import jit_unspecialized
from kvstrata.radix.plan import GroupPlan, StepBatch
from kvstrata.radix.pool import ColdPool, as_raw
from kvstrata.radix.ring import HotRing
from kvstrata.radix.sinks import SinkStore

LOG2E = 1.4426950408889634
# Launch shapes by [4-bit codes in the layer] (H200, Triton 3.6, fastest of benchmarks/attention_sweep.py):
# query rows, keys per tile (ring, sinks, new tokens; cold pages read by keys), 16-token cold blocks
# per tile, and ``by_blocks``: cold pages read by 16-token blocks (`kernel_decode`'s block functions,
# pages of a multiple of 16 tokens) rather than by keys across pages (`_cold_tile`). 8/16-bit codes
# read by keys, 128 a tile (FP8 decode at B=64, 32K: 1.73 ms against 2.32 by 4 blocks); 4-bit codes
# by blocks (bytes loaded once, twice as many blocks a tile as their pages are half the bytes).
# ``programs``: the split-KV target, about this many programs a decode launch (a few per SM on an
# H100/H200; more splits also even out the last wave when B * heads programs do not fill a whole
# number of waves).
# ``f16_codes``: 8-bit codes (FP8, int8) enter the dots as FP16, q cast to it (BF16 models; the
# value weights normalised per tile, see `_cold_tile`): FP8 -> FP16 is one instruction per two codes
# where FP8 -> BF16 goes through float32 (H200: FP8 decode at B=64, 32K 1.70 ms, against 1.74 with
# BF16 operands in the previous revision's run; FP8 extend 4.90 ms against 5.34).
# Decode with ``by_blocks`` off runs `kvstrata.radix.kernels.decode` (``module`` "attend": this module's
# kernel, the same loop; H200, FP8 at B=64, 32K: 1.684 against 1.690 ms in one run). ``min_pages``:
# the fewest cold pages a split reads (H200, FP8 at B=1, 32K: splits of 32 pages 0.046 ms, of 16
# pages 0.061; B=64 keeps its 2 splits: 1.684 ms against 1.854 unsplit). ``swap_ab``, ``halves``
# and ``maxnreg``: see `decode.decode_options` (``swap_ab`` and ``halves`` slower on the H200,
# `attention_sweep.py`). ``maxnreg`` 168 (the 8-bit entry): 3 programs an SM instead of 2 despite
# spills (H200, FP8: B=64 at 32K 1.562 ms against 1.602 uncapped, B=256 at 2K 0.418 against 0.483,
# B=1 at 32K 0.045 against 0.043; docs/kernels-h200.md, pass 6).
# ``merged_tail``: the decode module reads the sink page, ring rows and new key as one run of tiles.
# ``scaled_keys_by_blocks``: int8 keys (per-channel scales over a page) read by ``blocks`` 16-token
# blocks a tile, their scale vectors loaded once per block, instead of by keys with a scale gathered
# per element (H200, int8 at B=64, 32K: 2.221 ms against 3.729; 4 blocks 2.970).
# ``tail_apart``: a split-KV decode launch that stays within ``programs`` gives the sink page, ring
# rows and new key a split of their own instead of adding them to the last cold split (B=1 at 32K:
# 64 splits of 4 cold tiles each, the last no longer 5 or 6).
# ``codes_asm`` and ``lazy_rescale`` (absent: off): pass 9's FP8 options of the decode module, see
# `decode.fp8_options` (docs/kernels-h200.md, pass 9; `attention_sweep.py` times them).
DECODE_LAUNCH = {
    False: dict(
        block_m=64,
        block_n=128,
        blocks=8,
        num_warps=4,
        num_stages=2,
        by_blocks=False,
        prefetch=False,
        programs=1024,
        f16_codes=True,
        swap_ab=False,
        halves=False,
        maxnreg=168,
        module="decode",
        min_pages=32,
        # Pass 15 (`split_floor`): a launch that splits into fewer than ``fill_programs`` programs at
        # ``min_pages`` splits further, down to ``fill_pages``. H200, 8B layer, B=1 at 4K (8 KV heads,
        # 247 cold pages), FP8: splits of 32 pages (56 programs) 14.7 us, 16 pages 11.8, 8 pages 10.9
        # (SDPA BF16 11.8-12.0); B=1 at 32K (the wide shape, 512 programs) and B=16 at 4K (1,024) slower
        # with smaller splits (30.4-35.8 against 31.0 us, 55.5 against 48.9; attention_gpu.py, one run).
        fill_programs=256,
        fill_pages=8,
        merged_tail=True,
        scaled_keys_by_blocks=True,
        tail_apart=True,
        merge_reads=2,
        # Pass 13 (`decode.decode_options`, FP8 keys and values of a BF16 model only): key and value
        # codes read as uint16 channel pairs, the products turned over (k . q^T over 8 query rows), so
        # both operands load by ldmatrix (cold loop a 32-key tile on the wide shape, Triton 3.6 for
        # sm_90: 968 -> 567 instructions). H200, FP8: B=64 at 32K 1.006 ms against 1.160, B=256 at 2K
        # 0.288 against 0.325, B=1,024 at 2K 1.093 against 1.244, B=1 at 32K 0.037 against 0.046; value
        # codes alone so (``value_pairs``) 1.008 / 0.291 / 1.099 / 0.041 (attention_sweep.py, one run;
        # docs pass 13).
        keys_as_rows=True,
        int8_rows=True,  # int8 keys and values take `INT8_DECODE` (off: this entry by blocks, as before)
    ),
    # 4-bit layers (int4/fp4 keys and values) decode by `kvstrata.radix.kernels.decode4` (``module``
    # "decode4"; `decode4.applies`; other 4-bit layers by blocks in this module's kernel): ``blocks``
    # 16-token blocks a tile, packed PTX nibble decoding (``asm``), the keys' scales folded into the
    # query once per block (``fold_key_scales``), one warp a program and four times the programs
    # (H200, B=64, 32K: int4 1.79 ms and fp4 1.99 against 3.37 / 3.13 for pass 5's 4 warps at 128
    # registers without folding, 2.51 / 2.36 folded with 4 warps), the tail in a split of its own
    # where the programs allow (B=1: 32K 0.066 ms against 0.073-0.077, 2K 0.048 against 0.062-0.065;
    # splits of 8 or 4 pages were slower at 32K); docs/kernels-h200.md pass 7.
    # Pass 8 (`decode4.decode4_options`): ``heads_together`` (consecutive programs are one sequence's
    # KV heads), ``tail_rows`` (the decode tail's rows loaded whole), ``value_offsets_apart`` (int4
    # value offsets added once after the cold tiles), together: H200, int4 / fp4, B=256 at 2K 0.509 /
    # 0.499 ms against 0.748 / 0.800, B=1,024 at 2K 1.803 / 1.883 against 2.916 / 3.210, B=64 at 32K
    # 1.880 / 1.848 against 1.790 / 2.013 (attention_sweep.py, one run).
    True: dict(
        block_m=64,
        block_n=32,
        blocks=2,
        num_warps=1,
        num_stages=2,
        by_blocks=True,
        prefetch=False,
        programs=4096,
        f16_codes=False,
        swap_ab=False,
        halves=False,
        # Pass 12: 168 registers (12 one-warp programs an SM instead of 8; with ``value_quads`` fp4's
        # two-stage loop keeps within them, int4 takes one stage, `INT4_DECODE`).
        maxnreg=168,
        module="decode4",
        min_pages=16,
        # Pass 15 (`split_floor`), H200, 8B layer, B=1 at 4K: int4 / fp4 splits of 16 pages (120
        # programs) 28.5 / 26.7 us, of 8 pages 23.3 / 20.0, of 4 pages 24.4 / 21.3; splits of 8 pages
        # slower at B=1 32K (1,016 programs at 16 pages: 50.0 against 40.5 us) and B=16 4K (76.3
        # against 71.7; attention_gpu.py, one run).
        fill_programs=256,
        fill_pages=8,
        merged_tail=True,
        tail_apart=True,
        merge_reads=0,  # fp4: merged apart (pass 14: B=64 32K 1.213 ms in the kernel against 1.197); int4 2
        asm=True,
        fold_key_scales=True,
        heads_together=True,
        tail_rows=True,
        value_offsets_apart=True,
        # Pass 9 (`decode4.decode4_options`): ``keys_as_rows`` (scores k . q^T: the query side 8
        # columns, not 16 padded rows), ``value_reference`` (the accumulator in units of a running
        # value scale). H200, fp4: B=64 at 32K 1.529 ms against 1.839, B=256 at 2K 0.415 against
        # 0.499, B=1,024 at 2K 1.537 against 1.874 (attention_sweep.py, one run; docs pass 9).
        keys_as_rows=True,
        value_reference=True,
        # Pass 12: ``value_quads`` (the value codes as 16-bit elements: P.V's operand by a transposing
        # ldmatrix, no byte gathering; and fp4's PTX decoding, 18 -> 11 instructions an instance, in
        # every launch). H200, fp4 with 168 registers: B=64 at 32K 1.198 ms against 1.528 before the
        # pass, B=256 at 2K 0.354 against 0.415, B=1,024 at 2K 1.271 against 1.540; int4 (its one
        # stage) 1.268 / 0.385 / 1.387 against 1.325 / 0.403 / 1.426 (attention_sweep.py, one run).
        value_quads=True,
        # Pass 17 (`decode4.decode4_options`): the page-table entries, small scale words and ring rows a
        # tile ahead (``table_ahead``), so a tile's scale loads and code copies issue at its top instead
        # of after a wait for its entries (at these two stages the compiled loop still waits for all its
        # copies at the top of each tile, ``DEPBAR`` 0x0: the gain is not copies in flight through the
        # tile), and the ring in 16-key tiles (``tail_n``: its 32-key tiles spill, 56 reloads a tile).
        # H200, fp4: B=64 at 32K 1.099 ms against 1.204, B=256 at 2K 0.316 against 0.357, B=1,024 at 2K
        # with issue 12's 256-token window 1.192 against 1.346; at three stages 1.137 / 0.336 / 1.218;
        # 16-key ring tiles alone 1.205 / 0.341 / 1.264; the table ahead at three stages with 32-key ring
        # tiles 1.636 / 0.470 ms, 1.739 at B=1,024 (attention_sweep.py, two runs; docs pass 17).
        table_ahead=True,
        tail_n=16,
    ),
}
# Pass 17's keys of `DECODE_LAUNCH[True]` back at pass 12's values (`decode4_launch`), for the 4-bit
# layers measured without them: int4 (H200, B=64 at 32K: ``table_ahead`` at three stages 3.151 ms, with
# 16-key ring tiles 1.878, against 1.266 at its one stage; 16-key ring tiles alone at one stage 1.286,
# and 1.356 against 1.389 at B=1,024 2K), layers of int4 keys and fp4 values or the reverse (``kv_plan``
# raises failing fp4 keys to int4; not measured), the other 4-bit layers and heads wider than
# `DECODE4_CAPPED_HEAD_DIM` (not measured).
DECODE4_PASS12 = dict(table_ahead=False, tail_n=32)
# 4-bit decode layers `decode4` does not read (one side 8/16-bit, or head_dim not a power of two): the
# shape this kernel had by blocks before pass 7 (4 warps, 128 registers; one warp is tuned for decode4).
OTHER_4BIT_DECODE = dict(DECODE4_PASS12, blocks=4, num_warps=4, programs=1024, maxnreg=128, tail_apart=False)
# FP8 history (keys and values E4M3/E5M2) where a step has at least ``FP8_WIDE_PROGRAMS`` programs once split
# as this shape splits them (`takes_wide_decode`; before pass 13: before splitting): one warp a program,
# 32-key tiles, four times the programs, no register cap (255 registers, no spills, 8 programs an SM). H200,
# B=64 at 32K 1.300 ms against 1.573 for the 4-warp shape, B=256 at 2K 0.355 against 0.430, B=1,024 at 2K
# 1.416 against 1.580 (attention_sweep.py, one run; docs pass 8). Pass 11: three stages with the page-table
# entries a tile ahead (``prefetch``): at two stages Nsight Compute put 30% of the warps' stall samples on the
# wait for the tile's own copies; H200, B=64 at 32K 1.192 ms against 1.299, B=256 at 2K 0.337 against 0.356,
# B=1,024 at 2K 1.275 against 1.418 (three stages alone were slower: 1.502 / 0.404 / 1.663;
# attention_sweep.py, one run; docs pass 11). With ``prefetch`` the FP8 scale exponents come a tile ahead too
# (`decode.bits_ahead`; launch key ``bits_ahead``, absent: on): 1.202 / 0.333 / 1.303 against 1.246 / 0.341 /
# 1.316 without, in a second run.
# ``heads_together`` (a sequence's KV heads in consecutive programs; H200, attention_sweep.py, one run,
# 2026-12-04): B=256 at 2K 0.279 ms against 0.289, B=1,024 at 2K 1.019 against 1.089, B=64 at 32K
# 0.971 against 0.999.
FP8_WIDE_DECODE = dict(
    block_n=32, num_warps=1, num_stages=3, prefetch=True, programs=4096, maxnreg=None, heads_together=True
)
# Symmetric int8 keys and values (``int8_rows`` in `DECODE_LAUNCH[False]`, `decode._int8_rows_tile`):
# FP8's wide shape in 16-key tiles, one a page's block, so that a tile's keys share one key-scale vector
# (put on the decoded codes in FP16); the codes read as uint16 channel pairs in FP8's
# ``keys_as_rows`` layout. Before it int8 decoded in `_attend_kernel` by blocks (H200, B=64 at 32K: 2.221
# ms, 0.86x SDPA BF16). Measured on an H100 (2026-12-05, sixteenth session; attention_sweep.py, SDPA BF16
# 2.773 / 0.708 / 0.098 ms): B=64 at 32K 1.684 ms against 2.321 by blocks, B=256 at 2K 0.472 against 0.631,
# B=16 at 4K 0.069 against 0.092 (94% / 90% / 83% of SDPA's bandwidth; docs pass 18-19 measured).
INT8_DECODE = dict(FP8_WIDE_DECODE, block_n=16, scaled_keys_by_blocks=False, keys_as_rows=True)
# int4 keys and values (`decode4`): one pipeline stage (and 168 registers, as ``DECODE_LAUNCH[True]``
# since pass 12). Pass 9, H200: B=64 at 32K 1.326 ms against 1.689 with fp4's 2 stages and no cap, B=256
# at 2K 0.404 against 0.453, B=1,024 at 2K 1.434 against 1.700 (attention_sweep.py, one run). Pass 12,
# with ``value_quads``: one stage 1.268 / 0.385 / 1.387 ms, two stages 1.502 / 0.403 / 1.474 uncapped,
# 1.540 / 0.436 / 1.566 capped.
INT4_DECODE = dict(DECODE4_PASS12, num_stages=1, maxnreg=168, merge_reads=2)
# int4 at head_dim 128 in launches of many sequence x KV-head rows: the decode tail turned over in
# 16-key tiles (pass 19's ``tail_keys_as_rows``, 8 KB of shared memory a program against 16 KB in
# 32-key tiles). Measured on an H100 (2026-12-05, seventeenth session), 8B layer, against `INT4_DECODE`
# alone in the same run: attention_gpu.py (window 128) B=64 at 4K 0.222 against 0.231 ms, B=256 at 4K
# 0.712 / 0.735, B=64 at 32K 1.350 / 1.368, B=256 at 32K 5.255 / 5.277; attention_sweep.py (window 256)
# B=256 at 2K 0.431 / 0.462, B=1,024 at 2K 1.542 / 1.714, B=64 at 32K 1.351 / 1.351. Not taken below
# 512 rows (B=1 at 4K 0.029 against 0.023 ms; B=16 at 4K mixed across the two benchmarks) nor at
# head_dim 64 (the default model's layer at 4K: 3-15% slower at B=16-256, 56% at B=1).
INT4_TURNED_TAIL = dict(tail_keys_as_rows=True, tail_n=16)
# The register cap of those launches by CUDA device name (`torch.cuda.get_device_name`; tuned per card,
# as SGLang keys its Triton MoE configs), `INT4_DECODE`'s 168 on every other card. 128 registers make 16
# one-warp programs an SM instead of 12 (offline, Triton 3.6 for sm_90: cold loop 952 -> 1,003
# instructions a 32-key tile, 36 reloads). Eighteenth session, 8B layer, against 168 on the same machine:
# - H200, attention_gpu.py twice each way: B=64 at 4K 0.191 against 0.207 ms, B=256 at 4K 0.605 / 0.668,
#   B=64 at 32K 1.181 / 1.262, B=256 at 32K 4.687 and 4.752 / 4.766 and 4.774; attention_sweep.py
#   (window 256) B=256 at 2K 0.345 / 0.400, B=1,024 at 2K 1.304 / 1.394; at 144 registers slower than
#   both (1.425 ms at B=64 32K).
# - H100 80GB HBM3, attention_gpu.py twice each way: B=64 at 32K 1.557 / 1.356 ms, B=256 at 32K 6.472 /
#   5.240, B=256 at 4K 0.744 / 0.718, B=64 at 4K 0.219 / 0.221: a loss, hence per card.
# On the H200 below 512 rows (the 32-key tail) the cap was mixed (B=16 at 32K 0.315 against 0.347 ms,
# B=16 at 4K 0.082 / 0.071, B=1 at 32K 0.044 / 0.040), and at head_dim 64 too (B=64 at 32K 0.257 /
# 0.330, B=256 at 32K 1.154 / 1.100): those keep 168. Names match exactly: an "NVIDIA H200 NVL" or a GH200
# (not measured) keeps 168.
INT4_TURNED_MAXNREG = {"NVIDIA H200": 128}
INT4_TURNED_HEAD_DIM = 128
INT4_TURNED_MIN_ROWS = 512
# The 4-bit decode's register cap (`DECODE_LAUNCH[True]`'s ``maxnreg``, other than int4's) up to this
# head_dim: measured at 128 (the 8B layer) and run at 64; at 256 the capped cold loop spills (an offline
# compile for sm_90 with Triton 3.9, fp4: 70 reloads and 17 stores a tile, 2 reloads uncapped), so wider
# heads run uncapped.
DECODE4_CAPPED_HEAD_DIM = 128
INT4_FORMAT = 5
FP4_FORMAT = 6
# fp4 keys and values at head_dim 128 in 16-token pages run without the register cap (`DECODE_LAUNCH[True]`'s
# 168) where the pass's page table (the cold pages, the ring apart) is at most this many pages wide, by
# CUDA device name (as `INT4_TURNED_MAXNREG`). Under a full CUDA graph the width is the captured class's
# (`full_graph.width_classes`: 32, 64, 128, 256, ... pages), so a value should be one of those classes for
# graph and eager steps to decide alike. Short contexts spend more of the step outside the cold loop (the
# ring tail is an eighth of the keys at 2K with fp4's 256-token window), where the cap's spills cost; at
# long ones the cold loop's 12 programs an SM win. Measured on NVIDIA H100 80GB HBM3 (2026-12-05/06, three
# machines, 8B layer, 16-token pages; ms capped / uncapped throughout), attention_sweep.py at window 256:
# at 2K B=64 0.127 / 0.119, B=128 0.219 / 0.205, B=256 0.382-0.388 / 0.361-0.365, B=512 0.706 / 0.674,
# B=1,024 1.367-1.392 / 1.331-1.347; at 4K B=64 0.211 / 0.198, B=256 0.732 / 0.672; at 8K B=128 0.623 /
# 0.627; at 32K B=64 1.138-1.146 / 1.185-1.190, B=256 4.448 / 4.644. attention_gpu.py at window 128
# (without / with this rule): at 2K B=64 0.119 / 0.113, B=256 0.369 / 0.345, B=1,024 1.354 / 1.275; at 4K
# B=64 0.207 / 0.195 but B=256 0.617 / 0.626. decode_step_gpu.py, fp4 at B=256, 1,536: 20.78 / 19.97 ms a
# step, the same tokens (docs/kernels-h200.md pass 21). Passes over a raised pool or image pages (their
# own, narrower tables) were not measured apart. The H200 is not measured and keeps the cap.
FP4_UNCAPPED_MAX_PAGES = {"NVIDIA H100 80GB HBM3": 256}
FP4_UNCAPPED_PAGE_SIZE = 16
# Pass 13, counted after splitting (`cold_splits`, as the wide launch splits: whole 32-key tiles, so an
# odd split size rounds down and adds a split): at 8 KV heads B=1 takes the wide shape from 2,017 cold
# pages (the 32K step's 2,040: 63 splits of 33 pages, 64 of 32 once rounded, 512 programs), B=16 from 127
# and at 97-99, 103-105, ... (3 splits of an odd size, 4 once rounded; 100 pages: 3 of 34), B=1 at 4K not
# (7 splits, 56 programs). H200, FP8 with ``keys_as_rows``, attention_gpu.py: B=16 at 32K 0.268 ms
# against 0.307 with the 4-warp shape, B=16 at 4K 0.049 against 0.057, B=1 at 32K 0.031 against 0.037
# (counted without the rounding it had missed the rule), B=64 at 4K 0.155 both; the default model's
# geometry B=64 at 4K 0.044 against 0.065, B=16 and B=64 at 32K 0.074 / 0.265 against 0.109 / 0.347
# (docs/kernels-h200.md).
FP8_WIDE_PROGRAMS = 512
WIDE_DECODE_FORMATS = (1, 2)  # the history formats (keys and values) that take `FP8_WIDE_DECODE`
# Model-dtype history of a BF16/FP16 model where a decode pass writes its output itself
# (`takes_raw_many_decode`) and has at least ``RAW_MANY_PROGRAMS`` (sequence, KV head) programs: 64-key
# tiles, three stages, page-table entries a tile ahead, a sequence's KV heads in consecutive programs
# (``heads_together``). The entry's two 64 KB stages of 128 keys leave one program an SM, whose first
# loads and tail tile run with nothing else in flight; three of these share an SM. H200, 8B layer,
# window 16 (attention_sweep.py, one run): B=256 at 2K 0.490 ms against 0.527 (SDPA BF16 0.478), at
# 1,600 tokens 0.395 against 0.427 (0.380); B=64 (512 programs, split in two) loses: at 32K 1.952
# against 1.882, at 4K 0.271 against 0.265. A second run: B=128 / 256 / 512 at 2K 0.261 / 0.489 /
# 0.958 against 0.270 / 0.527 / 1.028, B=256 at 4K and 8K 0.950 / 1.872 against 0.999 / 1.941 (SDPA
# 0.937 / 1.865).
RAW_MANY_DECODE = dict(block_n=64, num_stages=3, prefetch=True, heads_together=True)
RAW_MANY_PROGRAMS = 1024
# Extend, by the layer's codes (`extend_kind`): 128 query rows a tile. BF16/FP32 history ("raw"): the
# flash-shaped kernel of `kvstrata.radix.kernels.extend` (``module`` "extend", docs pass 9), 128 keys a
# tile, 3 stages, page-table entries a tile ahead (H200, 2K chunk over 30K: 2.315 ms = 0.77x SDPA,
# against 2.670 for pass 4's 64-key, 4-stage shape in this module's kernel; attention_sweep.py, one
# run). 8-bit codes by keys in this module's kernel, 128 a tile, 3 stages (FP8 4.947 ms; the extend
# module's best 4.815, without prefetch, not adopted; pass 4's raw shape 9.756). 4-bit by blocks.
# Extend does not split. ``dequant_bytes`` (with ``module`` "extend"): coded history dequantized first
# (`dequantizes`); entries without the key leave it to `EXTEND_DEQUANT`.
# A float32 model's extend keeps pass 4's raw shape in this module's kernel: the flash kernel's 128-key
# tiles of 4-byte K and V over 3 stages would not fit an SM's shared memory at head_dim 128 (not
# measured: no float32 extend was timed on the GPU).
EXTEND_FLOAT32 = dict(block_n=64, num_stages=4, module="decode")
EXTEND_LAUNCH = {
    "raw": dict(
        block_m=128,
        block_n=128,
        blocks=8,
        num_warps=8,
        num_stages=3,
        by_blocks=False,
        prefetch=True,
        programs=0,
        f16_codes=True,
        module="extend",
    ),
    "8bit": dict(
        block_m=128,
        block_n=128,
        blocks=8,
        num_warps=8,
        num_stages=3,
        by_blocks=False,
        prefetch=False,
        programs=0,
        f16_codes=True,
    ),
    "4bit": dict(
        block_m=128,
        block_n=64,
        blocks=4,
        num_warps=8,
        num_stages=2,
        by_blocks=True,
        prefetch=False,
        programs=0,
        f16_codes=False,
    ),
}
# Coded history (8- and 4-bit) in an extend pass of several query blocks a sequence: dequantized to the
# model dtype first (`dequantized_parts`, at most ``dequant_bytes`` of K and V a pass) and read by the
# flash kernel at the raw entry's shape, so the query blocks do not each decode every code again.
# H200, 2K chunk over 30K (attention_sweep.py, one run, SDPA BF16 ~1.77 ms): FP8 2.321 ms against
# 4.912 reading the codes, int4 2.430 against 9.643, BF16 history 2.325. Used where the kind's entry
# names no ``dequant_bytes`` of its own (the sweep's variants do) and not for a float32 model on CUDA
# (`EXTEND_FLOAT32`); the engine's memory plan holds ``dequant_bytes`` back (`memory.step_workspace_bytes`).
EXTEND_DEQUANT = dict(EXTEND_LAUNCH["raw"], dequant_bytes=512 << 20)
HALF_FORMATS = (5, 6)  # 4-bit codes: the decode kernel splits q and the output into even/odd channels
SCALED_KEY_FORMATS = (3, 4)  # int8 keys: per-channel scales (and offsets) over each page
FP8_FORMATS = (1, 2)  # FP8 E4M3 / E5M2 codes
MIN_PAGES_PER_SPLIT = 16
# The most split partials a merge program reads at once (`merge_block`); more are merged in blocks of
# this many. A [BLOCK_S, head_dim] float32 tile in one program: Triton 3.9 for sm_90 at head_dim 128 and 4
# warps, 148 registers at 128 splits, spills from 256 (80 bytes of stack), 5.5 KB of stack a thread
# at 1,024 (a B=1 step of 4-bit history at 128K tokens: 513 splits) and 16 KB at 2,048 (12.6 s to
# compile); H200 warm-up of blocks 1 to 1,024 8.2 s, block 2,048 alone 8.4 s (docs/engine.md). H200,
# 32 query heads, head_dim 128, one block against blocks of 64: 65 splits (B=1 at 32K) 3.6 against 6.9
# us, 513 splits 146 against 35 us, 1,539 407 against 97 us; hence 128, one unlooped block up to 128
# splits: 3 / 9 / 65 splits (B=256 at 2K, B=16 at 4K, B=1 at 32K) 23.9 / 3.9 / 3.5 us against 23.7 / 3.7 /
# 3.3, 129 splits 4.6 against 13.0, 513 splits 5.7 against 151, 1,539 29.8 against 406 (one run each).
MERGE_BLOCK_S = 128
# A decode kernel that merges its own splits (`merge_if_last`) reads this many partial floats a warp
# at a time, 64 a thread (`merge_chunk`). Launch key ``merge_reads``: it does so where the merging
# program reads the partials in at most that many chunks (0: never), else `merge_partials` merges.
# Against the merge launched apart (H200, attention_gpu.py, 8B layer; docs/kernels-h200.md pass 14):
# FP8 at B=64 32K 0.994 ms against 1.019 (1.88x SDPA BF16 against 1.83x), B=16 4K 0.0487 against
# 0.0492, B=1 4K (one chunk of 16 splits, 4 warps) 0.0148 against 0.0153; int4 at B=64 32K 1.256
# against 1.273. Every split count merged in the kernel lost where one-warp programs read 5 chunks or
# more (FP8 B=1 32K, 65 splits in chunks of 4: 0.042 ms against 0.031; fp4 and int4 B=16 4K, 17 splits:
# 0.071 against 0.067), and chunks of 4,096 floats lost at the default model's B=64 4K (0.051 / 0.046).
FUSED_MERGE_FLOATS = 2048
_DOT_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _online(s, m_i, l_i, KEYS_AXIS: tl.constexpr = 1):
    """Online-softmax bookkeeping of one score tile (base 2, masked scores at -inf): the tile's
    weights, the rescale of what came before, and the new running max and sum. ``KEYS_AXIS``: the
    scores' axis of the keys (1: ``[rows, keys]``; 0: transposed, ``[keys, rows]``)."""
    m_new = tl.maximum(m_i, tl.max(s, KEYS_AXIS))
    p = tl.exp2(s - tl.expand_dims(m_new, KEYS_AXIS))
    alpha = tl.exp2(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, KEYS_AXIS)


@triton.jit
def _online_pow2_scaled(s, e_bits, m_i, l_i, KEYS_AXIS: tl.constexpr = 1):
    """`_online` for FP8 values with one power-of-two scale ``2**e`` per key (``e_bits``: its uint8
    biased exponent, ``e + 127``): the scale joins the exponent, so the returned weights
    ``2**(s + e - m)`` (``m`` the running max of ``s + e``) multiply the raw codes and stay at most 1
    (FP16-safe) with no per-tile max of the scales, while the sum adds ``2**(s - m)`` (the output is
    ``acc / sum`` as with `_online`). ``e`` is clamped at -100 (scales below ``2**-100``, the all-zero
    tokens' ``2**-127`` among them), so each ``2**(s - m) <= 2**-e`` stays below ``2**100``. The sum
    takes ``2**(s - m)`` itself, not the weight times ``2**-e``: a weight that underflows float32 (a
    key far below the tile's largest ``s + e``) would drop its key from the sum. ``KEYS_AXIS``: the
    scores' axis of the keys (1: ``[rows, keys]``; 0: transposed, ``[keys, rows]``)."""
    eb = tl.maximum(e_bits.to(tl.int32), 27)  # e = eb - 127 >= -100
    e = tl.expand_dims((eb - 127).to(tl.float32), 1 - KEYS_AXIS)
    m_new = tl.maximum(m_i, tl.max(s + e, KEYS_AXIS))
    p = tl.exp2(s - tl.expand_dims(m_new, KEYS_AXIS))
    w = p * tl.expand_dims((eb << 23).to(tl.float32, bitcast=True), 1 - KEYS_AXIS)  # 2**e from its bits
    alpha = tl.exp2(m_i - m_new)
    return w, alpha, m_new, l_i * alpha + tl.sum(p, KEYS_AXIS)


@triton.jit
def _scores(q0, q1, k0, k1, HALF: tl.constexpr, DOT_PREC: tl.constexpr):
    """``q . k`` of a tile; ``HALF``: the even and odd channel halves summed."""
    s = tl.dot(q0, tl.trans(k0), input_precision=DOT_PREC)
    if HALF:
        s += tl.dot(q1, tl.trans(k1), input_precision=DOT_PREC)
    return s


@triton.jit
def _turned_tile(k, vt, qt, seen, acc, m_i, l_i, DOT_PREC: tl.constexpr):
    """One tile of model-dtype keys with the products turned over (keys as rows, as the decode
    kernels' cold tiles with ``keys_as_rows``): scores ``k . q^T`` ``[keys, rows]`` (``qt`` ``[D,
    rows]``; ``seen`` the keys each row sees, the others at -inf), the online softmax along the keys,
    and the output ``acc`` ``[D, rows]`` rescaled plus ``v^T . p`` (``vt`` the values transposed,
    ``[D, keys]``). Returns ``(acc, m_i, l_i)``."""
    s = tl.where(seen, tl.dot(k, qt, input_precision=DOT_PREC), float("-inf"))
    p, alpha, m_i, l_i = _online(s, m_i, l_i, 0)
    acc = tl.dot(vt, p.to(vt.dtype), acc * alpha[None, :], input_precision=DOT_PREC)
    return acc, m_i, l_i


@triton.jit
def _accumulate(acc0, acc1, alpha, w, v0, v1, HALF: tl.constexpr, DOT_PREC: tl.constexpr):
    """``acc * alpha + w . v`` for the accumulator (``HALF``: both channel halves)."""
    wd = w.to(v0.dtype)
    acc0 = acc0 * alpha[:, None] + tl.dot(wd, v0, input_precision=DOT_PREC)
    if HALF:
        acc1 = acc1 * alpha[:, None] + tl.dot(wd, v1, input_precision=DOT_PREC)
    return acc0, acc1


@triton.jit
def _raw_tile(
    q0,
    q1,
    acc0,
    acc1,
    m_i,
    l_i,
    KP,
    VP,
    row,
    ok,
    seen,
    ck0,
    ck1,
    cv0,
    cv1,
    D: tl.constexpr,
    HALF_K: tl.constexpr,
    HALF_V: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """One tile of raw (model-dtype) keys and values: sink page, ring rows or new tokens. ``row``:
    ``[N]`` int64 (token, head) rows of ``KP``/``VP``, ``ok`` the keys to read; ``seen``: the keys each
    query row sees (``[BLOCK_M, N]`` or ``[1, N]``)."""
    base = row[:, None] * D
    k0 = tl.load(KP + base + ck0[None, :], mask=ok[:, None] & (ck0 < D)[None, :], other=0.0).to(q0.dtype)
    k1 = k0
    if HALF_K:
        k1 = tl.load(KP + base + ck1[None, :], mask=ok[:, None] & (ck1 < D)[None, :], other=0.0).to(q0.dtype)
    v0 = tl.load(VP + base + cv0[None, :], mask=ok[:, None] & (cv0 < D)[None, :], other=0.0).to(q0.dtype)
    v1 = v0
    if HALF_V:
        v1 = tl.load(VP + base + cv1[None, :], mask=ok[:, None] & (cv1 < D)[None, :], other=0.0).to(q0.dtype)
    s = tl.where(seen, _scores(q0, q1, k0, k1, HALF_K, DOT_PREC), float("-inf"))
    p, alpha, m_i, l_i = _online(s, m_i, l_i)
    acc0, acc1 = _accumulate(acc0, acc1, alpha, p, v0, v1, HALF_V, DOT_PREC)
    return acc0, acc1, m_i, l_i


@triton.jit
def _codes(
    p,
    row,
    d,
    d_ok,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FMT: tl.constexpr,
    DOT: tl.constexpr,
    DIRECT: tl.constexpr,
    HALVES: tl.constexpr = False,
):
    """``[N, BLOCK_D]`` codes of rows ``row`` (``[N, 1]``) as dot operands: raw values, or FP8/int8
    codes converted exactly (their scales are the caller's). Rows past the keys are real rows (of the
    page the masked page-table load gives), so only channels past D are masked. ``DIRECT``: FP8 codes
    convert straight to ``DOT`` (to FP16: two codes an instruction on sm_89+), else through float32.

    ``HALVES`` (D a power of two): the row's two contiguous channel halves load and convert apart and
    are joined as channel pairs, so column ``2i`` is channel ``i`` and ``2i + 1`` channel ``D/2 + i``
    (for values: the product's columns come out in that order, the caller puts them back). The codes
    then reach the dot's layout already converted (on sm_90 a transposing ldmatrix of FP16, where
    8-bit values in the P.V operand layout load byte by byte) and ``d`` is unused."""
    if HALVES:
        c = tl.arange(0, D // 2)[None, :]
        lo = _convert(tl.load(p + row * D + c), FMT, DOT, DIRECT)
        hi = _convert(tl.load(p + row * D + D // 2 + c), FMT, DOT, DIRECT)
        return tl.reshape(tl.join(lo, hi), [row.shape[0], D])
    at = p + row * D + d
    if BLOCK_D == D:  # noqa: SIM108  (constexpr branches of a Triton function)
        x = tl.load(at)
    else:
        x = tl.load(at, mask=d_ok, other=0)
    return _convert(x, FMT, DOT, DIRECT)


@triton.jit
def _convert(x, FMT: tl.constexpr, DOT: tl.constexpr, DIRECT: tl.constexpr):
    """Loaded codes as ``DOT`` (see `_codes`)."""
    if FMT == 1 and DIRECT:
        x = x.to(tl.float8e4nv, bitcast=True)
    elif FMT == 2 and DIRECT:
        x = x.to(tl.float8e5, bitcast=True)
    elif FMT == 1 or FMT == 2:
        x = fp8_value(x, FMT == 2)
    return x.to(DOT)


@triton.jit
def _cold_tile(
    qd,
    qc,
    acc,
    m_i,
    l_i,
    page,
    K0,
    K1,
    K2,
    V0,
    V1,
    V2,
    j,
    end,
    d,
    h,
    H,
    P: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    K_FMT: tl.constexpr,
    V_FMT: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PREC: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    CODE_DTYPE: tl.constexpr,
    NORM_W: tl.constexpr,
    HALVES: tl.constexpr = False,
    POW2_W: tl.constexpr = False,
    BITS_GIVEN: tl.constexpr = False,
    k_bits=0,
    v_bits=0,
):
    """One tile of cold keys ``j`` (``[N]`` positions in the sequence's cold pages, ``MASKED``: those
    at or past ``end`` are padding) in pages ``page`` (``[N]`` int64, from the page table). Keys and
    values with one scale per key (raw, FP8 keys: one exponent per page and head; per-token value
    scales of every 8-bit codec) load as codes straight into the dot; the key scale multiplies the
    scores' columns and the value scale the softmax weights (``(p * s_v) . codes + p . offset_v``).
    Per-channel key scales (int8) and 4-bit codes decode per element (`load_decoded`).

    8-bit codes enter their dots as ``CODE_DTYPE`` (FP8 and int8 codes are exact in FP16; ``qc`` is q in
    it). ``BITS_GIVEN`` (decode, FP8 keys and values with ``POW2_W``): the tile's key and value scale
    exponents come in as ``k_bits`` / ``v_bits`` (`decode._fp8_scale_bits`, loaded a tile ahead) instead
    of being loaded here. ``NORM_W``: the scaled weights are divided by the tile's largest value scale
    before the cast and the product multiplied back, so FP16 weights stay normal (``p * s_v`` of a small
    scale would lose bits as an FP16 subnormal); with ``POW2_W`` (decode) FP8 values' power-of-two scales
    join the softmax exponent instead (`_online_pow2_scaled`: no cross-warp max of the scales a tile;
    H200: FP8 extend 5.141 ms with it, 4.904 without in pass 4). ``HALVES``: 8/16-bit value codes in
    `_codes`' channel-pair layout (``acc``'s columns in that order)."""
    ok = j < end
    tok = (j % P).to(tl.int64)
    row = (page * P + tok) * H + h
    d_ok = (d < D)[None, :]
    if K_FMT == 0:
        k = _codes(K0, row[:, None], d[None, :], d_ok, D, BLOCK_D, K_FMT, DOT_DTYPE, False)
        s = tl.dot(qd, tl.trans(k), input_precision=DOT_PREC)
    elif K_FMT <= 2:
        k = _codes(K0, row[:, None], d[None, :], d_ok, D, BLOCK_D, K_FMT, CODE_DTYPE, NORM_W)
        s = tl.dot(qc, tl.trans(k), input_precision=DOT_PREC)
        if not BITS_GIVEN:
            k_bits = tl.load(K1 + page * H + h)
        s = s * pow2_scale(k_bits)[None, :]
    else:
        k = load_decoded(K0, K1, K2, page[:, None], tok[:, None], h, d[None, :], ok[:, None] & d_ok,
                         ok[:, None], H, P, D, BLOCK_D, K_FMT, True).to(DOT_DTYPE)  # fmt: skip
        s = tl.dot(qd, tl.trans(k), input_precision=DOT_PREC)
    if MASKED:
        s = tl.where(ok[None, :], s, float("-inf"))
    if (V_FMT == 1 or V_FMT == 2) and NORM_W and POW2_W:
        v = _codes(V0, row[:, None], d[None, :], d_ok, D, BLOCK_D, V_FMT, CODE_DTYPE, NORM_W, HALVES)
        if not BITS_GIVEN:
            v_bits = tl.load(V1 + row)
        w, alpha, m_i, l_i = _online_pow2_scaled(s, v_bits, m_i, l_i)
        acc = acc * alpha[:, None] + tl.dot(w.to(CODE_DTYPE), v, input_precision=DOT_PREC)
    elif V_FMT == 0:
        p, alpha, m_i, l_i = _online(s, m_i, l_i)
        v = _codes(V0, row[:, None], d[None, :], d_ok, D, BLOCK_D, V_FMT, DOT_DTYPE, False, HALVES)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PREC)
    elif V_FMT <= 4:
        p, alpha, m_i, l_i = _online(s, m_i, l_i)
        v = _codes(V0, row[:, None], d[None, :], d_ok, D, BLOCK_D, V_FMT, CODE_DTYPE, NORM_W, HALVES)
        vs, vo = value_tile_scales(V1, V2, row, V_FMT)
        if NORM_W:
            top = tl.max(tl.where(ok, vs, 1.1754943508222875e-38), 0)
            w = p * (vs * (1.0 / top))[None, :]
            pv = tl.dot(w.to(CODE_DTYPE), v, input_precision=DOT_PREC) * top
        else:
            pv = tl.dot((p * vs[None, :]).to(CODE_DTYPE), v, input_precision=DOT_PREC)
        acc = acc * alpha[:, None] + pv
        if V_FMT == 4:
            acc += tl.sum(p * vo[None, :], 1)[:, None]
    else:
        p, alpha, m_i, l_i = _online(s, m_i, l_i)
        v = load_decoded(V0, V1, V2, page[:, None], tok[:, None], h, d[None, :], ok[:, None] & d_ok,
                         ok[:, None], H, P, D, BLOCK_D, V_FMT, False).to(DOT_DTYPE)  # fmt: skip
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PREC)
    return acc, m_i, l_i


@triton.jit
def _channels(HALF: tl.constexpr, BLOCK: tl.constexpr):
    """Channel indices ``(c0, c1)`` of an operand: ``HALF`` the even and odd channels (BLOCK each),
    else every channel (twice)."""
    i = tl.arange(0, BLOCK)
    if HALF:
        return 2 * i, 2 * i + 1
    else:
        return i, i


@triton.jit
def _out_rows(m_i, l_i, q_row, row_ok, split, num_splits, OUT, PO, PL, D: tl.constexpr, SPLIT: tl.constexpr):
    """Where the rows' outputs go and the factor that normalises them: the output itself, or with
    ``SPLIT`` the split's partial (whose base-2 log-sum-exp it stores; -inf where no key was seen)."""
    if SPLIT:
        has = l_i > 0
        inv = 1.0 / tl.where(has, l_i, 1.0)
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        o_at = PO + (q_row * num_splits + split)[:, None] * D
        tl.store(PL + q_row * num_splits + split, lse, mask=row_ok)
    else:
        inv = 1.0 / l_i
        o_at = OUT + q_row[:, None] * D
    return o_at, inv


STEP_INTS = ("pt_stride", "rr_stride", "pages_per_split", "num_splits", "tail_split")
STEP_POINTERS = ("PT", "COLD_LEN", "ST", "SINK_OK", "RR", "RING_LEN")
# The decode kernels' too: ``COUNT``, when they do not merge their splits, is an index tensor of the
# step (`merge_options`), at any offset of its buffer.
DECODE_POINTERS = (*STEP_POINTERS, "COUNT")


@jit_unspecialized(ints=STEP_INTS, pointers=STEP_POINTERS)
def _attend_kernel(
    Q,
    KN,
    VN,
    OUT,
    PO,
    PL,
    PT,
    COLD_LEN,
    K0,
    K1,
    K2,
    V0,
    V1,
    V2,
    ST,
    SINK_OK,
    SK,
    SV,
    RR,
    RING_LEN,
    RK,
    RV,
    qk_scale,
    T,
    H,
    pt_stride,
    rr_stride,
    pages_per_split,
    num_splits,
    tail_split,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    P: tl.constexpr,
    K_FMT: tl.constexpr,
    V_FMT: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FOLD: tl.constexpr,
    BLOCKS: tl.constexpr,
    PREFETCH: tl.constexpr,
    HALF_K: tl.constexpr,
    HALF_V: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    DOT_PREC: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    CODE_DTYPE: tl.constexpr,
    NORM_W: tl.constexpr,
):
    m_blocks = tl.cdiv(T * GROUP, BLOCK_M)
    b = tl.program_id(0) // m_blocks
    mb = tl.program_id(0) % m_blocks
    h = tl.program_id(1)
    split = tl.program_id(2)
    hq = H * GROUP

    r = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    t = r // GROUP
    row_ok = t < T
    q_row = (b * T + t).to(tl.int64) * hq + h * GROUP + r % GROUP
    ck0, ck1 = _channels(HALF_K, BLOCK_DK)
    cv0, cv1 = _channels(HALF_V, BLOCK_DV)
    # q in float32, the softmax scale (base 2) folded in; qd0/qd1 the dot operands of raw keys.
    q_at = Q + q_row[:, None] * D
    q0 = tl.load(q_at + ck0[None, :], mask=row_ok[:, None] & (ck0 < D)[None, :], other=0.0)
    q0 = q0.to(tl.float32) * qk_scale
    q1 = q0
    if HALF_K:
        q1 = tl.load(q_at + ck1[None, :], mask=row_ok[:, None] & (ck1 < D)[None, :], other=0.0)
        q1 = q1.to(tl.float32) * qk_scale
    qd0 = q0.to(DOT_DTYPE)
    qd1 = q1.to(DOT_DTYPE)
    qc = q0.to(CODE_DTYPE)  # the operand of 8-bit key codes (`_cold_tile`)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc0 = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    n_cold = tl.load(COLD_LEN + b)
    lo = split * pages_per_split
    hi = tl.minimum(lo + pages_per_split, n_cold)
    if FOLD:
        # BLOCKS 16-token blocks per tile, each inside one page: see kernel_decode's block decoding.
        jn = tl.arange(0, BLOCKS * 16)
        ib = tl.arange(0, BLOCKS)
        n16 = tl.arange(0, 16)[None, :, None].to(tl.int64)
        ik = tl.arange(0, BLOCK_DK)
        iv = tl.arange(0, BLOCK_DV)[None, :]
        kc_ok = (ck0 < D)[None, None, :]
        v_ok = (cv0 < D)[None, :]
        for j0 in range(lo * P, hi * P, BLOCKS * 16):
            ok = j0 + jn < hi * P
            jb = j0 + ib * 16
            b_ok = (jb < hi * P)[:, None, None]
            pb = tl.load(PT + b * pt_stride + jb // P, mask=jb < hi * P, other=0).to(tl.int64)
            pb = pb[:, None, None]
            tb = (jb % P).to(tl.int64)[:, None, None]
            rk = (pb * P + tb + n16) * H + h  # [BLOCKS, 16, 1]
            k0, k1 = tile_codes(K0, rk, ik[None, None, :], kc_ok & b_ok, D, K_FMT, HALF_K)
            if K_FMT != 0:
                c0, c1 = ck0[None, None, :], ck1[None, None, :]
                s0, s1, o0, o1 = key_block_scales(K1, K2, pb, tb, h, c0, c1, kc_ok, H, P, D, K_FMT)
                k0 = k0 * s0 + o0
                k1 = k1 * s1 + o1
            # Cast before the reshape: a layout change moves half the bytes in the dot dtype.
            k0 = tl.reshape(k0.to(DOT_DTYPE), [BLOCKS * 16, BLOCK_DK])
            k1 = tl.reshape(k1.to(DOT_DTYPE), [BLOCKS * 16, BLOCK_DK])
            s = tl.where(ok[None, :], _scores(qd0, qd1, k0, k1, HALF_K, DOT_PREC), float("-inf"))
            p, alpha, m_i, l_i = _online(s, m_i, l_i)
            jv = j0 + jn
            pv = tl.load(PT + b * pt_stride + jv // P, mask=ok, other=0).to(tl.int64)
            rv = (pv * P + jv % P) * H + h  # [BLOCKS * 16]
            if V_FMT == 6:  # always HALF_V here: block scales broadcast over 16-byte groups
                v0, v1 = fp4_value_codes(V0, V1, rv, ok, D, BLOCK_DV, DOT_DTYPE)
            else:
                v0, v1 = tile_codes(V0, rv[:, None], iv, v_ok & ok[:, None], D, V_FMT, HALF_V)
            w = p
            if V_FMT != 0:
                vs, vo = value_tile_scales(V1, V2, rv, V_FMT)
                w = p * vs[None, :]
            v0 = v0.to(DOT_DTYPE)
            v1 = v1.to(DOT_DTYPE)
            acc0, acc1 = _accumulate(acc0, acc1, alpha, w, v0, v1, HALF_V, DOT_PREC)
            if V_FMT == 4 or V_FMT == 5:
                pv_off = tl.sum(p * vo[None, :], 1)[:, None]
                acc0 += pv_off
                acc1 += pv_off
    else:
        # Pages of any size: tiles of BLOCK_N keys across pages (`_cold_tile`); full tiles unmasked,
        # then the last partial tile with its keys masked.
        n = tl.arange(0, BLOCK_N)
        d = tl.arange(0, BLOCK_D)
        end = hi * P
        full = lo * P + tl.maximum(hi - lo, 0) * P // BLOCK_N * BLOCK_N
        pt = PT + b * pt_stride
        if PREFETCH:
            # Page-table entries loaded a tile ahead, so the copies of a tile's codes do not wait on
            # a table load of the same iteration and the pipeliner can run them stages ahead.
            page = tl.load(pt + (lo * P + n) // P, mask=lo * P + n < end, other=0).to(tl.int64)
        for j0 in range(lo * P, full, BLOCK_N):
            if PREFETCH:
                ahead = j0 + BLOCK_N + n
                page_ahead = tl.load(pt + ahead // P, mask=ahead < end, other=0).to(tl.int64)
            else:
                page = tl.load(pt + (j0 + n) // P).to(tl.int64)
            acc0, m_i, l_i = _cold_tile(
                qd0, qc, acc0, m_i, l_i, page, K0, K1, K2, V0, V1, V2, j0 + n, end, d, h,
                H, P, D, BLOCK_D, K_FMT, V_FMT, False, DOT_PREC, DOT_DTYPE, CODE_DTYPE, NORM_W,
            )  # fmt: skip
            if PREFETCH:
                page = page_ahead
        if full < end:
            if not PREFETCH:
                page = tl.load(pt + (full + n) // P, mask=full + n < end, other=0).to(tl.int64)
            acc0, m_i, l_i = _cold_tile(
                qd0, qc, acc0, m_i, l_i, page, K0, K1, K2, V0, V1, V2, full + n, end, d, h,
                H, P, D, BLOCK_D, K_FMT, V_FMT, True, DOT_PREC, DOT_DTYPE, CODE_DTYPE, NORM_W,
            )  # fmt: skip

    if split == tail_split:  # sinks, ring and new tokens: the last split of the text pool's pass
        n = tl.arange(0, BLOCK_N)
        if HAS_SINKS:
            sink_len = tl.load(SINK_OK + b) * P  # P keys when the sequence has a sink page, else 0
            slot = tl.load(ST + b).to(tl.int64)
            for j0 in range(0, sink_len, BLOCK_N):
                j = j0 + n
                ok = j < sink_len
                acc0, acc1, m_i, l_i = _raw_tile(
                    qd0, qd1, acc0, acc1, m_i, l_i, SK, SV, (slot * P + j) * H + h, ok, ok[None, :],
                    ck0, ck1, cv0, cv1, D, HALF_K, HALF_V, DOT_PREC,
                )  # fmt: skip
        ring_len = tl.load(RING_LEN + b)
        for j0 in range(0, ring_len, BLOCK_N):
            j = j0 + n
            ok = j < ring_len
            ring_row = tl.load(RR + b * rr_stride + j, mask=ok, other=0).to(tl.int64)
            acc0, acc1, m_i, l_i = _raw_tile(
                qd0, qd1, acc0, acc1, m_i, l_i, RK, RV, ring_row * H + h, ok, ok[None, :],
                ck0, ck1, cv0, cv1, D, HALF_K, HALF_V, DOT_PREC,
            )  # fmt: skip
        # New tokens, causal: row of token t sees new tokens 0..t; none past this block's last token.
        last = tl.minimum(T, (mb * BLOCK_M + BLOCK_M - 1) // GROUP + 1)
        for j0 in range(0, last, BLOCK_N):
            j = j0 + n
            ok = j < T
            seen = ok[None, :] & (j[None, :] <= t[:, None])
            acc0, acc1, m_i, l_i = _raw_tile(
                qd0, qd1, acc0, acc1, m_i, l_i, KN, VN, (b * T + j).to(tl.int64) * H + h, ok, seen,
                ck0, ck1, cv0, cv1, D, HALF_K, HALF_V, DOT_PREC,
            )  # fmt: skip

    o_at, inv = _out_rows(m_i, l_i, q_row, row_ok, split, num_splits, OUT, PO, PL, D, SPLIT)
    tl.store(o_at + cv0[None, :], (acc0 * inv[:, None]).to(o_at.dtype.element_ty),
             mask=row_ok[:, None] & (cv0 < D)[None, :])  # fmt: skip
    if HALF_V:
        tl.store(o_at + cv1[None, :], (acc1 * inv[:, None]).to(o_at.dtype.element_ty),
                 mask=row_ok[:, None] & (cv1 < D)[None, :])  # fmt: skip


# Extend launches (T > 1) take this copy of the kernel, with T (new tokens a sequence) unspecialized
# too: a chunk's token count changes from step to step, and Triton compiles one variant for T a
# multiple of 16 and one for the others (on one H200 a served fp8 run compiled for 4.4 s on its first
# 16-token extend). Decode launches of this kernel (T == 1: int8 keys by blocks, 4-bit layers
# `decode4` does not take) keep `_attend_kernel`, where T is the constant 1.
_extend_kernel = jit_unspecialized(ints=(*STEP_INTS, "T"), pointers=STEP_POINTERS)(_attend_kernel.fn)


@triton.jit
def _merge_rows(
    PO,
    PL,
    OUT,
    row0,
    n_rows,
    num_splits,
    D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    LOOPED: tl.constexpr,
):
    """Combine the splits of the ``n_rows`` (token, query head) rows from ``row0`` by their base-2
    log-sum-exp, ``BLOCK_S`` splits at a time: the running maximum rescales what the blocks before
    added. Without ``LOOPED`` (``num_splits`` <= ``BLOCK_S``) the loop has one iteration of constant
    bounds. The partials load from L2 (``.cg``): in a merge inside a decode kernel (`merge_if_last`)
    other programs wrote them."""
    row = row0 + tl.arange(0, BLOCK_G)
    g_ok = tl.arange(0, BLOCK_G) < n_rows
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(0, num_splits if LOOPED else BLOCK_S, BLOCK_S):
        at = row[:, None] * num_splits + (start + s)[None, :]
        ok = g_ok[:, None] & (start + s < num_splits)[None, :]
        lse = tl.load(PL + at, mask=ok, other=float("-inf"), cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse, 1))
        # -inf while no split so far saw a key: weights and rescale then 0, not NaN
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - ref)
        w = tl.exp2(lse - ref[:, None])
        o = tl.load(
            PO + at[:, :, None] * D + d[None, None, :],
            mask=ok[:, :, None] & (d < D)[None, None, :],
            other=0.0,
            cache_modifier=".cg",
        )
        acc = acc * alpha[:, None] + tl.sum(o * w[:, :, None], 1)
        total = total * alpha + tl.sum(w, 1)
        m = m_new
    out = (acc / tl.where(total > 0, total, 1.0)[:, None]).to(OUT.dtype.element_ty)  # padding: 0 / 0
    tl.store(OUT + row[:, None] * D + d[None, :], out, mask=g_ok[:, None] & (d < D)[None, :])


@triton.jit
def decode_program(H, HEADS_TOGETHER: tl.constexpr):
    """``(sequence, KV head)`` of a decode program on the grid (sequences, KV heads, splits);
    ``HEADS_TOGETHER``: ids remapped so that consecutive programs are one sequence's KV heads (the
    same grid; a page's token rows are then read by all its heads at about the same time)."""
    if HEADS_TOGETHER:
        pid = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        b = pid // H
        h = pid % H
    else:
        b = tl.program_id(0)
        h = tl.program_id(1)
    return b, h


@triton.jit
def merge_if_last(
    COUNT,
    PO,
    PL,
    OUT,
    b,
    h,
    H,
    num_splits,
    GROUP,
    D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """The split merge inside a decode kernel, after the program of sequence ``b``, KV head ``h`` (of
    ``H``) stored its partials: the program that finds it is the last of ``num_splits`` to count itself
    in that pair's counter (``COUNT[b * H + h]``, 0 before the launch) merges the pair's ``GROUP``
    query rows into ``OUT`` and sets the counter back to 0 for the next launch (a CUDA-graph replay
    too). The barrier orders every
    thread's stores before the count's release (one thread counts; cooperative groups' grid sync is
    built the same way), the acquire orders the merge's loads after the other programs' stores."""
    pair = b * H + h
    tl.debug_barrier()
    done = tl.atomic_add(COUNT + pair, 1, sem="acq_rel", scope="gpu")
    if done == num_splits - 1:
        tl.store(COUNT + pair, 0)
        row0 = pair.to(tl.int64) * GROUP
        _merge_rows(PO, PL, OUT, row0, GROUP, num_splits, D, BLOCK_G, BLOCK_S, BLOCK_D, True)


@jit_unspecialized(ints=("num_splits",))
def _merge_kernel(
    PO,
    PL,
    OUT,
    num_splits,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    LOOPED: tl.constexpr,
):
    """One (token, query head) row's splits a program (`_merge_rows`)."""
    row = tl.program_id(0).to(tl.int64)
    _merge_rows(PO, PL, OUT, row, 1, num_splits, D, 1, BLOCK_S, BLOCK_D, LOOPED)


def extend_kind(k_fmt: int, v_fmt: int) -> str:
    """The `EXTEND_LAUNCH` entry of a layer whose keys and values have these kernel formats."""
    if k_fmt in HALF_FORMATS or v_fmt in HALF_FORMATS:
        return "4bit"
    return "raw" if k_fmt == 0 and v_fmt == 0 else "8bit"


def _whole_tiles(
    programs: int, n_pages: int, splits: int, whole_pages: int, target: int, min_pages: int
) -> tuple[int, int]:
    """``(splits, pages per split)``: ``cdiv(n_pages, splits)`` pages a split, rounded down to whole
    tiles of ``whole_pages`` pages (0: tiles do not hold whole pages) when the extra splits keep the
    launch within ``target`` programs and each split keeps ``min_pages``. A split of 33 pages reads 5
    tiles of 8 pages, the last for one page; 32 pages read 4 (B=1 at 32K: 64 splits instead of 63)."""
    per = triton.cdiv(max(n_pages, 1), splits)
    if splits > 1 and whole_pages and per > whole_pages and per % whole_pages:
        down = per // whole_pages * whole_pages
        more = triton.cdiv(n_pages, down)
        if down >= min_pages and programs * more <= target:
            return more, down
    return splits, per


def query_block(rows: int, block_m: int) -> int:
    """A tile's query rows for ``rows`` (new tokens x query heads per KV head): the power of two at or
    above, 16 to the launch's ``block_m``. A constexpr of the kernels: each value compiles a variant."""
    return max(16, min(block_m, triton.next_power_of_2(rows)))


def takes_wide_decode(
    k_fmt: int, v_fmt: int, programs: int, n_pages: int, splits: int | None, min_pages: int, page_size: int
) -> bool:
    """Whether a decode pass of ``programs`` (sequences x KV heads) over ``n_pages`` cold pages of
    ``page_size`` tokens takes `FP8_WIDE_DECODE`: FP8 keys and values, and at least
    `FP8_WIDE_PROGRAMS` programs once split, by ``splits`` where given, else as the launch would split
    them in the wide shape (`cold_splits`: its programs target, splits of at least ``min_pages`` pages
    or the wide shape's own, rounded to whole 32-key tiles)."""
    if k_fmt not in WIDE_DECODE_FORMATS or v_fmt not in WIDE_DECODE_FORMATS:
        return False
    if splits is None:
        wide = {"min_pages": min_pages, **FP8_WIDE_DECODE}
        splits, _ = cold_splits(programs, n_pages, wide, tile_pages(wide["block_n"], page_size))
    return programs * splits >= FP8_WIDE_PROGRAMS


def takes_int8_decode(k_fmt: int, v_fmt: int, head_dim: int, page_size: int, launch: dict) -> bool:
    """Whether a decode pass takes `INT8_DECODE`: the launch's ``int8_rows`` on, and a layer that
    `decode.int8_rows_apply` reads in that shape's tiles (symmetric int8 keys and values, pages of whole
    16-key tiles, a power-of-two head_dim of 32 or more)."""
    from kvstrata.radix.kernels import decode  # it imports this module's tile functions

    layer = dict(K_FMT=k_fmt, V_FMT=v_fmt, D=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), P=page_size)
    return bool(launch.get("int8_rows")) and decode.int8_rows_apply(
        layer, INT8_DECODE["block_n"], False, False
    )


def takes_raw_many_decode(k_fmt: int, v_fmt: int, programs: int, direct: bool, element_size: int) -> bool:
    """Whether a decode pass of ``programs`` (sequences x KV heads) takes `RAW_MANY_DECODE`: model-dtype
    keys and values (format 0) of 2 bytes (``element_size``: a BF16 or FP16 model; float32 tiles were
    not measured, and three stages of them take twice the shared memory), at least
    `RAW_MANY_PROGRAMS` programs, and the output written by the pass itself (a step of one pass: steps
    over an image or raised pool keep the entry, so the warm-up's variants stay the ones it meets)."""
    return k_fmt == v_fmt == 0 and element_size == 2 and direct and programs >= RAW_MANY_PROGRAMS


def tile_pages(tile: int, page_size: int) -> int:
    """Whole pages in a cold tile of ``tile`` keys; 0 where a tile holds part of a page or pages and a
    part."""
    return tile // page_size if tile % page_size == 0 else 0


def cold_splits(programs: int, n_pages: int, launch: dict, whole_pages: int) -> tuple[int, int]:
    """``(splits, pages per split)`` of a decode launch's cold pages: about ``launch``'s programs target
    (`_num_splits`, splits of at least `split_floor` pages), then rounded to tiles of ``whole_pages``
    pages (`_whole_tiles`)."""
    least = split_floor(programs, n_pages, launch)
    splits = _num_splits(programs, n_pages, launch["programs"], least)
    return _whole_tiles(programs, n_pages, splits, whole_pages, launch["programs"], least)


def split_floor(programs: int, n_pages: int, launch: dict) -> int:
    """The fewest cold pages a split of a decode launch of ``programs`` (sequences x KV heads) over
    ``n_pages`` reads: the launch's ``min_pages``, or fewer where splits of ``min_pages`` would leave
    it under ``fill_programs`` programs: as many as give it about that many, down to ``fill_pages``
    (absent or larger: ``min_pages``). Batch 1 at 4K (8 KV heads, 247 cold pages) splits 56 programs at 32
    pages, too few for the GPU's 132 SMs (see `DECODE_LAUNCH`)."""
    least = launch.get("min_pages", MIN_PAGES_PER_SPLIT)
    fill = launch.get("fill_programs", 0)
    if programs * (n_pages // least) >= fill:
        return least
    return max(min(launch.get("fill_pages", least), least), min(least, n_pages * programs // fill))


def _num_splits(programs: int, max_pages: int, target: int, min_pages: int = MIN_PAGES_PER_SPLIT) -> int:
    """Splits of the cold pages so that about ``target`` programs run, each with at least
    ``min_pages`` pages."""
    if max_pages < 2 * min_pages or programs >= target:
        return 1
    return max(1, min(triton.cdiv(target, programs), max_pages // min_pages))


class Partials(NamedTuple):
    """Split partials of one pass: each split's normalised output and its base-2 log-sum-exp (-inf
    where the split saw no key)."""

    out: torch.Tensor  # [B*T, Hq, S, D] float32
    lse: torch.Tensor  # [B*T, Hq, S] float32


def _cold_passes(
    g: GroupPlan, pool: ColdPool, image_pool: ColdPool | None, raised_pool: ColdPool | None = None
) -> list[tuple[GroupPlan, ColdPool]]:
    """(plan, pool) of each kernel pass of a group: the text pool's first (it also reads sinks, ring
    and new tokens), then the image pool's and the raised pool's when the group has such pages."""
    passes = [(g, pool)]
    for plan, extra, name in ((g.image_plan, image_pool, "image"), (g.raised_plan, raised_pool, "raised")):
        if plan is not None:
            if extra is None:
                raise ValueError(f"the step's plan has {name} pages but no {name} pool was given")
            passes.append((plan, extra))
    return passes


def merge_partials(parts: list[Partials], out: torch.Tensor) -> torch.Tensor:
    """Combine the partials of every split of every pass into ``out`` ``[B*T, Hq, D]`` by log-sum-exp."""
    po = parts[0].out if len(parts) == 1 else torch.cat([p.out for p in parts], dim=2)
    pl = parts[0].lse if len(parts) == 1 else torch.cat([p.lse for p in parts], dim=2)
    rows, hq, splits, d = po.shape
    block_d = triton.next_power_of_2(d)
    block = merge_block(splits)
    _merge_kernel[(rows * hq,)](
        po, pl, out, splits, D=d, BLOCK_D=block_d, BLOCK_S=block, LOOPED=splits > block
    )
    return out


def merge_block(splits: int) -> int:
    """The split merge's ``BLOCK_S`` for ``splits`` partials a row: the power of two at or above, at most
    `MERGE_BLOCK_S`."""
    return min(triton.next_power_of_2(splits), MERGE_BLOCK_S)


def warm_merges(
    most_splits: int, q_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> int:
    """Launch `merge_partials` once for each split block (``BLOCK_S``, `merge_block`) from 1 up to the
    block of ``most_splits`` (the partials of all of a step's passes together), and once looped where
    ``most_splits`` is past `MERGE_BLOCK_S`, so that each variant is compiled; returns the largest
    block. Which blocks serving meets depends on its batch sizes, its histories and how many of a step's
    pages sit in the image or raised pool (each pass adds its own partials), so a warm-up workload alone
    can miss one: on CPU, a served drift-fallback run met a merge block that the engine's warm-up rounds
    had not (`tests/engine/test_warmup_variants.py`)."""
    last = merge_block(max(most_splits, 1))
    blocks = [1 << i for i in range(last.bit_length())]
    for splits in blocks + ([MERGE_BLOCK_S + 1] if most_splits > MERGE_BLOCK_S else []):
        parts = Partials(
            torch.zeros(1, q_heads, splits, head_dim, device=device),
            torch.zeros(1, q_heads, splits, device=device),
        )
        merge_partials([parts], torch.empty(1, q_heads, head_dim, dtype=dtype, device=device))
    return last


LaunchCache = dict[tuple, "PassLaunch"]


def attend_group(
    layer: int,
    g: GroupPlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    pool: ColdPool,
    ring: HotRing,
    sinks: SinkStore | None,
    splits: int | None = None,
    image_pool: ColdPool | None = None,
    raised_pool: ColdPool | None = None,
    launches: LaunchCache | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[B*T, Hq, D]`` outputs (q's dtype) of one group: q ``[B*T, Hq, D]``, k/v ``[B*T, H, D]`` (the
    group's rows, contiguous). ``splits`` overrides the split-KV heuristic of every pass (tests).
    ``launches``: the step's `PassLaunch` of each pass, filled by the first layer and reused by the
    others (None: worked out for this call only, as when the launch table changes between calls).
    ``out``: where the outputs go (a new tensor if None).

    One kernel pass per cold pool (`_cold_passes`); a single pass without splits writes the output
    directly, as does a single split pass whose decode kernel merges its splits (`merge_if_last`);
    otherwise every pass writes split partials and `merge_partials` combines them."""
    passes = _cold_passes(g, pool, image_pool, raised_pool)
    if out is None:
        out = torch.empty_like(q)
    direct = len(passes) == 1
    parts: list[Partials] = []
    for i, (plan, cold) in enumerate(passes):
        tail = i == 0  # the first pass also reads the sink page, ring rows and new tokens
        k_fmt, kp, v_fmt, vp = layer_parts(cold, layer)
        key = (plan, k_fmt, v_fmt, tail, splits, direct, q.dtype, k.dtype, v.dtype, scale)
        launch = launches.get(key) if launches is not None else None
        if launch is None:
            launch = pass_launch(
                plan, k_fmt, v_fmt, q, k, v, scale, ring, sinks if tail else None, splits, direct, tail
            )
            if launches is not None:
                launches[key] = launch
        if launch.dequant:
            kp, vp = dequantized_parts(cold, layer, plan.page_table, k.shape[1], q.dtype)
        got = launch.run(layer, q, k, v, kp, vp, ring, sinks, out)
        if got is not None:
            parts.append(got)
    return merge_partials(parts, out) if parts else out


# The launches of each step's passes, worked out by its first layer (`attend_group`'s ``launches``).
_STEP_LAUNCHES: WeakKeyDictionary[StepBatch, LaunchCache] = WeakKeyDictionary()
_LAYER_PARTS: WeakKeyDictionary[ColdPool, dict[int, tuple]] = WeakKeyDictionary()


def layer_parts(pool: ColdPool, layer: int) -> tuple[int, list[torch.Tensor], int, list[torch.Tensor]]:
    """``(key format, key parts, value format, value parts)`` of ``layer`` in ``pool`` as the kernels
    take them (`kernel_format`; raw views, the first part repeated up to three), worked out once per
    pool and layer: the pool's tensors are allocated with it and written in place."""
    parts = _LAYER_PARTS.setdefault(pool, {})
    got = parts.get(layer)
    if got is None:
        # A layer may store keys and values in different codecs (a precision plan's "int4/fp4_e2m1").
        k_fmt, k_names = kernel_format(pool.k_codecs[layer])
        v_fmt, v_names = kernel_format(pool.v_codecs[layer])
        kp = [as_raw(pool.k[layer][name]) for name in k_names]
        vp = [as_raw(pool.v[layer][name]) for name in v_names]
        kp += [kp[0]] * (3 - len(kp))
        vp += [vp[0]] * (3 - len(vp))
        got = parts[layer] = (k_fmt, kp, v_fmt, vp)
    return got


class PassLaunch(NamedTuple):
    """One pass's kernel launch without the layer's tensors: the same in every layer of a step whose
    layers share codecs, so a decode step works it out once and each layer only launches.
    ``scalars``: the runtime arguments after the tensors; ``options`` the constexprs and launch options;
    ``sinks``: the pass reads the sink page; ``partial``: it writes split partials; ``dequant``: it reads
    its cold pages dequantized first, through the identity page table ``g.page_table``; ``merges``: its
    kernel merges the split partials into the output itself (`merge_if_last`)."""

    kernel: Any
    grid: tuple[int, int, int]
    scalars: tuple
    options: dict[str, Any]
    g: GroupPlan
    lengths: tuple[torch.Tensor, ...]  # the rows of ``g.kernel_lengths``: cold pages, ring rows, sinks
    splits: int
    direct: bool
    partial: bool
    sinks: bool
    dequant: bool = False  # `attend_group` gives it the pass's pages dequantized (`dequantized_parts`)
    merges: bool = False  # its kernel merges its own splits into the output (`merge_if_last`)

    def run(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kp: list[torch.Tensor],
        vp: list[torch.Tensor],
        ring: HotRing,
        sinks: SinkStore | None,
        out: torch.Tensor,
    ) -> Partials | None:
        """Launch over ``layer``'s tensors; writes ``out`` when the pass does not split or its kernel
        merges the splits (returns None), else returns the split partials."""
        g, (cold_len, ring_len, sink_len) = self.g, self.lengths
        po = pl = out
        if self.partial:
            rows, hq, d = q.shape
            po = torch.empty((rows, hq, self.splits, d), dtype=torch.float32, device=q.device)
            pl = torch.empty((rows, hq, self.splits), dtype=torch.float32, device=q.device)
        ring_k, ring_v = layer_kv(ring, layer)
        if self.sinks:
            assert sinks is not None and g.sink_table is not None
            sink_args = (g.sink_table, sink_len, *layer_kv(sinks, layer))
        else:
            sink_args = (sink_len, sink_len, ring_k, ring_v)
        self.kernel[self.grid](
            q, k, v, out if self.direct else po, po, pl, g.page_table, cold_len, *kp, *vp,
            *sink_args, g.ring_rows, ring_len, ring_k, ring_v, *self.scalars, **self.options,
        )  # fmt: skip
        return Partials(po, pl) if self.partial and not self.merges else None


@functools.cache
def _cuda_device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def cuda_name(t: torch.Tensor) -> str:
    """The name of the CUDA device ``t`` is on (cached: a host query, also allowed while a CUDA graph
    is captured), "" for other devices: the key of per-card launch choices (`INT4_TURNED_MAXNREG`)."""
    return _cuda_device_name(t.device.index) if t.is_cuda else ""


def decode4_launch(
    launch: dict,
    k_fmt: int,
    v_fmt: int,
    d: int,
    page: int,
    rows: int,
    device_name: str = "",
    table_pages: int | None = None,
) -> dict:
    """The 4-bit decode table entry ``launch`` as a layer of formats ``k_fmt``/``v_fmt``, head_dim ``d``
    and ``page``-token pages runs it over ``rows`` sequence x KV-head rows and a page table
    ``table_pages`` wide on the CUDA device named ``device_name`` ("" off CUDA): by blocks in this
    module's kernel where `decode4` does not read the layer (`OTHER_4BIT_DECODE`), int4's own shape
    (`INT4_DECODE`; at head_dim 128 from `INT4_TURNED_MIN_ROWS` rows its tail turned over,
    `INT4_TURNED_TAIL`, at the card's register cap, `INT4_TURNED_MAXNREG`), pass 12's keys for int4 on
    one side (`DECODE4_PASS12`), wider heads uncapped, and fp4 at head_dim 128 in 16-token pages
    uncapped up to the card's `FP4_UNCAPPED_MAX_PAGES`."""
    from kvstrata.radix.kernels import decode4

    if not decode4.applies(k_fmt, v_fmt, d, page):  # by blocks here, in this kernel's own shape
        return {**launch, **OTHER_4BIT_DECODE}
    if k_fmt == v_fmt == INT4_FORMAT:
        int4 = {**launch, **INT4_DECODE}
        if d != INT4_TURNED_HEAD_DIM or rows < INT4_TURNED_MIN_ROWS:
            return int4
        cap = INT4_TURNED_MAXNREG.get(device_name, int4.get("maxnreg"))
        return {**int4, **INT4_TURNED_TAIL, "maxnreg": cap}
    if d > DECODE4_CAPPED_HEAD_DIM:
        return {**launch, **DECODE4_PASS12, "maxnreg": None}
    if INT4_FORMAT in (k_fmt, v_fmt):
        return {**launch, **DECODE4_PASS12}
    widest = FP4_UNCAPPED_MAX_PAGES.get(device_name, -1)
    short_table = table_pages is not None and table_pages <= widest and page == FP4_UNCAPPED_PAGE_SIZE
    if k_fmt == v_fmt == FP4_FORMAT and d == DECODE4_CAPPED_HEAD_DIM and short_table:
        return {**launch, "maxnreg": None}
    return launch


def pass_launch(
    g: GroupPlan,
    k_fmt: int,
    v_fmt: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    ring: HotRing,
    sinks: SinkStore | None,
    splits: int | None,
    direct: bool,
    tail: bool,
) -> PassLaunch:
    """The launch of one pass over ``g.page_table``'s pages of a pool whose layer has formats ``k_fmt``/
    ``v_fmt``; ``tail``: it also reads the sink page, ring rows and new tokens (in the last split).
    ``direct``: it writes the output itself when it has one split, or a decode kernel merges its splits
    into it where they fit the launch's ``merge_reads`` (`merge_chunk`)."""
    B, T = g.batch, g.tokens
    _, hq, d = q.shape
    h = k.shape[1]
    group = hq // h
    n_pages = g.page_table.shape[1]
    page = g.page_size
    # Cold tiles of whole 16-token blocks (one key-scale vector each) need pages of a multiple of 16
    # tokens; other page sizes read keys across pages (`_cold_tile`).
    four_bit = k_fmt in HALF_FORMATS or v_fmt in HALF_FORMATS
    launch = DECODE_LAUNCH[four_bit] if T == 1 else EXTEND_LAUNCH[extend_kind(k_fmt, v_fmt)]
    if T == 1 and takes_int8_decode(k_fmt, v_fmt, d, page, launch):
        launch = {**launch, **INT8_DECODE}
    float32_cuda = q.is_cuda and q.element_size() == 4
    own = "dequant_bytes" in launch
    if (
        T > 1
        and not own
        and not float32_cuda
        and dequantizes(EXTEND_DEQUANT, k_fmt, v_fmt, T * group, g, h, d, q.dtype)
    ):
        launch = EXTEND_DEQUANT
    if T > 1 and float32_cuda and launch.get("module") == "extend":
        launch = {**launch, **EXTEND_FLOAT32}
    dequant = T > 1 and dequantizes(launch, k_fmt, v_fmt, T * group, g, h, d, q.dtype)
    if dequant:  # raw history in the pass's page order: the identity table
        k_fmt = v_fmt = 0
        identity = torch.arange(g.page_table.numel(), device=g.device, dtype=g.page_table.dtype)
        # The plan's device lengths go along: a plan without them would upload its host lists again,
        # which a CUDA-graph capture (the benchmarks' timing) does not allow.
        g = dataclasses.replace(g, page_table=identity.view(g.page_table.shape), lengths=g.kernel_lengths)
    if T == 1 and launch.get("module") == "decode4":
        from kvstrata.radix.kernels import decode4  # read again below

        launch = decode4_launch(launch, k_fmt, v_fmt, d, page, B * h, cuda_name(q), n_pages)
    if T == 1 and takes_wide_decode(
        k_fmt, v_fmt, B * h, n_pages, splits, launch.get("min_pages", MIN_PAGES_PER_SPLIT), page
    ):
        launch = {**launch, **FP8_WIDE_DECODE}
    elif T == 1 and takes_raw_many_decode(k_fmt, v_fmt, B * h, direct, q.element_size()):
        launch = {**launch, **RAW_MANY_DECODE}
    by_blocks = launch["by_blocks"] or (k_fmt in SCALED_KEY_FORMATS and launch.get("scaled_keys_by_blocks"))
    fold = page % 16 == 0 and bool(by_blocks)
    half_k, half_v = fold and k_fmt in HALF_FORMATS, fold and v_fmt in HALF_FORMATS
    block_m = query_block(T * group, launch["block_m"])
    m_blocks = triton.cdiv(T * group, block_m)
    pages_per_split = triton.cdiv(max(n_pages, 1), splits or 1)
    if splits is None and T == 1:
        tile = launch["blocks"] * 16 if fold else launch["block_n"]
        splits, pages_per_split = cold_splits(B * h * m_blocks, n_pages, launch, tile_pages(tile, page))
        if (
            tail
            and launch.get("tail_apart")
            and splits > 1
            and B * h * m_blocks * (splits + 1) <= launch["programs"]
        ):
            splits += 1  # the tail in a split of its own, past the cold pages (see DECODE_LAUNCH)
    splits = splits or 1
    partial = not direct or splits > 1
    has_sinks = sinks is not None and g.sink_table is not None
    block_d = triton.next_power_of_2(d)
    interpreted = q.device.type == "cpu"
    # FP16 dot operands for 8-bit codes (``f16_codes``): BF16 models only (a float32 model keeps its
    # IEEE dots); under the interpreter the operands stay float32 but the weights are normalised.
    f16 = launch["f16_codes"] and q.dtype == torch.bfloat16 and not fold
    # The interpreter's BF16 dot is wrong (Triton 3.9): on CPU the operands go float32.
    dot_dtype = tl.float32 if interpreted else _DOT_DTYPES[q.dtype]
    tail_split = splits - 1 if tail else -1
    strides = (g.page_table.stride(0), g.ring_rows.stride(0), pages_per_split, splits, tail_split)
    meta = dict(
        D=d,
        BLOCK_D=block_d,
        P=page,
        K_FMT=k_fmt,
        V_FMT=v_fmt,
        HAS_SINKS=has_sinks,
        SPLIT=partial,
        DOT_PREC="ieee" if q.dtype == torch.float32 or interpreted else "tf32",
        DOT_DTYPE=dot_dtype,
        CODE_DTYPE=tl.float16 if f16 and not interpreted else dot_dtype,
        NORM_W=f16,
    )
    kernel = _attend_kernel if T == 1 else _extend_kernel
    grid, scalars = (B * m_blocks, h, splits), (scale * LOG2E, T, h, *strides)
    options: dict[str, Any] | None = None
    extend_options: dict[str, Any] | None = None
    if T == 1 and launch.get("module") == "decode4" and decode4.applies(k_fmt, v_fmt, d, page):
        kernel, options = decode4._decode4_kernel, decode4.decode4_options(group, launch, interpreted, meta)
    elif T == 1 and not fold and launch.get("module", "decode") == "decode":
        from kvstrata.radix.kernels import decode  # it imports this module's tile functions

        sink_kv = (sinks.k, sinks.v) if has_sinks and sinks is not None else (ring.k, ring.v)
        one_dtype = len({k.dtype, v.dtype, ring.k.dtype, *(t.dtype for t in sink_kv)}) == 1
        kernel, options = decode._decode_kernel, decode.decode_options(group, launch, one_dtype, meta)
    elif T > 1 and launch.get("module") == "extend":
        from kvstrata.radix.kernels import extend  # it imports this module's tile functions

        if extend.applies(k_fmt, v_fmt):  # others: this module's kernel
            kernel = extend._flash_extend_kernel
            extend_options = extend.extend_options(group, block_m, launch, meta)
    decode_module = options is not None
    if decode_module:  # the decode kernels: one program per (sequence, KV head, split), no T
        grid, scalars = (B, h, splits), (scale * LOG2E, h, *strides)
    elif extend_options is not None:  # the extend kernel: this kernel's grid and arguments
        options = extend_options
    else:
        options = dict(
            meta,
            GROUP=group,
            BLOCK_M=block_m,
            BLOCK_N=launch["block_n"],
            FOLD=fold,
            BLOCKS=launch["blocks"],
            PREFETCH=launch["prefetch"],
            HALF_K=half_k,
            HALF_V=half_v,
            BLOCK_DK=max(16, block_d // 2) if half_k else block_d,
            BLOCK_DV=max(16, block_d // 2) if half_v else block_d,
            num_warps=launch["num_warps"],
            num_stages=launch["num_stages"],
        )
    lengths = tuple(g.kernel_lengths.unbind(0))
    merges = False
    if decode_module:
        chunk = merge_chunk(group, block_d, options["num_warps"])
        counts = None
        if direct and 1 < splits <= chunk * launch.get("merge_reads", 0):
            counts = split_counts(q.device, B * h)
        merges = counts is not None
        options = {**options, **merge_options(counts, lengths[0], group, chunk)}
    return PassLaunch(
        kernel, grid, scalars, options, g, lengths, splits, direct, partial, has_sinks, dequant, merges
    )


def merge_chunk(group: int, block_d: int, num_warps: int) -> int:
    """The splits a decode kernel's merging program reads at a time (`merge_if_last`): partials of
    `FUSED_MERGE_FLOATS` floats a warp or fewer (the group's rows padded to a power of two, ``block_d``
    channels each), a power of two; the same for every split count, so that a launch shape compiles
    one merging variant."""
    rows = triton.next_power_of_2(group)
    most = max(1, FUSED_MERGE_FLOATS * num_warps // (rows * block_d))
    return 1 << (most.bit_length() - 1)


def merge_options(
    counts: torch.Tensor | None, unused: torch.Tensor, group: int, chunk: int
) -> dict[str, Any]:
    """A decode kernel's split-merge arguments: ``COUNT``, the counters of `split_counts` where the
    kernel merges its own splits (`merge_if_last`), else ``unused`` (an int32 tensor it never reads:
    ``COUNT``'s dtype stays the same, its alignment is not specialized, so a launch that does not
    merge compiles no more variants than before); ``MERGE_S``: ``chunk``, the splits its merging
    program reads at a time (`merge_chunk`; 0: no merge); ``MERGE_G``: the group's rows padded to a
    power of two."""
    return dict(
        COUNT=unused if counts is None else counts,
        MERGE_S=0 if counts is None else chunk,
        MERGE_G=triton.next_power_of_2(group),
    )


_SPLIT_COUNTS: dict[torch.device, list[torch.Tensor]] = {}
# Counters `split_counts` allocates at least: a decode launch splits only below its ``programs``
# target (4,096 at most), so its sequences x KV heads are fewer (forced splits can ask for more).
SPLIT_COUNTS_LEAST = 4096


def split_counts(device: torch.device | str, n: int = 0) -> torch.Tensor | None:
    """``n`` or more int32 counters on ``device``, zero between launches, that the decode kernels
    merging their own splits count in (one per sequence and KV head; each launch's last programs set
    theirs back to 0). One set a device, shared by every such launch: launches on one stream run one
    after another (the engine and SGLang's model runner decode on one stream); two merging launches
    running at once on different streams would count in the same counters and must not happen. An
    unindexed CUDA device is the current one. The Triton attention
    backends call this when they are made, before any CUDA graph is captured. A larger set is
    allocated when needed, never during a capture (None then: the launch merges apart), and the sets
    before stay allocated, since graphs captured with them keep their addresses."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    have = _SPLIT_COUNTS.setdefault(device, [])
    if have and have[-1].numel() >= n:
        return have[-1]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    have.append(torch.zeros(max(n, SPLIT_COUNTS_LEAST), dtype=torch.int32, device=device))
    return have[-1]


def dequantizes(
    launch: dict, k_fmt: int, v_fmt: int, rows: int, g: GroupPlan, h: int, d: int, dtype: torch.dtype
) -> bool:
    """An extend pass over coded history dequantizes its cold pages to the model dtype first and reads
    them as raw history (`dequantized_parts`), when its launch allows it: ``dequant_bytes`` (the most
    bytes of K and V so made; 0 never) holds them, ``module`` is the flash kernel, and a sequence's
    ``rows`` (new tokens x query heads a KV head) make several query blocks, each of which would
    otherwise decode every code again."""
    cap = launch.get("dequant_bytes", 0)
    if not cap or launch.get("module") != "extend" or (k_fmt, v_fmt) == (0, 0):
        return False
    if triton.cdiv(rows, query_block(rows, launch["block_m"])) < 2:
        return False
    return 2 * g.page_table.numel() * g.page_size * h * d * dtype.itemsize <= cap


@jit_unspecialized(pointers=("PT",))  # a view into the step's uploaded tables, as the attention kernels'
def _dequant_kernel(
    PT,
    K0,
    K1,
    K2,
    V0,
    V1,
    V2,
    KO,
    VO,
    H,
    P: tl.constexpr,
    BLOCK_P: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    K_FMT: tl.constexpr,
    V_FMT: tl.constexpr,
):
    """One (page-table entry, KV head): the page's keys and values decoded (`load_decoded`, as the
    attention kernels decode them) into row ``entry`` of ``KO``/``VO`` ``[entries, P, H, D]``."""
    entry = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    tok = tl.arange(0, BLOCK_P).to(tl.int64)[:, None]
    page = tl.load(PT + entry).to(tl.int64) + 0 * tok  # [BLOCK_P, 1], as `load_decoded` takes it
    d = tl.arange(0, BLOCK_D)[None, :]
    row_ok = tok < P
    ok = row_ok & (d < D)
    k = load_decoded(K0, K1, K2, page, tok, h, d, ok, row_ok, H, P, D, BLOCK_D, K_FMT, True)
    v = load_decoded(V0, V1, V2, page, tok, h, d, ok, row_ok, H, P, D, BLOCK_D, V_FMT, False)
    at = ((entry * P + tok) * H + h) * D + d
    tl.store(KO + at, k.to(KO.dtype.element_ty), mask=ok)
    tl.store(VO + at, v.to(VO.dtype.element_ty), mask=ok)


def dequantized_parts(
    pool: ColdPool, layer: int, page_table: torch.Tensor, H: int, dtype: torch.dtype
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """K and V (``H`` heads) of every entry of ``page_table`` (padding included) decoded to ``dtype`` by
    one kernel pass, ``[entries, P, H, D]`` in the table's order, as raw kernel parts (`layer_parts`'
    layout)."""
    k_fmt, kp, v_fmt, vp = layer_parts(pool, layer)
    entries, P, D = page_table.numel(), pool.page_size, pool.head_dim
    ko = torch.empty((entries, P, H, D), dtype=dtype, device=page_table.device)
    vo = torch.empty_like(ko)
    _dequant_kernel[(entries, H)](
        page_table.reshape(-1), *kp, *vp, ko, vo, H,
        P=P, BLOCK_P=triton.next_power_of_2(P), D=D, BLOCK_D=triton.next_power_of_2(D),
        K_FMT=k_fmt, V_FMT=v_fmt,
    )  # fmt: skip
    return [ko] * 3, [vo] * 3


def prompt_only(g: GroupPlan) -> bool:
    """Prompts read from their first token: several new tokens a sequence and no history (no cold,
    image or raised page, ring row or sink page), so attention is plain causal attention. Read from
    the plan's host lists, which `build_step` fills (the decode-graph plans of the SGLang plugin keep
    placeholder zeros there, but have one token a sequence)."""
    history = (g.cold_pages, g.image_pages, g.raised_pages, g.ring_len, g.sink_valid)
    return g.tokens > 1 and not any(any(part) for part in history)


def causal_sdpa(
    g: GroupPlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    into: torch.Tensor | None = None,
) -> torch.Tensor:
    """`prompt_only` groups: torch SDPA (flash on CUDA) over ``[B, heads, T, D]`` views, causal, GQA;
    the result written into ``into`` (like q) when given, in one copy."""
    B, T = g.batch, g.tokens

    def heads_first(x: torch.Tensor) -> torch.Tensor:
        return x.view(B, T, *x.shape[1:]).transpose(1, 2)

    out = F.scaled_dot_product_attention(
        heads_first(q), heads_first(k), heads_first(v), is_causal=True, scale=scale, enable_gqa=True
    )
    if into is None:
        return out.transpose(1, 2).reshape(q.shape)
    into.view(B, T, *q.shape[1:]).copy_(out.transpose(1, 2))
    return into


def attend(
    layer: int,
    batch: StepBatch,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    pool: ColdPool,
    ring: HotRing,
    sinks: SinkStore | None,
    image_pool: ColdPool | None = None,
    raised_pool: ColdPool | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the step's new tokens over each sequence's strata: ``[T, Hq, D]`` in q's
    dtype, as `kvstrata.radix.attention.attend` computes it (same plan, same keys; image pages from
    ``image_pool`` when the plan has them). Groups of prompts with no history (`prompt_only`) take
    torch SDPA (`causal_sdpa`), the others the kernel. ``out``: a tensor like q (not one of q, k, v)
    the kernel may write the result into (the caller copies it there if the result is another)."""

    launches = _STEP_LAUNCHES.setdefault(batch, {})

    def group_out(g: GroupPlan, into: torch.Tensor | None = None) -> torch.Tensor:
        gq, gk, gv = (g.take(x).contiguous() for x in (q, k, v))
        if prompt_only(g):
            return causal_sdpa(g, gq, gk, gv, scale, into)
        return attend_group(
            layer, g, gq, gk, gv, scale, pool, ring, sinks, None, image_pool, raised_pool, launches, into
        )

    if len(batch.groups) == 1 and batch.groups[0].rows is None:
        return group_out(batch.groups[0], out)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous, whatever q's strides
    # a group whose rows are one run writes its slice of a contiguous ``out`` in place (the kernels and
    # SDPA's copy write whole rows); otherwise its result is copied there
    in_place = out.is_contiguous()
    for g in batch.groups:
        g.put(out, group_out(g, g.take(out) if in_place and g.span is not None else None))
    return out
