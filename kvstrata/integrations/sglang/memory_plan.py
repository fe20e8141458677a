"""SGLang's memory plan with the stratified pool: how many tokens fit, and what the rings cost.

SGLang sizes its KV pool as ``max_total_num_tokens = available_bytes // cell_size`` in its
``DefaultPoolConfigurator`` (the same class in 0.5.17 and 0.5.23), with ``cell_size`` the bytes one
token takes in a BF16 (or ``--kv-cache-dtype``) pool. With ``--radix-cache-backend kvstrata`` and a
kvstrata codec (not ``KVSTRATA_KV_CODEC=auto``, which keeps SGLang's pool and plan) two AROUND hooks
change that plan:

- ``_compute_cell_size``: a token costs its share of a cold page in kvstrata's codec, scales
  included (``ceil(cold_page_bytes / page_size)``), so ``max_total_num_tokens`` grows by the codec's
  compression;
- ``calculate_pool_sizes``: the BF16 rings (``recent_window + page_size`` tokens for each of the
  ``max_running_requests + 1`` rows of SGLang's ``ReqToTokenPool``, plus one null row) are taken off
  the budget first. The rows are only known from ``--max-running-requests``, which is therefore
  required (SGLang's own default, thousands of rows, would give the rings most of the memory).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstrata.integrations.sglang.options import PluginOptions
from kvstrata.radix.pool import cold_page_bytes

CELL_SIZE_TARGET = "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size"
POOL_SIZES_TARGET = "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator.calculate_pool_sizes"
RING_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def ring_dtype(kv_dtype: torch.dtype) -> torch.dtype:
    """The BF16 ring's dtype for SGLang's KV dtype: the model's own 16- or 32-bit float (a float32
    model keeps float32 recent tokens, as kvstrata's engine does), BF16 for anything else."""
    return kv_dtype if kv_dtype in RING_DTYPES else torch.bfloat16


@dataclass(frozen=True)
class StrataPlan:
    """Bytes of the stratified pool of one rank: per token of history, and the rings."""

    cell_size: int
    ring_bytes: int


def strata_plan(
    options: PluginOptions,
    num_layers: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    max_running: int,
    ring_item_bytes: int = 2,
) -> StrataPlan:
    page = cold_page_bytes([options.codec] * num_layers, page_size, kv_heads, head_dim)
    rows = max_running + 1  # SGLang's ReqToTokenPool has a padding row 0
    ring_token = 2 * num_layers * kv_heads * head_dim * ring_item_bytes
    ring_tokens = rows * (options.recent_window + page_size) + 1  # + the null row
    return StrataPlan(cell_size=-(-page // page_size), ring_bytes=ring_tokens * ring_token)


def cell_size_hook(original, configurator, kvc, num_layers: int, *args, **kwargs) -> int:
    """AROUND hook on ``DefaultPoolConfigurator._compute_cell_size`` (see the module docstring)."""
    from kvstrata.integrations.sglang import stratified_pool_selected

    if not stratified_pool_selected() or kvc.use_mla_backend:
        return original(configurator, kvc, num_layers, *args, **kwargs)
    from sglang.srt.runtime_context import get_parallel, get_schedule

    schedule = get_schedule()
    if schedule.max_running_requests is None:
        raise ValueError(
            "--radix-cache-backend kvstrata keeps a BF16 ring of the recent window for every running "
            "request: set --max-running-requests so the rings can be sized into the memory plan"
        )
    model = kvc.model_config
    plan = strata_plan(
        PluginOptions.from_env(),
        num_layers,
        model.get_num_kv_heads(get_parallel().attn_tp_size),
        model.head_dim,
        schedule.page_size,
        schedule.max_running_requests,
        ring_dtype(kvc.kv_cache_dtype).itemsize,
    )
    configurator.kvstrata_ring_bytes = plan.ring_bytes
    return plan.cell_size


def pool_sizes_hook(original, configurator, available_bytes: int, page_size: int, *args, **kwargs):
    """AROUND hook on ``DefaultPoolConfigurator.calculate_pool_sizes``: the rings come off first."""
    ring = getattr(configurator, "kvstrata_ring_bytes", 0)
    return original(configurator, max(available_bytes - ring, 0), page_size, *args, **kwargs)
