"""Synthetic K/V with known statistics, for codec tests and the quantization-error benchmark."""

from __future__ import annotations

import math

import torch


def gaussian_kv(
    seed: int, tokens: int, heads: int, head_dim: int, magnitude_range: float = 16.0
) -> torch.Tensor:
    """N(0, 1) data ``[tokens, heads, head_dim]`` whose per-token magnitude is log-uniform over
    ``magnitude_range`` (16x by default), like real values whose norms vary from token to token."""
    g = torch.Generator().manual_seed(seed)
    magnitude = torch.exp(torch.rand(tokens, 1, 1, generator=g) * math.log(magnitude_range))
    return torch.randn(tokens, heads, head_dim, generator=g) * magnitude


def heavy_tailed_kv(
    seed: int,
    tokens: int,
    heads: int,
    head_dim: int,
    outliers: int = 2,
    outlier_value: float = 50.0,
    df: int = 3,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Student-t (``df`` degrees of freedom) data with ``outliers`` elements of ``+-outlier_value`` at
    random channels of every token and head. Returns the data and the boolean outlier mask."""
    g = torch.Generator().manual_seed(seed)
    normal = torch.randn(tokens, heads, head_dim, generator=g)
    chi2 = (torch.randn(tokens, heads, head_dim, df, generator=g) ** 2).sum(-1)
    x = normal / torch.sqrt(chi2 / df)
    idx = torch.rand(tokens, heads, head_dim, generator=g).argsort(-1)[..., :outliers]
    sign = torch.where(torch.rand(idx.shape, generator=g) < 0.5, -1.0, 1.0)
    x.scatter_(-1, idx, outlier_value * sign)
    mask = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, idx, True)
    return x, mask
