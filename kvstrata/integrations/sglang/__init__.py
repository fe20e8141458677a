"""kvstrata inside SGLang: the plugin registered under the ``sglang.srt.plugins`` entry-point group.

`register()` (called by SGLang's ``load_plugins()`` in every process, idempotent) registers the
radix-cache backend ``kvstrata``, the attention backend ``kvstrata``, a hook that installs the
stratified KV pool when the ``kvstrata`` radix cache is selected with a kvstrata codec
(``KVSTRATA_KV_CODEC=auto`` keeps SGLang's pool), the hooks that size SGLang's memory plan for it
(`memory_plan`), and one that gives decode-graph replays the batch's request ids (`request_rows`).
This package is the only code of kvstrata that imports sglang; see docs/sglang.md.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

SUPPORTED_SGLANG = ("0.5.17", "0.5.23")
BACKEND = "kvstrata"
POOL_HOOK_TARGET = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_mha_kv_pool"

_hook_registered = False


def create_kvstrata_cache(ctx):
    """Radix-cache factory: ``ctx`` is SGLang's ``TreeCacheBuildContext``."""
    from kvstrata.integrations.sglang.metrics import cache_metrics
    from kvstrata.integrations.sglang.options import PluginOptions
    from kvstrata.integrations.sglang.radix_cache import KvstrataRadixCache

    unsupported = {
        "hybrid sliding-window models": ctx.is_hybrid_swa,
        "hybrid SSM (mamba) models": ctx.is_hybrid_ssm,
        "--enable-hierarchical-cache": ctx.enable_hierarchical_cache,
        "DSA models": ctx.is_dsa,
    }
    for what, on in unsupported.items():
        if on:
            raise ValueError(f"--radix-cache-backend kvstrata does not support {what} yet")
    metrics = cache_metrics() if ctx.params.enable_metrics else None
    cache = KvstrataRadixCache(ctx.params, PluginOptions.from_env(), metrics)
    if metrics is not None:
        metrics.observe(cache)
    return cache


def mha_pool_class_hook(original, configurator, *args, **kwargs):
    """AROUND hook on ``KVCacheConfigurator._build_mha_kv_pool`` (the seam both supported SGLang
    releases share; 0.5.17 asks the platform for the pool class only on out-of-tree platforms):
    kvstrata's pool class as ``mha_pool_class`` when the kvstrata radix cache is selected with a
    kvstrata codec. SGLang's own quantized pools (fp4, mxfp8) cannot be combined with it; with
    ``KVSTRATA_KV_CODEC=auto`` SGLang's pool is built as without the plugin."""
    if stratified_pool_selected():
        if kwargs.get("quant_method") is not None or configurator.kv_cache_dtype_str == "mxfp8":
            raise ValueError(
                "--radix-cache-backend kvstrata stores its own quantized pages: leave --kv-cache-dtype "
                "at auto/bfloat16 and choose the codec with KVSTRATA_KV_CODEC, or set KVSTRATA_KV_CODEC=auto "
                "to keep SGLang's own pool"
            )
        kwargs["mha_pool_class"] = kvstrata_pool_class()
    return original(configurator, *args, **kwargs)


def kvstrata_cache_selected() -> bool:
    from sglang.srt.runtime_context import get_memory

    return get_memory().radix_cache_backend == BACKEND


def stratified_pool_selected() -> bool:
    """The kvstrata radix cache is selected and ``KVSTRATA_KV_CODEC`` is not ``auto``: kvstrata's
    stratified pool (and its memory plan) replaces SGLang's."""
    from kvstrata.integrations.sglang.options import PluginOptions

    return kvstrata_cache_selected() and PluginOptions.from_env().stratified


def kvstrata_pool_class():
    from kvstrata.integrations.sglang.options import PluginOptions
    from kvstrata.integrations.sglang.pool import pool_class

    return pool_class(PluginOptions.from_env())


def register() -> None:
    """Register kvstrata's backends with SGLang; safe to call any number of times."""
    global _hook_registered
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    from kvstrata.integrations.sglang.attention_backend import create_kvstrata_backend
    from kvstrata.integrations.sglang.compat import SGLANG_VERSION

    if SGLANG_VERSION not in SUPPORTED_SGLANG and not _hook_registered:
        logger.warning("kvstrata: SGLang %s is not one of the tested %s", SGLANG_VERSION, SUPPORTED_SGLANG)
    if get_radix_cache_factory(BACKEND) is None:
        register_radix_cache_backend(BACKEND, create_kvstrata_cache)
    if BACKEND not in ATTENTION_BACKENDS:
        register_attention_backend(BACKEND)(create_kvstrata_backend)
    if BACKEND not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND])
    if not _hook_registered:
        from kvstrata.integrations.sglang import memory_plan, request_rows

        HookRegistry.register(POOL_HOOK_TARGET, mha_pool_class_hook, HookType.AROUND)
        HookRegistry.register(memory_plan.CELL_SIZE_TARGET, memory_plan.cell_size_hook, HookType.AROUND)
        HookRegistry.register(memory_plan.POOL_SIZES_TARGET, memory_plan.pool_sizes_hook, HookType.AROUND)
        HookRegistry.register(request_rows.REPLAY_VIEW_TARGET, request_rows.replay_view_hook, HookType.AFTER)
        _hook_registered = True
