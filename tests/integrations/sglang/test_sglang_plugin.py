"""Discovery through SGLang's ``load_plugins()``, the CLI, and ``create_tree_cache`` with the real package."""

from __future__ import annotations

from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest
import torch

from tests.integrations.sglang.conftest import (
    HEAD_DIM,
    KV_HEADS,
    LAYERS,
    PAGE,
    SLOTS,
    make_pools,
    published_topology,
    tree_cache_context,
)


def test_load_plugins_registers_every_backend_once():
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.mem_cache.registry import registered_radix_cache_backends
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES

    import kvstrata.integrations.sglang as plugin

    (ep,) = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "kvstrata"]
    assert ep.value == "kvstrata.integrations.sglang:register"
    load_plugins()
    assert registered_radix_cache_backends().count("kvstrata") == 1
    assert ATTENTION_BACKENDS["kvstrata"] is plugin.attention_backend.create_kvstrata_backend
    hooks = len(HookRegistry._hooks[plugin.POOL_HOOK_TARGET])
    plugin.register()
    plugin.register()
    assert registered_radix_cache_backends().count("kvstrata") == 1
    assert ATTENTION_BACKEND_CHOICES.count("kvstrata") == 1
    assert len(HookRegistry._hooks[plugin.POOL_HOOK_TARGET]) == hooks == 1


def test_cli_accepts_kvstrata_backends():
    import argparse

    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    load_plugins()
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(
        ["--model-path", "dummy", "--attention-backend", "kvstrata", "--radix-cache-backend", "kvstrata"]
    )
    assert (args.attention_backend, args.radix_cache_backend) == ("kvstrata", "kvstrata")


def build_mha_pool(**configurator_fields):
    """The MHA pool SGLang's own ``KVCacheConfigurator._build_mha_kv_pool`` builds (hooks applied)
    for a 2-layer GQA model on CPU; the configurator carries only what that method reads."""
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    fields = {
        "kv_cache_dtype_str": "auto",
        "kv_cache_dtype": torch.bfloat16,
        "pool_page_size": PAGE,
        "model_config": SimpleNamespace(
            get_num_kv_heads=lambda *tp: KV_HEADS, head_dim=HEAD_DIM, v_head_dim=HEAD_DIM
        ),
        "layer_info": SimpleNamespace(num_effective_layers=LAYERS, start_layer=0, end_layer=LAYERS),
        "device": "cpu",
        "post_capture_kv_active": False,
        "kv_shard_rank": None,
        **configurator_fields,
    }
    configurator = SimpleNamespace(**fields)
    return KVCacheConfigurator._build_mha_kv_pool(
        configurator, max_total_num_tokens=SLOTS, mha_pool_class=MHATokenToKVPool
    )


def test_pool_hook_only_with_kvstrata_cache(published, monkeypatch):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.plugins import load_plugins

    from kvstrata.integrations.sglang.pool import StratifiedTokenToKVPool
    from kvstrata.radix.pool import cold_page_bytes

    monkeypatch.setenv("KVSTRATA_KV_CODEC", "int8")
    load_plugins()
    pool = build_mha_pool()
    assert isinstance(pool, StratifiedTokenToKVPool)
    assert (pool.size, pool.page_size, pool.layer_num, pool.head_num) == (SLOTS, PAGE, LAYERS, KV_HEADS)
    assert pool.options.codec == "int8"
    assert pool.cold.page_bytes == cold_page_bytes(["int8"] * LAYERS, PAGE, KV_HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match="KVSTRATA_KV_CODEC"):
        build_mha_pool(kv_cache_dtype_str="mxfp8")
    with published_topology(page_size=PAGE):
        assert type(build_mha_pool()) is MHATokenToKVPool


def test_create_tree_cache_builds_kvstrata_cache(published, monkeypatch):
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.registry import create_tree_cache
    from sglang.srt.plugins import load_plugins

    from kvstrata.integrations.sglang.compat import free_pages
    from kvstrata.integrations.sglang.radix_cache import KvstrataRadixCache
    from kvstrata.radix.pool import cold_page_bytes

    monkeypatch.setenv("KVSTRATA_KV_CODEC", "int4")
    load_plugins()
    req_pool, kv, allocator = make_pools(type(build_mha_pool()))
    params = CacheInitParams(
        disable=False, req_to_token_pool=req_pool, token_to_kv_pool_allocator=allocator, page_size=PAGE
    )
    ctx = tree_cache_context(
        server_args=published,
        params=params,
        is_hybrid_swa=False,
        is_hybrid_ssm=False,
        enable_hierarchical_cache=False,
        disable_radix_cache=False,
        tp_worker=None,
        model_config=None,
        tp_size=1,
        tp_rank=0,
        tp_group=None,
    )
    cache = create_tree_cache(ctx)
    assert isinstance(cache, KvstrataRadixCache)
    assert kv.options.codec == "int4"
    # int4 codes alone: 2 layers x (K + V) x 4 tokens x 2 heads x 16 dims, two per byte; scales on top.
    codes = 2 * 2 * PAGE * 2 * 16 // 2
    assert cache.page_bytes == kv.cold.page_bytes == cold_page_bytes(["int4"] * 2, PAGE, 2, 16) > codes
    assert cache.pin_budget_bytes == 64 * cache.page_bytes // 4
    assert kv.get_kv_size_bytes()[0] + kv.get_kv_size_bytes()[1] == 65 * cache.page_bytes
    assert torch.equal(free_pages(allocator), torch.arange(1, 65))
    cache.check_invariants()


