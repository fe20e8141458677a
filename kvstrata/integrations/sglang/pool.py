"""`StratifiedTokenToKVPool`: SGLang's MHA KV pool with kvstrata's strata instead of a BF16 buffer.

History is stored as quantized cold pages (`kvstrata.radix.pool.ColdPool`) whose page ids are
SGLang's own page indices (``slot // page_size``), so SGLang's allocator, ``req_to_token`` and radix
tree stay unchanged. The recent window of each request row is kept in a BF16 ring
(`kvstrata.radix.ring.HotRing`, one slot per ``ReqToTokenPool`` row; FP16 or float32 when SGLang's
KV dtype is, see `memory_plan.ring_dtype`). A token is written once to
the ring; a page is quantized once, in the step that completes it (so the tree can share it at
once), and read from the ring while it is inside the window. Only ``--attention-backend kvstrata``
reads this pool: plain ``get_key_buffer`` readers are refused with a clear error.
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, unwrap_write_loc

from kvstrata.integrations.sglang.kernels import StrataKernels, TorchStrataKernels
from kvstrata.integrations.sglang.memory_plan import ring_dtype
from kvstrata.integrations.sglang.options import PluginOptions
from kvstrata.integrations.sglang.step import DecodePlan, RingBook
from kvstrata.radix.plan import NullRows, StepBatch
from kvstrata.radix.pool import ColdPool
from kvstrata.radix.ring import HotRing


class StratifiedTokenToKVPool(MHATokenToKVPool):
    """Built by SGLang's configurator with the in-tree class's keyword arguments; `options` is a
    class attribute because the configurator passes no extra ones (see `pool_class`)."""

    options: PluginOptions = PluginOptions()

    def _create_buffers(self) -> None:
        if self.v_head_dim != self.head_dim:
            raise ValueError(f"kvstrata pool: v_head_dim {self.v_head_dim} != head_dim {self.head_dim}")
        P = self.page_size
        if self.options.recent_window % P:
            raise ValueError(f"kvstrata recent window {self.options.recent_window} is not a multiple of {P}")
        # SGLang's slots run 0 .. size + page_size - 1 (page 0 absorbs padded writes): one cold
        # page per SGLang page, plus ColdPool's own null page that padded page tables read.
        self.num_cold_pages = (self.size + P) // P
        codecs = [self.options.codec] * self.layer_num
        self.cold = ColdPool(codecs, self.num_cold_pages, P, self.head_num, self.head_dim, self.device)
        self.ring_dtype = ring_dtype(self.dtype)
        self.ring: HotRing | None = None
        self.rings: RingBook | None = None
        self.step: StepBatch | None = None
        self.kernels: StrataKernels = TorchStrataKernels()
        self.quantized_pages = 0
        self.overflow = 0
        self.k_buffer, self.v_buffer = [], []
        self.k_scale_buffer = self.v_scale_buffer = None
        self.native_k_scale_buffer = self.native_v_scale_buffer = None
        self.dq_k_buffer = self.dq_v_buffer = None

    # ---- sizes ---------------------------------------------------------------------------------
    def get_kv_size_bytes(self) -> tuple[int, int]:
        """(K, V) bytes of the cold pages (codes and scales), the null page excluded."""
        n = self.num_cold_pages
        k = sum(t[:n].nbytes for bufs in self.cold.k for t in bufs.values())
        v = sum(t[:n].nbytes for bufs in self.cold.v for t in bufs.values())
        return k, v

    @property
    def ring_bytes(self) -> int:
        return 0 if self.ring is None else self.ring.total_bytes

    # ---- binding to SGLang's request rows ------------------------------------------------------
    def bind_requests(self, req_to_token_pool) -> None:
        """Allocate one ring slot per ``ReqToTokenPool`` row (row 0 included: padded batches use it)."""
        rows = req_to_token_pool.req_to_token.shape[0]
        P, window = self.page_size, self.options.recent_window
        self.req_to_token_pool = req_to_token_pool
        self.ring = HotRing(
            self.layer_num, rows, window + P, self.head_num, self.head_dim, self.ring_dtype, self.device
        )
        nulls = NullRows(page=self.cold.null_page, sink=0, ring_row=self.ring.null_row)
        self.rings = RingBook(rows, P, self.ring.capacity, window, nulls)

    def plan_step(self, rows: list[int], prefix_lens: list[int], extend_lens: list[int]) -> StepBatch:
        """Plan the forward step of these request rows; every layer's attention and store use it."""
        book, pool = self._book(), self.req_to_token_pool
        generations = pool.req_generation[rows].tolist()  # a CPU tensor: one gather, not one per row
        self.step = book.plan(
            rows, generations, prefix_lens, extend_lens, pool.req_to_token, torch.device(self.device)
        )
        self.quantized_pages += int(self.step.write.page_ids.numel())
        return self.step

    def plan_decode(self, rows, generations, prefix_lens) -> DecodePlan:
        """Plan a decode step for a captured graph (`graph.DecodeGraphState`) from host arrays of
        the entries' request rows, their generations and cached prefix lengths; row 0 is padding."""
        plan = self._book().plan_decode(rows, generations, prefix_lens)
        self.quantized_pages += plan.pages_completed
        return plan

    def _book(self) -> RingBook:
        if self.rings is None:
            raise RuntimeError("kvstrata pool: no request rows bound (use --attention-backend kvstrata)")
        return self.rings

    # ---- writes and reads ----------------------------------------------------------------------
    def set_kv_buffer(self, layer, loc_info, cache_k, cache_v, k_scale=None, v_scale=None, **kwargs) -> None:
        """Store the step's new K/V (``[T, H, D]``, in the order of `plan_step`): ring rows, and
        the pages this step completes quantized once. ``loc_info`` must be the step's slots."""
        if self.step is None:
            raise RuntimeError("kvstrata pool: set_kv_buffer outside a planned step")
        if kwargs.get("dcp_kv_mask") is not None:
            raise NotImplementedError("kvstrata pool: decode context parallelism is not supported")
        loc, _, _ = unwrap_write_loc(loc_info)
        if loc.numel() != self.step.num_tokens:
            n = self.step.num_tokens
            raise ValueError(f"kvstrata pool: {loc.numel()} slots for a step of {n} tokens")
        layer_id = kwargs.get("layer_id_override")
        local = (layer.layer_id if layer_id is None else layer_id) - self.start_layer
        H, D = self.head_num, self.head_dim
        k = cache_k.reshape(-1, H, D)
        v = cache_v.reshape(-1, H, D)
        if k_scale is not None:
            k = k / k_scale
        if v_scale is not None:
            v = v / v_scale
        assert self.ring is not None
        counts = self.kernels.store(local, self.step, k, v, self.cold, self.ring)
        self.overflow += counts.overflow_k + counts.overflow_v

    def read_request(self, layer_id: int, row: int, length: int, dtype: torch.dtype = torch.float32):
        """K and V ``[length, H, D]`` of a request row as attention sees them: cold pages below the
        ring's start (dequantized), ring rows after it. For tests and debugging."""
        assert self.rings is not None and self.ring is not None
        ring, P = self.rings.ring(row), self.page_size
        if length != ring.length:
            raise ValueError(f"row {row} holds {ring.length} tokens, asked for {length}")
        local = layer_id - self.start_layer
        slots = self.req_to_token_pool.req_to_token[row, 0 : ring.start : P].to(torch.long)
        k_cold, v_cold = self.cold.read(local, slots // P, dtype)
        rows = torch.tensor(self.ring.rows(row, ring.start, length), dtype=torch.long, device=k_cold.device)
        H, D = self.head_num, self.head_dim
        k = torch.cat([k_cold.reshape(-1, H, D), self.ring.k[local].index_select(0, rows).to(dtype)])
        v = torch.cat([v_cold.reshape(-1, H, D), self.ring.v[local].index_select(0, rows).to(dtype)])
        return k, v

    def _refuse(self, layer_id: int):
        raise NotImplementedError(
            "the kvstrata KV pool stores quantized pages and a BF16 ring; only "
            "--attention-backend kvstrata reads it"
        )

    get_key_buffer = get_value_buffer = _get_key_buffer = _get_value_buffer = _refuse

    def get_kv_buffer(self, layer_id: int):
        self._refuse(layer_id)


def pool_class(options: PluginOptions) -> type[StratifiedTokenToKVPool]:
    """A pool class carrying ``options`` (SGLang constructs the class it is given)."""
    attrs = {"options": options, "__module__": __name__}
    return type("KvstrataTokenToKVPool", (StratifiedTokenToKVPool,), attrs)
