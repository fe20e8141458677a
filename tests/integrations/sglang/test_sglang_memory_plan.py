"""SGLang's own memory plan (``DefaultPoolConfigurator``) with the kvstrata hooks: tokens that fit
for a Llama-3-8B-shaped model (32 layers, 8 KV heads of 128) in a fixed KV budget, against SGLang's
BF16 pool in the same budget, with the rings of ``--max-running-requests`` taken off first."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.integrations.sglang.conftest import published_topology

LAYERS_8B, KV_HEADS_8B, HEAD_DIM_8B = 32, 8, 128
PAGE_8B = 16
BUDGET = 100 << 30  # bytes SGLang's profile left for the KV pool
RUNNING = 256
BF16_CELL = LAYERS_8B * KV_HEADS_8B * 2 * HEAD_DIM_8B * 2


def plan(kv_dtype: torch.dtype = torch.bfloat16, **server_args) -> tuple[int, object]:
    """(max_total_num_tokens, configurator) from SGLang's ``DefaultPoolConfigurator`` for the model
    whose KV dtype (the model's, with ``--kv-cache-dtype auto``) is ``kv_dtype``."""
    from sglang.srt.model_executor.pool_configurator import DefaultPoolConfigurator
    from sglang.srt.plugins import load_plugins
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from transformers import LlamaConfig

    load_plugins()
    hf = LlamaConfig(num_hidden_layers=LAYERS_8B, num_key_value_heads=KV_HEADS_8B, head_dim=HEAD_DIM_8B)
    model = SimpleNamespace(
        hf_config=hf,
        linear_attn_registry_result=None,
        is_draft_model=False,
        context_len=8192,
        head_dim=HEAD_DIM_8B,
        v_head_dim=HEAD_DIM_8B,
        get_num_kv_heads=lambda *tp: KV_HEADS_8B,
    )
    with published_topology(page_size=PAGE_8B, **server_args) as args:
        kvc = SimpleNamespace(
            kv_cache_dtype_str="auto",
            kv_cache_dtype=kv_dtype,
            model_dtype=kv_dtype,
            model_config=model,
            layer_info=SimpleNamespace(num_effective_layers=LAYERS_8B, start_layer=0, end_layer=LAYERS_8B),
            use_mla_backend=False,
            server_args=args,
            spec_algorithm=SpeculativeAlgorithm.NONE,
            is_draft_worker=False,
            ps=SimpleNamespace(pp_size=1),
            pp_size=1,
        )
        configurator = DefaultPoolConfigurator(kvc)
        return configurator.calculate_pool_sizes(BUDGET, PAGE_8B).max_total_num_tokens, configurator


@pytest.mark.parametrize("codec", ["fp8_e4m3", "int4", "fp4_e2m1"])
def test_tokens_that_fit_grow_by_the_codec(codec, monkeypatch):
    from kvstrata.radix.pool import cold_page_bytes

    bf16_tokens, bf16 = plan()
    assert bf16._cell_size == BF16_CELL
    assert bf16_tokens == BUDGET // BF16_CELL // PAGE_8B * PAGE_8B

    monkeypatch.setenv("KVSTRATA_KV_CODEC", codec)
    monkeypatch.setenv("KVSTRATA_RECENT_WINDOW", "128")
    tokens, ours = plan(radix_cache_backend="kvstrata", max_running_requests=RUNNING)
    page = cold_page_bytes([codec] * LAYERS_8B, PAGE_8B, KV_HEADS_8B, HEAD_DIM_8B)
    cell = -(-page // PAGE_8B)
    ring = ((RUNNING + 1) * (128 + PAGE_8B) + 1) * BF16_CELL
    assert (ours._cell_size, ours.kvstrata_ring_bytes) == (cell, ring)
    assert tokens == (BUDGET - ring) // cell // PAGE_8B * PAGE_8B
    # The planned pages and the rings fit the budget (SGLang's padding page 0 lies outside its plan
    # for every pool, BF16 included).
    assert tokens // PAGE_8B * page + ring <= BUDGET
    compression = BF16_CELL / cell
    ratio = tokens / bf16_tokens
    print(
        f"{codec}: {tokens} tokens fit vs {bf16_tokens} in SGLang's BF16 pool ({ratio:.3f}x; "
        f"{compression:.3f}x per token, rings {ring / 2**30:.2f} GiB)"
    )
    # The gain is the codec's per-token compression less the rings' share of the budget.
    assert abs(ratio - compression * (1 - ring / BUDGET)) < 1e-4


def test_rings_of_a_float32_model_are_float32(monkeypatch):
    """A float32 model keeps a float32 ring (the pool's `ring_dtype`): the rings cost twice the BF16 ones."""
    from kvstrata.integrations.sglang.memory_plan import ring_dtype

    monkeypatch.setenv("KVSTRATA_KV_CODEC", "fp32")
    monkeypatch.setenv("KVSTRATA_RECENT_WINDOW", "128")
    _, ours = plan(torch.float32, radix_cache_backend="kvstrata", max_running_requests=RUNNING)
    assert ours.kvstrata_ring_bytes == ((RUNNING + 1) * (128 + PAGE_8B) + 1) * 2 * BF16_CELL
    assert [ring_dtype(d) for d in (torch.float32, torch.float16, torch.float8_e4m3fn)] == [
        torch.float32,
        torch.float16,
        torch.bfloat16,
    ]


def test_codec_auto_keeps_sglangs_plan(monkeypatch):
    """``KVSTRATA_KV_CODEC=auto``: SGLang's own pool, so its own plan (no rings, no
    ``--max-running-requests`` needed) with the kvstrata radix cache selected."""
    bf16_tokens, _ = plan()
    monkeypatch.setenv("KVSTRATA_KV_CODEC", "auto")
    tokens, ours = plan(radix_cache_backend="kvstrata")
    assert (tokens, ours._cell_size) == (bf16_tokens, BF16_CELL)
    assert not hasattr(ours, "kvstrata_ring_bytes")


def test_rings_need_max_running_requests(monkeypatch):
    with pytest.raises(ValueError, match="--max-running-requests"):
        plan(radix_cache_backend="kvstrata")
