"""Fixtures over the real sglang package on CPU: its ``ReqToTokenPool``, paged allocator and KV pools.

sglang imports torchvision at module level for vision models; the CPU test environment has no
torchvision wheel for its torch, so, as sglang's own ``maybe_stub_sgl_kernel()`` does for
sgl_kernel, a stub module answers those imports. Nothing here calls into it.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from unittest.mock import MagicMock

import pytest
import torch


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__version__ = "0.0.0+stub"
        module.__getattr__ = lambda name: MagicMock()


class _TorchvisionStub(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)
        return None


if importlib.util.find_spec("torchvision") is None:
    sys.meta_path.insert(0, _TorchvisionStub())

PAGE = 4
LAYERS = 2
KV_HEADS = 2
HEAD_DIM = 16
SLOTS = 64 * PAGE  # SGLang pool size in tokens: 64 allocatable pages


@contextlib.contextmanager
def published_topology(**server_args_fields):
    """Publish ``ServerArgs(model_path="dummy", ...)`` as SGLang's runtime context, as
    ``sglang.test.test_utils.published_topology`` does (that module needs the datasets package)."""
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(model_path="dummy", **server_args_fields)
    reset_context()
    publish(server_args, role="test", ranks=SpawnRanks(world_rank=0, dp_rank=None))
    try:
        yield server_args
    finally:
        reset_context()


@pytest.fixture
def published():
    """A published SGLang runtime context selecting the kvstrata radix cache."""
    with published_topology(radix_cache_backend="kvstrata", page_size=PAGE) as server_args:
        yield server_args


def make_pools(pool_cls, size: int = SLOTS, rows: int = 8):
    """(ReqToTokenPool, KV pool of ``pool_cls``, paged allocator) as SGLang builds them on CPU."""
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    req_pool = ReqToTokenPool(size=rows, max_context_len=256, device="cpu", enable_memory_saver=False)
    kv = pool_cls(
        size=size,
        page_size=PAGE,
        dtype=torch.bfloat16,
        head_num=KV_HEADS,
        head_dim=HEAD_DIM,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
    )
    allocator = PagedTokenToKVPoolAllocator(size, PAGE, torch.bfloat16, "cpu", kv, need_sort=False)
    return req_pool, kv, allocator
