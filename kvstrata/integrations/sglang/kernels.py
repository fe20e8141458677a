"""`StrataKernels`: the two operations the SGLang backend needs from the strata, by name.

``torch`` is kvstrata's reference (`kvstrata.radix.attention`), which runs on any device;
``triton`` is kvstrata's Triton kernels (`kvstrata.radix.kernels`: cold codes decoded in registers,
completed pages quantized in one launch), on CUDA or on CPU under ``TRITON_INTERPRET=1`` (tests).
``KVSTRATA_ATTENTION_KERNELS`` picks one by name; ``auto`` (the default) is ``triton`` on CUDA and
``torch`` elsewhere, as kvstrata's own engine chooses. `register_kernels` adds others.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Protocol

import torch

from kvstrata.engine.attention import require_triton_device, resolve_backend
from kvstrata.radix import attention
from kvstrata.radix.plan import StepBatch
from kvstrata.radix.pool import ColdPool, WriteCounts
from kvstrata.radix.ring import HotRing

ENV_KERNELS = "KVSTRATA_ATTENTION_KERNELS"
DEFAULT_KERNELS = "auto"


class StrataKernels(Protocol):
    def attend(
        self,
        layer: int,
        batch: StepBatch,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        pool: ColdPool,
        ring: HotRing,
    ) -> torch.Tensor:
        """Causal attention of the step's new tokens (``[T, Hq, D]``) over their strata and themselves."""

    def store(
        self, layer: int, batch: StepBatch, k: torch.Tensor, v: torch.Tensor, pool: ColdPool, ring: HotRing
    ) -> WriteCounts:
        """Quantize the pages the step completes (once) and write the new tokens to the ring."""


class TorchStrataKernels:
    """The reference path: kvstrata's own torch attention and store."""

    def __init__(self, block_pages: int = 64) -> None:
        self.block_pages = block_pages

    def attend(self, layer, batch, q, k, v, scale, pool, ring):
        return attention.attend(layer, batch, q, k, v, scale, pool, ring, None, self.block_pages)

    def store(self, layer, batch, k, v, pool, ring):
        return attention.store(layer, batch, k, v, pool, ring, None, (None, None))


class TritonStrataKernels:
    """kvstrata's Triton kernels; the pages a step completes are quantized from the ring and the new
    rows before the new rows are written to the ring, or by the same launch in a decode step
    (`page_quantize.ring_rows_fused`), as `StratifiedKVCache.attention` does."""

    def attend(self, layer, batch, q, k, v, scale, pool, ring):
        from kvstrata.radix.kernels import attend as kernel_attend

        return kernel_attend.attend(layer, batch, q, k, v, scale, pool, ring, None)

    def store(self, layer, batch, k, v, pool, ring):
        from kvstrata.radix.kernels import page_quantize

        # The pool uses only the overflow counts, zero with the Triton encoder: the encoder's other
        # counts stay on the device, so no layer waits for a host read.
        page_quantize.store_async(layer, batch, k, v, pool, ring, None)
        return WriteCounts()


_KERNELS: dict[str, Callable[[], StrataKernels]] = {
    "torch": TorchStrataKernels,
    "triton": TritonStrataKernels,
}


def register_kernels(name: str, factory: Callable[[], StrataKernels]) -> None:
    _KERNELS[name] = factory


def make_kernels(name: str | None = None, device: torch.device | str = "cpu") -> StrataKernels:
    """The kernels called ``name`` (default: ``KVSTRATA_ATTENTION_KERNELS``, else ``auto``) for a
    pool on ``device``."""
    device = torch.device(device)
    name = resolve_backend(name or os.environ.get(ENV_KERNELS, DEFAULT_KERNELS), device)
    if name not in _KERNELS:
        raise ValueError(f"{ENV_KERNELS}={name!r} is not registered; registered: {sorted(_KERNELS)}")
    if name == "triton":
        require_triton_device(device)
        if device.type != "cuda" or torch.cuda.is_available():  # choosing alone needs no device
            from kvstrata.radix.kernels.attend import split_counts

            split_counts(device)  # before SGLang captures its CUDA graphs (the decode kernels' merge)
    return _KERNELS[name]()
