"""Discovery through SGLang's ``load_plugins()``, the CLI, and ``create_tree_cache`` with the real package."""

from __future__ import annotations

from importlib.metadata import entry_points

import torch

from tests.integrations.sglang.conftest import PAGE, make_pools, published_topology


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


def test_pool_hook_only_with_kvstrata_cache(published):
    from sglang.srt.platforms import current_platform
    from sglang.srt.plugins import load_plugins

    from kvstrata.integrations.sglang.pool import StratifiedTokenToKVPool

    load_plugins()
    cls = current_platform.get_kv_pool_cls(kind="mha")
    assert issubclass(cls, StratifiedTokenToKVPool)
    assert current_platform.get_kv_pool_cls(kind="mla") is None
    with published_topology(page_size=PAGE):
        assert current_platform.get_kv_pool_cls(kind="mha") is None


def test_create_tree_cache_builds_kvstrata_cache(published, monkeypatch):
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache
    from sglang.srt.platforms import current_platform
    from sglang.srt.plugins import load_plugins

    from kvstrata.integrations.sglang.radix_cache import KvstrataRadixCache
    from kvstrata.radix.pool import cold_page_bytes

    monkeypatch.setenv("KVSTRATA_KV_CODEC", "int4")
    load_plugins()
    req_pool, kv, allocator = make_pools(current_platform.get_kv_pool_cls(kind="mha"))
    params = CacheInitParams(
        disable=False, req_to_token_pool=req_pool, token_to_kv_pool_allocator=allocator, page_size=PAGE
    )
    ctx = TreeCacheBuildContext(
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
    assert torch.equal(allocator.get_all_free_pages(), torch.arange(1, 65))
    cache.check_invariants()
