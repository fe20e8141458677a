"""`StrataKernels`: the two operations the SGLang backend needs from the strata, by name.

``torch`` is kvstrata's reference (`kvstrata.radix.attention`), which runs on any device. A GPU
implementation (the Triton kernels of `kvstrata.radix.kernels`) plugs in with
`register_kernels("triton", factory)`; ``KVSTRATA_ATTENTION_KERNELS`` picks one by name.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Protocol

import torch

from kvstrata.radix import attention
from kvstrata.radix.plan import StepBatch
from kvstrata.radix.pool import ColdPool, WriteCounts
from kvstrata.radix.ring import HotRing

ENV_KERNELS = "KVSTRATA_ATTENTION_KERNELS"
DEFAULT_KERNELS = "torch"


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


_KERNELS: dict[str, Callable[[], StrataKernels]] = {DEFAULT_KERNELS: TorchStrataKernels}


def register_kernels(name: str, factory: Callable[[], StrataKernels]) -> None:
    _KERNELS[name] = factory


def make_kernels(name: str | None = None) -> StrataKernels:
    name = name or os.environ.get(ENV_KERNELS, DEFAULT_KERNELS)
    if name not in _KERNELS:
        raise ValueError(f"{ENV_KERNELS}={name!r} is not registered; registered: {sorted(_KERNELS)}")
    return _KERNELS[name]()
