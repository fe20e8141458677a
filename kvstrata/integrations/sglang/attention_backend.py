"""`KvstrataAttnBackend` (``--attention-backend kvstrata``): attention over the stratified pool.

Per forward batch, `init_forward_metadata` plans one kvstrata step (cold page tables, ring rows,
pages to quantize) from the batch's request rows, cached prefix lengths and new-token counts;
every layer then attends with the selected `StrataKernels` and stores its new K/V through the
pool. Attention runs before the store: a long chunk's ring writes alias rows the step still reads.

Decode steps also run in SGLang's CUDA graphs (with the Triton kernels): `init_cuda_graph_state`
makes the static buffers (`graph.DecodeGraphState`), ``init_forward_metadata_out_graph`` plans each
captured or replayed step on the host and copies the plan in, and ``init_forward_metadata_in_graph``
records the device gathers of page tables and page ids. Prefill steps run eagerly
(``--disable-prefill-cuda-graph``); so do decode batches larger than the largest captured one, which
with the Triton kernels are planned the same way on buffers of their own.

No decode step reads the device on the host: SGLang gives decode steps their request rows only as a
device tensor, so rows come from the request ids (`request_rows`), and sequence lengths from SGLang's
host mirror. A host read would wait for every earlier GPU operation and undo SGLang's overlap of the
next batch's scheduling with this batch's forward.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from kvstrata.integrations.sglang.graph import DecodeGraphState
from kvstrata.integrations.sglang.kernels import StrataKernels, TritonStrataKernels, make_kernels
from kvstrata.integrations.sglang.pool import StratifiedTokenToKVPool
from kvstrata.integrations.sglang.request_rows import (
    RequestRows,
    assert_rows_on_device,
    host_rows,
    padded_rows,
)

BACKEND_NAME = "kvstrata"

log = logging.getLogger(__name__)


def step_lengths(forward_batch, requests: RequestRows) -> tuple[list[int], list[int], list[int]]:
    """(request rows, cached prefix lengths, new-token counts) of a decode, extend or mixed batch,
    read from host data only on decode steps (`request_rows`); an extend step records its requests'
    rows. Speculative verify and draft modes would commit tokens that may be rejected: refused."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    mode = forward_batch.forward_mode
    if mode == ForwardMode.DECODE:
        bs = forward_batch.req_pool_indices.shape[0]
        rows, _ = padded_rows(requests, getattr(forward_batch, "rids", None), bs)
        prefix = decode_prefix_lens(forward_batch)
        return rows.tolist(), prefix.tolist(), [1] * rows.size
    if mode not in (ForwardMode.EXTEND, ForwardMode.MIXED):
        raise NotImplementedError(f"kvstrata attention: forward mode {mode.name} is not supported")
    rows = host_rows(forward_batch)
    if forward_batch.rids is not None:
        requests.record(forward_batch.rids, rows)
    prefix = [int(n) for n in forward_batch.extend_prefix_lens_cpu]
    return rows, prefix, [int(n) for n in forward_batch.extend_seq_lens_cpu]


def decode_prefix_lens(forward_batch) -> torch.Tensor:
    """Cached prefix lengths of a decode batch's entries (host int64): its sequence lengths less the
    new token, from SGLang's host mirror (a copy from the device only where a batch has none)."""
    seq_lens = forward_batch.seq_lens_cpu
    if seq_lens is None:
        seq_lens = forward_batch.seq_lens.cpu()
    return seq_lens.to(torch.long) - 1


