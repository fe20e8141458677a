"""Attention backends: what the model calls for each layer, bound to one step's batch.

The model computes q/k/v (after RoPE) and calls ``attn(layer, q, k, v)``; a backend decides where
K/V live and how attention is computed. The reference backend delegates to the stratified cache,
which reads cold pages (dequantized inside its loop) and the BF16 ring, and stores the new K/V.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Protocol

import torch

AttnFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class AttentionBackend(Protocol):
    name: str

    def bind(self, batch: Any) -> AttnFn:
        """The per-layer callback for one forward step over ``batch`` (from ``cache.begin_step``)."""
        ...


class TorchCacheAttention:
    """PyTorch reference backend over cold pages + ring (CPU and GPU): ``cache.attention``."""

    name = "torch"
    kernels = False  # `StratifiedKVCache.attention`'s ``kernels``

    def __init__(self, cache: Any, scale: float) -> None:
        self.cache = cache
        self.scale = scale

    def bind(self, batch: Any) -> AttnFn:
        """The layer callback; it also takes ``out=``, a buffer the layer's output is written to (the
        decode graphs' static one: no copy of the output a layer)."""
        attention, scale, kernels = self.cache.attention, self.scale, self.kernels

        def attn(
            layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None
        ) -> torch.Tensor:
            return attention(layer, batch, q, k, v, scale, kernels=kernels, out=out)

        return attn


class TritonCacheAttention(TorchCacheAttention):
    """Triton kernels over cold pages + ring (`kvstrata.radix.kernels`): codes decoded in registers,
    no dequantized copy of the history. On CPU it needs ``TRITON_INTERPRET=1`` (slow; for tests)."""

    name = "triton"
    kernels = True

    def __init__(self, cache: Any, scale: float) -> None:
        super().__init__(cache, scale)
        from kvstrata.radix.kernels.attend import split_counts

        split_counts(cache.device)  # before any CUDA graph capture (the decode kernels' split merge)


BACKENDS: dict[str, type[TorchCacheAttention]] = {
    "torch": TorchCacheAttention,
    "triton": TritonCacheAttention,
}
BACKEND_CHOICES = ("auto", *BACKENDS)


def resolve_backend(name: str, device: torch.device) -> str:
    """``auto``: triton on CUDA, torch elsewhere; other names pass through (checked by `get_backend`)."""
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return name


def require_triton_device(device: torch.device) -> None:
    """The Triton kernels run on CUDA, or on CPU under the interpreter only."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "attention backend 'triton' on CPU needs TRITON_INTERPRET=1 (slow; for tests); use 'torch'"
        )


def get_backend(name: str, cache: Any, scale: float) -> AttentionBackend:
    name = resolve_backend(name, cache.device)
    if name == "triton":
        require_triton_device(cache.device)
    try:
        cls = BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(BACKENDS)}") from None
    return cls(cache, scale)
