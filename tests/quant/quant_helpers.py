"""Synthetic K/V shapes shared by the quant tests (small: the CI machine is shared)."""

from __future__ import annotations

import torch

from kvstrata.quant import synthetic

TOKENS, HEADS, HEAD_DIM, PAGE = 256, 4, 128, 16


def gaussian_kv(
    seed: int = 0, tokens: int = TOKENS, heads: int = HEADS, head_dim: int = HEAD_DIM
) -> torch.Tensor:
    """N(0, 1) data whose per-token magnitude is log-uniform over a 16x range."""
    return synthetic.gaussian_kv(seed, tokens, heads, head_dim)


def heavy_tailed_kv(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Student-t (df=3) data with two +-50 outliers per token and head, and the outlier mask."""
    return synthetic.heavy_tailed_kv(seed, TOKENS, HEADS, HEAD_DIM)


def as_pages(x: torch.Tensor, page: int = PAGE) -> torch.Tensor:
    """``[T, H, D]`` -> ``[T / page, page, H, D]``: the batch shape the cache quantizes keys in."""
    return x.unflatten(0, (-1, page))
