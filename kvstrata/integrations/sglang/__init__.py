"""kvstrata inside SGLang: the plugin registered under the ``sglang.srt.plugins`` entry-point group.

`register()` (called by SGLang's ``load_plugins()`` in every process, idempotent) registers the
radix-cache backend ``kvstrata``, the attention backend ``kvstrata`` and a hook that installs the
stratified KV pool when the ``kvstrata`` radix cache is selected. This package is the only code of
kvstrata that imports sglang; see docs/sglang.md.
"""

from __future__ import annotations

SUPPORTED_SGLANG = ("0.5.23",)
BACKEND = "kvstrata"
POOL_HOOK_TARGET = "sglang.srt.platforms.interface.SRTPlatform.get_kv_pool_cls"

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


def kv_pool_cls_hook(original, platform, *args, **kwargs):
    """AROUND hook on ``SRTPlatform.get_kv_pool_cls``: kvstrata's MHA pool when the kvstrata radix
    cache is selected, the platform's answer otherwise."""
    from sglang.srt.runtime_context import get_memory

    kind = kwargs.get("kind", args[0] if args else None)
    if kind == "mha" and get_memory().radix_cache_backend == BACKEND:
        from kvstrata.integrations.sglang.options import PluginOptions
        from kvstrata.integrations.sglang.pool import pool_class

        return pool_class(PluginOptions.from_env())
    return original(platform, *args, **kwargs)


def register() -> None:
    """Register kvstrata's backends with SGLang; safe to call any number of times."""
    global _hook_registered
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    from kvstrata.integrations.sglang.attention_backend import create_kvstrata_backend

    if get_radix_cache_factory(BACKEND) is None:
        register_radix_cache_backend(BACKEND, create_kvstrata_cache)
    if BACKEND not in ATTENTION_BACKENDS:
        register_attention_backend(BACKEND)(create_kvstrata_backend)
    if BACKEND not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND])
    if not _hook_registered:
        HookRegistry.register(POOL_HOOK_TARGET, kv_pool_cls_hook, HookType.AROUND)
        _hook_registered = True
