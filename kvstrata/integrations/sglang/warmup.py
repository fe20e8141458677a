"""Compile the Triton variants of the plugin's extend and eager decode steps before SGLang serves.

Triton compiles a kernel once per set of its constexprs (`kvstrata.radix.kernels.jit` leaves the
per-step integer and pointer arguments unspecialized): for the attention kernel, the query tile
(from the new tokens per request times the query heads per KV head), whether a pass writes split
partials, and the codec's launch shape; the page-quantize kernel has its own. SGLang's decode-graph
capture compiles the decode variants at startup, but the extend variants were compiled by the first
prefill batches while requests waited (on the H200: about 12 s before the first 8,192-token batch of
the benchmark completed; docs/sglang.md). `warm_up` runs a few steps on a scratch pool of one layer
with the served pool's codec, window, page size, heads and dtype, so that those compiles happen at
startup: fresh prompts (torch SDPA; their completed pages quantized by the kernel), chunks that
continue a prompt (3 new tokens to 8 pages of them, over 0, 1, 16 and 20 cold pages; several requests
per step), extends of 2 to 300 new tokens over history (every query tile; before, only the 16- and
128-row tiles at 4 query heads a KV head were met, so a 5- to 16-token extend would compile while serving,
as it did in kvstrata's own engine), and eager decode over short and long histories (planned as graph
replays are with the Triton kernels, as kvstrata's own steps with the torch ones). The served pool is
not touched.
"""

from __future__ import annotations

import logging
import os
import time
from types import SimpleNamespace

import torch

from kvstrata.engine.warmup import EXTEND_TOKENS
from kvstrata.integrations.sglang.memory_plan import ring_dtype

log = logging.getLogger(__name__)

ENV_WARMUP = "KVSTRATA_WARMUP"


def warmup_enabled() -> bool:
    return os.environ.get(ENV_WARMUP, "1") not in ("0", "false", "no")


def forward_batch(rows, prefix_lens, extend_lens, out_cache_loc, decode: bool, rids=None):
    """The fields of SGLang's ``ForwardBatch`` the kvstrata backend reads, for one batch of request
    ``rows`` (request ids ``rids``, by default the rows' numbers) with cached ``prefix_lens`` and
    ``extend_lens`` new tokens at ``out_cache_loc``. As in SGLang 0.5.23, only an extend batch has a
    host copy of its rows."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    lengths = torch.tensor([p + n for p, n in zip(prefix_lens, extend_lens, strict=True)])
    return SimpleNamespace(
        forward_mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
        req_pool_indices=torch.tensor(rows, device=out_cache_loc.device),
        req_pool_indices_cpu=None if decode else torch.tensor(rows),
        rids=[str(r) for r in rows] if rids is None else list(rids),
        seq_lens=lengths,
        seq_lens_cpu=lengths,
        extend_prefix_lens_cpu=list(prefix_lens),
        extend_seq_lens_cpu=list(extend_lens),
        out_cache_loc=out_cache_loc,
    )


def warmup_steps(window: int, page: int) -> list[list[tuple[int, int, int]]]:
    """The steps, each a batch of (request, cached prefix length, new tokens); every request
    continues where its last step left it. After the fresh prompts and the chunks, requests 1, 3, 4
    and 5 extend by the engine's warm-up counts (`kvstrata.engine.warmup.EXTEND_TOKENS`: every query
    tile of an extend at 1 to 16 query heads a KV head), four a step; request 2 stays short for the
    decode over a short history."""
    W, P = window, page
    fresh = [[(1, 0, 4 * P), (2, 0, 2 * P + 3)], [(3, 0, W + 20 * P)], [(4, 0, W + P), (5, 0, W + 16 * P)]]
    chunks = [[(3, W + 20 * P, P + 5)], [(4, W + P, 2 * P), (5, W + 16 * P, 3)], [(1, 4 * P, 8 * P)]]
    ends = {1: 12 * P, 2: 2 * P + 3, 3: W + 21 * P + 5, 4: W + 3 * P, 5: W + 16 * P + 3}
    extending = (1, 3, 4, 5)
    extends: list[list[tuple[int, int, int]]] = []
    for i, n in enumerate(EXTEND_TOKENS):
        if i % len(extending) == 0:
            extends.append([])
        r = extending[i % len(extending)]
        extends[-1].append((r, ends[r], n))
        ends[r] += n
    decode = [[(r, ends[r], 1) for r in ends], [(2, ends[2] + 1, 1)]]
    return fresh + chunks + extends + decode


def warm_up(pool, q_heads: int, kernels) -> float:
    """Run `warmup_steps` with ``kernels`` on a one-layer scratch copy of ``pool``'s configuration;
    returns the seconds taken."""
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    from kvstrata.integrations.sglang.attention_backend import KvstrataAttnBackend

    t0 = time.perf_counter()
    P, window, device = pool.page_size, pool.options.recent_window, pool.device
    steps = warmup_steps(window, P)
    longest = max(L + n for step in steps for _, L, n in step)
    row_pages = -(-longest // P)
    rows = max(r for step in steps for r, _, _ in step) + 1
    size = rows * row_pages * P
    scratch = type(pool)(
        size=size,
        page_size=P,
        dtype=pool.dtype,
        head_num=pool.head_num,
        head_dim=pool.head_dim,
        layer_num=1,
        device=device,
        enable_memory_saver=False,
        enable_alt_stream=False,
        allocation_label="kvstrata warm-up scratch",
    )
    req_pool = ReqToTokenPool(
        size=rows, max_context_len=row_pages * P, device=device, enable_memory_saver=False
    )
    for r in range(1, rows):  # row r owns pages r * row_pages ..; page 0 stays SGLang's padding page
        req_pool.req_to_token[r] = (
            torch.arange(row_pages * P, dtype=torch.int32, device=device) + r * row_pages * P
        )
    backend = KvstrataAttnBackend(
        SimpleNamespace(token_to_kv_pool=scratch, req_to_token_pool=req_pool), kernels
    )
    h, d = pool.head_num, pool.head_dim
    layer = SimpleNamespace(tp_q_head_num=q_heads, tp_k_head_num=h, head_dim=d, layer_id=0, scaling=d**-0.5)
    dtype = ring_dtype(pool.dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    for step in steps:
        decode = all(n == 1 for _, _, n in step)
        loc = torch.cat([req_pool.req_to_token[r, L : L + n] for r, L, n in step]).to(torch.int64)
        fb = forward_batch(
            [r for r, _, _ in step], [L for _, L, _ in step], [n for _, _, n in step], loc, decode
        )
        backend.init_forward_metadata(fb)
        T = loc.numel()
        q = torch.randn(T, q_heads * d, generator=gen, device=device).to(dtype)
        k = torch.randn(T, h * d, generator=gen, device=device).to(dtype)
        v = torch.randn(T, h * d, generator=gen, device=device).to(dtype)
        (backend.forward_decode if decode else backend.forward_extend)(q, k, v, layer, fb)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0