class KvstrataAttnBackend(AttentionBackend):
    def __init__(self, model_runner, kernels: StrataKernels | None = None) -> None:
        super().__init__()
        pool = model_runner.token_to_kv_pool
        if not isinstance(pool, StratifiedTokenToKVPool):
            raise ValueError(
                "--attention-backend kvstrata reads kvstrata's stratified KV pool, which is installed "
                "with --radix-cache-backend kvstrata and a kvstrata codec in KVSTRATA_KV_CODEC (with "
                "KVSTRATA_KV_CODEC=auto SGLang keeps its own pool: use one of SGLang's attention "
                "backends); got " + type(pool).__name__
            )
        self.pool = pool
        self.kernels = kernels or make_kernels(device=pool.device)
        pool.kernels = self.kernels
        pool.bind_requests(model_runner.req_to_token_pool)
        self.requests = RequestRows(model_runner.req_to_token_pool)
        self.graph: DecodeGraphState | None = None  # the CUDA graphs' static buffers
        self.eager_decode: DecodeGraphState | None = None

    def init_forward_metadata(self, forward_batch) -> None:
        """Plan an eager step. Decode steps with the Triton kernels are planned as a graph replay is
        (`graph.DecodeGraphState`: no host read of the device, a few integers per entry copied in);
        other steps build kvstrata's `StepBatch` on the host."""
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        if forward_batch.forward_mode.is_idle():
            self.pool.step = None
            return
        if forward_batch.forward_mode == ForwardMode.DECODE and isinstance(self.kernels, TritonStrataKernels):
            state = self._eager_decode_state(forward_batch.req_pool_indices.shape[0])
            self._load_decode(state, forward_batch, in_capture=False)
            self._gather_decode(state, forward_batch)
            return
        rows, prefix_lens, extend_lens = step_lengths(forward_batch, self.requests)
        self.pool.plan_step(rows, prefix_lens, extend_lens)
        device_rows = forward_batch.req_pool_indices
        # non_blocking: a blocking copy to the device would wait for the stream (the plan's own
        # copies do, but this check should not add a wait)
        planned = torch.tensor(rows).to(device_rows.device, non_blocking=True)
        assert_rows_on_device(planned, device_rows)

    def _decode_state(self, max_bs: int) -> DecodeGraphState:
        pool = self.pool
        assert pool.ring is not None
        max_context = pool.req_to_token_pool.req_to_token.shape[1]
        ring = pool.ring
        P, device = pool.page_size, pool.device
        return DecodeGraphState(max_bs, max_context, P, ring.capacity, ring.null_row, device)

    def _eager_decode_state(self, bs: int) -> DecodeGraphState:
        """The buffers of eager decode steps, for ``bs`` entries or more (grown by powers of two)."""
        state = self.eager_decode
        if state is None or state.max_bs < bs:
            state = self.eager_decode = self._decode_state(1 << (bs - 1).bit_length())
        return state

    def _load_decode(self, state: DecodeGraphState, forward_batch, in_capture: bool) -> None:
        """Plan a decode step on the host from host data only and copy the plan into ``state``."""
        bs = forward_batch.req_pool_indices.shape[0]
        if in_capture:  # a batch of padding only
            rows, generations = np.zeros(bs, dtype=np.int64), np.zeros(bs, dtype=np.int64)
        else:
            rows, generations = padded_rows(self.requests, getattr(forward_batch, "rids", None), bs)
        plan = self.pool.plan_decode(rows, generations, decode_prefix_lens(forward_batch))
        self.pool.step = state.load(plan)
        if state is not self.graph:  # eager: the page table as wide as this batch's history
            self.pool.step = state.narrowed(bs, max(1, int(plan.lengths[0].max())))

    def _gather_decode(self, state: DecodeGraphState, forward_batch) -> None:
        """The device half of a decode step's plan (`DecodeGraphState.gather`), and the device-side
        check that its rows are SGLang's."""
        bs = forward_batch.req_pool_indices.shape[0]
        state.gather(bs, self.pool.req_to_token_pool.req_to_token)
        assert_rows_on_device(state.views["rows"][:bs], forward_batch.req_pool_indices[:bs])

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        if not isinstance(self.kernels, TritonStrataKernels):
            raise ValueError(
                "kvstrata attention captures CUDA graphs with its Triton kernels only "
                f"(KVSTRATA_ATTENTION_KERNELS=auto or triton); got {type(self.kernels).__name__}: "
                "pass --disable-cuda-graph"
            )
        self.graph = self._decode_state(max_bs)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        """Plan a captured or replayed decode step on the host and copy it into the static inputs."""
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        if self.graph is None:
            raise RuntimeError("kvstrata attention: init_cuda_graph_state was not called")
        if forward_batch.forward_mode != ForwardMode.DECODE:
            raise NotImplementedError(
                f"kvstrata attention captures decode steps only, not {forward_batch.forward_mode.name}: "
                "pass --disable-prefill-cuda-graph"
            )
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "kvstrata attention plans each decode replay on the host: its metadata preparation "
                "cannot be captured (unset SGLANG_ENABLE_METADATA_GLUE_GRAPH)"
            )
        self._load_decode(self.graph, forward_batch, in_capture)

    def init_forward_metadata_in_graph(self, forward_batch) -> None:
        assert self.graph is not None
        self._gather_decode(self.graph, forward_batch)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache)

    def _forward(self, q, k, v, layer, forward_batch, save_kv_cache: bool) -> torch.Tensor:
        pool, step = self.pool, self.pool.step
        if step is None:
            raise RuntimeError("kvstrata attention: init_forward_metadata was not called for this batch")
        hq, hkv, d = layer.tp_q_head_num, layer.tp_k_head_num, layer.head_dim
        # SGLang's q, k and v are views of the fused QKV projection's output: the kernels read them
        # contiguous, so k and v are copied here once, not by the attention and the page quantize each.
        q3 = q.reshape(-1, hq, d).contiguous()
        k3, v3 = k.reshape(-1, hkv, d).contiguous(), v.reshape(-1, hkv, d).contiguous()
        assert pool.ring is not None
        local = layer.layer_id - pool.start_layer
        out = self.kernels.attend(local, step, q3, k3, v3, layer.scaling, pool.cold, pool.ring)
        if save_kv_cache:
            k_scale, v_scale = getattr(layer, "k_scale", None), getattr(layer, "v_scale", None)
            pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k3, v3, k_scale, v_scale)
        return out.to(q.dtype).reshape(-1, hq * d)


def create_kvstrata_backend(model_runner) -> KvstrataAttnBackend:
    """SGLang's factory: the backend, its Triton kernels compiled for the extend and eager decode
    steps before the server takes requests (`warm_up_backend`; CUDA only, ``KVSTRATA_WARMUP=0``
    skips it)."""
    from kvstrata.integrations.sglang.warmup import warmup_enabled

    backend = KvstrataAttnBackend(model_runner)
    on_cuda = torch.device(backend.pool.device).type == "cuda"
    if warmup_enabled() and on_cuda and isinstance(backend.kernels, TritonStrataKernels):
        warm_up_backend(backend, model_runner)
    return backend


def warm_up_backend(backend: KvstrataAttnBackend, model_runner) -> float | None:
    """`warmup.warm_up` for the backend's pool and kernels; seconds taken, or None when it failed
    (logged: serving never depends on it, the first batches then compile as before)."""
    from sglang.srt.runtime_context import get_parallel

    from kvstrata.integrations.sglang.warmup import warm_up

    try:
        q_heads = model_runner.model_config.get_num_attention_heads(get_parallel().attn_tp_size)
        seconds = warm_up(backend.pool, q_heads, backend.kernels)
    except Exception as exc:  # noqa: BLE001  (an optimization: serving never depends on it)
        log.warning("kvstrata: kernel warm-up failed, the first batches compile instead: %r", exc)
        return None
    log.info("kvstrata: extend and eager decode kernels compiled in %.1f s", seconds)
    return seconds
