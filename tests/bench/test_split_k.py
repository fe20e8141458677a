"""`benchmarks/matmul_gpu.py`'s split-K by hand: the strided chunk views give ``F.linear``'s product, for
every split the input features allow, and a split that does not divide them is refused."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F


@pytest.fixture
def matmul(monkeypatch):
    """The benchmark module, imported with ``benchmarks/`` on the path (as test_attention_sweep does)."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "benchmarks"))
    return importlib.import_module("matmul_gpu")


@pytest.mark.parametrize("splits", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_k_equals_linear(matmul, splits: int, dtype: torch.dtype) -> None:
    torch.manual_seed(splits)
    x = torch.randn(5, 96, dtype=dtype)
    w = torch.randn(40, 96, dtype=dtype)
    ref = F.linear(x.double(), w.double())
    got = matmul.split_k_linear(x, w, splits)
    assert got.dtype == dtype and got.shape == (5, 40)
    bound = 1e-4 if dtype == torch.float32 else 2**-7 * ref.abs().max().item()
    assert (got.double() - ref).abs().max().item() <= bound


def test_split_k_sums_every_chunk(matmul) -> None:
    x = torch.zeros(2, 12)
    w = torch.zeros(3, 12)
    x[:, 8:] = 1.0  # only the last of three chunks contributes
    w[:, 8:] = 2.0
    assert torch.equal(matmul.split_k_linear(x, w, 3), torch.full((2, 3), 8.0))


def test_split_k_refuses_an_uneven_split(matmul) -> None:
    with pytest.raises(ValueError, match="do not split"):
        matmul.split_k_linear(torch.zeros(2, 10), torch.zeros(3, 10), 4)
