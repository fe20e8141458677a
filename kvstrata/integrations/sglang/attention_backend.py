"""`KvstrataAttnBackend` (``--attention-backend kvstrata``): attention over the stratified pool.

Per forward batch, `init_forward_metadata` plans one kvstrata step (cold page tables, ring rows,
pages to quantize) from the batch's request rows, cached prefix lengths and new-token counts;
every layer then attends with the selected `StrataKernels` and stores its new K/V through the
pool. Attention runs before the store: a long chunk's ring writes alias rows the step still reads.
CUDA graphs are not supported yet (run with ``--disable-cuda-graph``).
"""

from __future__ import annotations

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from kvstrata.integrations.sglang.kernels import StrataKernels, make_kernels
from kvstrata.integrations.sglang.pool import StratifiedTokenToKVPool

BACKEND_NAME = "kvstrata"


def step_lengths(forward_batch) -> tuple[list[int], list[int], list[int]]:
    """(request rows, cached prefix lengths, new-token counts) of a decode, extend or mixed batch.
    Speculative verify and draft modes would commit tokens that may be rejected: refused."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    mode = forward_batch.forward_mode
    rows = [int(r) for r in forward_batch.req_pool_indices.tolist()]
    if mode == ForwardMode.DECODE:
        seq_lens = forward_batch.seq_lens_cpu
        seq_lens = forward_batch.seq_lens.tolist() if seq_lens is None else seq_lens.tolist()
        return rows, [int(s) - 1 for s in seq_lens], [1] * len(rows)
    if mode not in (ForwardMode.EXTEND, ForwardMode.MIXED):
        raise NotImplementedError(f"kvstrata attention: forward mode {mode.name} is not supported")
    prefix = [int(n) for n in forward_batch.extend_prefix_lens_cpu]
    return rows, prefix, [int(n) for n in forward_batch.extend_seq_lens_cpu]


class KvstrataAttnBackend(AttentionBackend):
    def __init__(self, model_runner, kernels: StrataKernels | None = None) -> None:
        super().__init__()
        pool = model_runner.token_to_kv_pool
        if not isinstance(pool, StratifiedTokenToKVPool):
            raise ValueError(
                "--attention-backend kvstrata reads kvstrata's stratified KV pool, which is installed "
                "with --radix-cache-backend kvstrata; got " + type(pool).__name__
            )
        self.pool = pool
        self.kernels = kernels or make_kernels(device=pool.device)
        pool.kernels = self.kernels
        pool.bind_requests(model_runner.req_to_token_pool)

    def init_forward_metadata(self, forward_batch) -> None:
        if forward_batch.forward_mode.is_idle():
            self.pool.step = None
            return
        self.pool.plan_step(*step_lengths(forward_batch))

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        raise NotImplementedError(
            "kvstrata attention does not support CUDA graphs yet: pass --disable-cuda-graph"
        )

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache)

    def _forward(self, q, k, v, layer, forward_batch, save_kv_cache: bool) -> torch.Tensor:
        pool, step = self.pool, self.pool.step
        if step is None:
            raise RuntimeError("kvstrata attention: init_forward_metadata was not called for this batch")
        hq, hkv, d = layer.tp_q_head_num, layer.tp_k_head_num, layer.head_dim
        q3 = q.reshape(-1, hq, d)
        k3, v3 = k.reshape(-1, hkv, d), v.reshape(-1, hkv, d)
        assert pool.ring is not None
        local = layer.layer_id - pool.start_layer
        out = self.kernels.attend(local, step, q3, k3, v3, layer.scaling, pool.cold, pool.ring)
        if save_kv_cache:
            k_scale, v_scale = getattr(layer, "k_scale", None), getattr(layer, "v_scale", None)
            pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k3, v3, k_scale, v_scale)
        return out.to(q.dtype).reshape(-1, hq * d)


def create_kvstrata_backend(model_runner) -> KvstrataAttnBackend:
    return KvstrataAttnBackend(model_runner)
