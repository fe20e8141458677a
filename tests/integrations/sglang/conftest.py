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
import os
import sys
from types import SimpleNamespace
from unittest.mock import MagicMock

import pytest
import torch

# The Triton kernels run under the interpreter without CUDA; the flag is read when
# `kvstrata.radix.kernels` is first imported (lazily, by the ``triton`` kernels of the plugin).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def require_interpreted_triton() -> None:
    """Skip a test whose CPU world runs the Triton kernels: they run there only interpreted, which
    this process does only without CUDA (above)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("this CPU world runs the Triton kernels interpreted: no-CUDA machines (conftest)")


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
    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(model_path="dummy", **server_args_fields)
    runtime_context.reset_context()
    ranks = getattr(runtime_context, "SpawnRanks", None)
    with contextlib.ExitStack() as stack:
        if ranks is not None:
            runtime_context.publish(server_args, role="test", ranks=ranks(world_rank=0, dp_rank=None))
        else:
            # 0.5.17's publish takes no ranks: its topology is read from torch.distributed groups,
            # which a single CPU process does not have, unless overridden.
            runtime_context.publish(server_args, role="test")
            one = dict.fromkeys(("tp_size", "pp_size", "attn_tp_size", "attn_dcp_size", "attn_dp_size"), 1)
            stack.enter_context(runtime_context.get_parallel().override(**one))
        try:
            yield server_args
        finally:
            runtime_context.reset_context()


@pytest.fixture
def published():
    """A published SGLang runtime context selecting the kvstrata radix cache."""
    with published_topology(radix_cache_backend="kvstrata", page_size=PAGE) as server_args:
        yield server_args


def make_pools(
    pool_cls,
    size: int = SLOTS,
    rows: int = 8,
    max_context: int = 256,
    layers: int = LAYERS,
    kv_heads: int = KV_HEADS,
    head_dim: int = HEAD_DIM,
    dtype: torch.dtype = torch.bfloat16,
):
    """(ReqToTokenPool, KV pool of ``pool_cls``, paged allocator) as SGLang builds them on CPU;
    ``dtype`` is SGLang's KV dtype (the model's, with ``--kv-cache-dtype auto``)."""
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    req_pool = ReqToTokenPool(size=rows, max_context_len=max_context, device="cpu", enable_memory_saver=False)
    kv = pool_cls(
        size=size,
        page_size=PAGE,
        dtype=dtype,
        head_num=kv_heads,
        head_dim=head_dim,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
    )
    allocator = PagedTokenToKVPoolAllocator(size, PAGE, dtype, "cpu", kv, need_sort=False)
    return req_pool, kv, allocator


# ---- what differs between SGLang 0.5.17 and 0.5.23 in the calls the tests make -----------------------


def alloc_row(req_pool) -> int:
    """A free ``ReqToTokenPool`` row, its generation bumped as for a new request."""
    if hasattr(req_pool, "alloc_rows"):
        return req_pool.alloc_rows(1)[0]
    (row,) = req_pool.alloc([SimpleNamespace(req_pool_idx=None)])  # 0.5.17: rows go to Req objects
    return row


def free_row(req_pool, row: int) -> None:
    if hasattr(req_pool, "free_rows"):
        req_pool.free_rows([row])
    else:
        req_pool.free(SimpleNamespace(req_pool_idx=row))


def matched_slots(cache, match) -> torch.Tensor:
    """The slots of a match's cached prefix (0.5.17 returns them; 0.5.23 returns the length)."""
    if hasattr(match, "device_indices"):
        return match.device_indices
    return cache.path_device_indices(match.last_device_node)


def tree_cache_context(**fields):
    """SGLang's ``TreeCacheBuildContext`` (0.5.17 also requires ``effective_chunked_prefill_size``)."""
    import dataclasses

    from sglang.srt.mem_cache.registry import TreeCacheBuildContext

    names = {f.name for f in dataclasses.fields(TreeCacheBuildContext)}
    if "effective_chunked_prefill_size" in names:
        fields.setdefault("effective_chunked_prefill_size", None)
    return TreeCacheBuildContext(**fields)
