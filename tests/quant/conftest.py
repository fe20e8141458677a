"""Synthetic K/V generators shared by the quant tests (small shapes: the CI machine is shared)."""

from __future__ import annotations

import math

import pytest
import torch

TOKENS, HEADS, HEAD_DIM, PAGE = 256, 4, 128, 16
OUTLIERS_PER_TOKEN_HEAD = 2
OUTLIER_VALUE = 50.0


def gaussian_kv(
    seed: int = 0, tokens: int = TOKENS, heads: int = HEADS, head_dim: int = HEAD_DIM
) -> torch.Tensor:
    """N(0, 1) data whose per-token magnitude is log-uniform over a 16x range."""
    g = torch.Generator().manual_seed(seed)
    magnitude = torch.exp(torch.rand(tokens, 1, 1, generator=g) * math.log(16.0))
    return torch.randn(tokens, heads, head_dim, generator=g) * magnitude


def heavy_tailed_kv(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Student-t (df=3) data with a few +-50 outliers per token and head; returns (data, outlier mask)."""
    g = torch.Generator().manual_seed(seed)
    normal = torch.randn(TOKENS, HEADS, HEAD_DIM, generator=g)
    chi2 = (torch.randn(TOKENS, HEADS, HEAD_DIM, 3, generator=g) ** 2).sum(-1)
    x = normal / torch.sqrt(chi2 / 3.0)
    idx = torch.rand(TOKENS, HEADS, HEAD_DIM, generator=g).argsort(-1)[..., :OUTLIERS_PER_TOKEN_HEAD]
    sign = torch.where(torch.rand(idx.shape, generator=g) < 0.5, -1.0, 1.0)
    x.scatter_(-1, idx, OUTLIER_VALUE * sign)
    mask = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, idx, True)
    return x, mask


def as_pages(x: torch.Tensor, page: int = PAGE) -> torch.Tensor:
    """``[T, H, D]`` -> ``[T / page, page, H, D]``: the batch shape the cache quantizes keys in."""
    return x.unflatten(0, (-1, page))


@pytest.fixture(scope="session")
def gaussian() -> torch.Tensor:
    return gaussian_kv()


@pytest.fixture(scope="session")
def heavy() -> tuple[torch.Tensor, torch.Tensor]:
    return heavy_tailed_kv()