def test_codec_auto_keeps_sglangs_pool(published, monkeypatch):
    """``KVSTRATA_KV_CODEC=auto``: SGLang builds its own pool (any of its ``--kv-cache-dtype`` values,
    the hook leaves them alone) and the kvstrata radix cache runs over it with its pins."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.registry import create_tree_cache
    from sglang.srt.plugins import load_plugins

    from kvstrata.integrations.sglang.radix_cache import KvstrataRadixCache

    monkeypatch.setenv("KVSTRATA_KV_CODEC", "auto")
    load_plugins()
    assert type(build_mha_pool()) is MHATokenToKVPool
    fp8 = build_mha_pool(kv_cache_dtype_str="fp8_e4m3", kv_cache_dtype=torch.float8_e4m3fn)
    assert type(fp8) is MHATokenToKVPool
    req_pool, kv, allocator = make_pools(type(build_mha_pool()))
    params = CacheInitParams(
        disable=False, req_to_token_pool=req_pool, token_to_kv_pool_allocator=allocator, page_size=PAGE
    )
    fields = dict(is_hybrid_swa=False, is_hybrid_ssm=False, enable_hierarchical_cache=False)
    ctx = tree_cache_context(
        server_args=published,
        params=params,
        **fields,
        disable_radix_cache=False,
        tp_worker=None,
        model_config=None,
        tp_size=1,
        tp_rank=0,
        tp_group=None,
    )
    cache = create_tree_cache(ctx)
    assert isinstance(cache, KvstrataRadixCache) and cache.options.codec == "auto"
    assert cache.page_bytes == LAYERS * 2 * PAGE * KV_HEADS * HEAD_DIM * 2  # SGLang's BF16 page
    cache.check_invariants()


def test_codec_auto_leaves_sglangs_quantized_pools_alone(published, monkeypatch):
    """SGLang's own quantized pools (a ``quant_method``, mxfp8) are refused beside a kvstrata codec
    and built as without the plugin with ``auto``; a wrong codec's error names ``auto``."""
    import kvstrata.integrations.sglang as plugin
    from kvstrata.integrations.sglang.options import PluginOptions

    def original(configurator, *args, **kwargs):
        return kwargs

    configurator = SimpleNamespace(kv_cache_dtype_str="mxfp8")
    monkeypatch.setenv("KVSTRATA_KV_CODEC", "int8")
    with pytest.raises(ValueError, match="KVSTRATA_KV_CODEC=auto"):
        plugin.mha_pool_class_hook(original, configurator, quant_method=None)
    monkeypatch.setenv("KVSTRATA_KV_CODEC", "auto")
    quant = object()
    assert plugin.mha_pool_class_hook(original, configurator, quant_method=quant) == {"quant_method": quant}
    with pytest.raises(ValueError, match=r"unknown codec 'fp9'.*or auto"):
        PluginOptions(codec="fp9")


def test_page_bytes_of_an_mla_pool():
    """MLA pools report one size (MHA pools a (K, V) pair): the cache's page bytes from either."""
    from kvstrata.integrations.sglang.radix_cache import page_bytes_of

    mla = SimpleNamespace(get_kv_size_bytes=lambda: 65 * 4 * 576 * 2, size=64 * 4, page_size=4)
    mha = SimpleNamespace(get_kv_size_bytes=lambda: (65 * 4 * 256, 65 * 4 * 256), size=64 * 4, page_size=4)
    assert (page_bytes_of(mla, 4), page_bytes_of(mha, 4)) == (4 * 576 * 2, 4 * 512)


def test_installed_sglang_is_a_supported_release():
    from importlib.metadata import requires, version

    from packaging.requirements import Requirement

    import kvstrata.integrations.sglang as plugin

    (extra,) = [r for r in map(Requirement, requires("kvstrata")) if r.name == "sglang"]
    assert version("sglang") in plugin.SUPPORTED_SGLANG
    assert [v for v in plugin.SUPPORTED_SGLANG if v in extra.specifier] == ["0.5.17", "0.5.23"]
    assert not [n for n in range(10, 30) if f"0.5.{n}" in extra.specifier and n not in (17, 23)]
