"""FlashInfer's paged decode as a peer column of `attention_gpu.py` (``--peers flashinfer``).

What SGLang's flashinfer attention backend runs for a decode step: `BatchDecodeWithPagedKVCacheWrapper`
over every token of the context in 16-token pages (SGLang's ``--page-size 16``; its default on CUDA is
1), NHD layout, the new token's K/V already written (as SGLang writes it before attending), BF16
queries and output, KV in BF16 or FP8 E4M3 with unit scales, tensor cores as SGLang chooses them
(`should_use_tensor_core`: FP8 KV, or a GQA group of 4 or more).
The wrapper runs with fixed buffers (``use_cuda_graph``), so `attention_gpu.bench` replays it in a CUDA
graph like the other rows. Each case is checked before it is timed: two sequences' outputs against
float32 attention over the same (dequantized) pages, relative error under ``TOLERANCE``; a case that
disagrees raises. FlashInfer is not a dependency of kvstrata: on the GPU machine it comes with the
SGLang payload's site (`../shared/sglang-gpu`), put on ``PYTHONPATH``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

PAGE = 16
KV_DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}
TOLERANCE = 2e-2
WORKSPACE_BYTES = 256 << 20
RANDOM_SLICE_ELEMENTS = 1 << 28  # `random_pages` draws this many BF16 values at a time (512 MB)


def paged_layout(batch: int, context: int, page: int = PAGE, device: str = "cuda"):
    """FlashInfer's page table of ``batch`` sequences of ``context`` tokens in consecutive pages:
    ``indptr`` ``[batch + 1]``, ``indices`` ``[batch * pages]`` and ``last_page_len`` ``[batch]``
    (int32), and the pages a sequence holds."""
    pages = -(-context // page)
    indptr = torch.arange(batch + 1, dtype=torch.int32, device=device) * pages
    indices = torch.arange(batch * pages, dtype=torch.int32, device=device)
    last = torch.full((batch,), context - (pages - 1) * page, dtype=torch.int32, device=device)
    return indptr, indices, last, pages


def uses_tensor_cores(kv_dtype: torch.dtype, hq: int, hkv: int) -> bool:
    """SGLang's choice for its flashinfer decode wrapper: tensor cores for FP8 KV or a GQA group >= 4."""
    return kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2) or hq // hkv >= 4


def reference(q: torch.Tensor, kv: torch.Tensor, seq: int, pages: int, context: int) -> torch.Tensor:
    """Float32 attention (SDPA, GQA) of sequence ``seq`` (one query token, ``q`` ``[batch, hq, d]``)
    over its ``context`` tokens in ``kv`` ``[pages_total, 2, page, hkv, d]`` (`paged_layout`'s order)."""
    own = kv[seq * pages : (seq + 1) * pages].float()
    hkv, d = kv.shape[-2], kv.shape[-1]
    k, v = (own[:, i].reshape(-1, hkv, d)[:context].transpose(0, 1) for i in (0, 1))  # [hkv, context, d]
    return F.scaled_dot_product_attention(q[seq, :, None].float(), k, v, enable_gqa=True)[:, 0]


def relative_error(out: torch.Tensor, want: torch.Tensor) -> float:
    return ((out.float() - want).norm() / want.norm()).item()


def random_pages(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """Standard-normal K/V pages in ``dtype``, drawn in BF16 a slice of pages at a time, so that an FP8
    cache never has a BF16 copy of its own size beside it (B=256 at 32K, 8B layer: 34 GB in BF16)."""
    kv = torch.empty(shape, dtype=dtype, device=device)
    step = max(1, RANDOM_SLICE_ELEMENTS // math.prod(shape[1:]))
    for start in range(0, shape[0], step):
        part = kv[start : start + step]
        part.copy_(torch.randn(part.shape, device=device, dtype=torch.bfloat16))
    return kv


def rows(
    bench, geometry: str, batch: int, context: int, hq: int, hkv: int, d: int, device: str = "cuda"
) -> list[dict]:
    """One row per KV dtype of `KV_DTYPES`: FlashInfer's decode of the case, checked (`reference`),
    then timed by ``bench`` (a function of a step, returning milliseconds)."""
    import flashinfer

    indptr, indices, last, pages = paged_layout(batch, context, device=device)
    q = torch.randn(batch, hq, d, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    got = []
    for name, dtype in KV_DTYPES.items():
        kv = random_pages((batch * pages, 2, PAGE, hkv, d), dtype, device)
        tensor_cores = uses_tensor_cores(dtype, hq, hkv)
        workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=tensor_cores,
            paged_kv_indptr_buffer=indptr.clone(),
            paged_kv_indices_buffer=indices.clone(),
            paged_kv_last_page_len_buffer=last.clone(),
        )
        wrapper.plan(
            indptr, indices, last, hq, hkv, d, PAGE,
            q_data_type=torch.bfloat16, kv_data_type=dtype, o_data_type=torch.bfloat16,
        )  # fmt: skip

        def step(wrapper=wrapper, kv=kv):
            wrapper.run(q, kv, out=out)

        step()
        for seq in (0, batch - 1):
            err = relative_error(out[seq], reference(q, kv, seq, pages, context))
            if not err < TOLERANCE:
                raise RuntimeError(f"flashinfer {name} B={batch} {context}: sequence {seq} off by {err:.3g}")
        moved = kv.numel() * kv.element_size() + 2 * q.numel() * q.element_size()
        got.append(
            dict(
                geometry=geometry,
                batch=batch,
                context=context,
                codec=f"flashinfer {name}",
                ms=bench(step),
                bytes=moved,
                tensor_cores=tensor_cores,
                flashinfer=flashinfer.__version__,
            )
        )
        del step, wrapper, workspace, kv  # ``step`` holds the cache too: freed before the next dtype's
        if device != "cpu":
            torch.cuda.empty_cache()
    return got
