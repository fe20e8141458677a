"""What differs between the supported SGLang releases (0.5.17 and 0.5.23) in the calls the plugin
makes, decided by what the installed package has rather than by its version string. (The pool seam,
``KVCacheConfigurator._build_mha_kv_pool``, and the memory-plan seams are the same in both.)

- The cache API. 0.5.23: ``checkpoint(req, *, up_to)``; 0.5.17: ``cache_unfinished_req`` and
  ``cache_finished_req`` (see `KvstrataRadixCache`).
- ``RadixKey``: 0.5.23 namespaces keys by ``cache_salt`` as well as ``extra_key``; 0.5.17 has no salt.
- The paged allocator's free pages: ``get_all_free_pages()`` in 0.5.23 only.
"""

from __future__ import annotations

from importlib.metadata import version

import torch
from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache
from sglang.srt.mem_cache.radix_cache import RadixKey

SGLANG_VERSION = version("sglang")
HAS_CHECKPOINT = hasattr(BasePrefixCache, "checkpoint")
KEY_HAS_SALT = "cache_salt" in RadixKey.__slots__


def radix_key(token_ids, extra_key, cache_salt=None) -> RadixKey:
    """SGLang's key for ``token_ids`` in the namespace a request's prefixes are cached under."""
    if KEY_HAS_SALT:
        return RadixKey(token_ids, extra_key, cache_salt=cache_salt)
    return RadixKey(token_ids, extra_key)


def free_pages(allocator) -> torch.Tensor:
    """Every free page of SGLang's paged allocator (0.5.17 keeps them in two lists, unexposed)."""
    if hasattr(allocator, "get_all_free_pages"):
        return allocator.get_all_free_pages()
    return torch.cat((allocator.free_pages, allocator.release_pages))
