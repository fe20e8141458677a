"""`benchmarks/matmul_gpu.py`'s split-K by hand: the strided chunk views give ``F.linear``'s product, for
every split the input features allow, and a split that does not divide them is refused."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[2]


def _module():
    sys.path.insert(0, str(ROOT / "benchmarks"))  # matmul_gpu imports decode_step_gpu
    try:
        spec = importlib.util.spec_from_file_location("matmul_gpu", ROOT / "benchmarks" / "matmul_gpu.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return mod


matmul = _module()


@pytest.mark.parametrize("splits", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_k_equals_linear(splits: int, dtype: torch.dtype) -> None:
    torch.manual_seed(splits)
    x = torch.randn(5, 96, dtype=dtype)
    w = torch.randn(40, 96, dtype=dtype)
    ref = F.linear(x.double(), w.double())
    got = matmul.split_k_linear(x, w, splits)
    assert got.dtype == dtype and got.shape == (5, 40)
    bound = 1e-4 if dtype == torch.float32 else 2**-7 * ref.abs().max().item()
    assert (got.double() - ref).abs().max().item() <= bound


def test_split_k_sums_every_chunk() -> None:
    x = torch.zeros(2, 12)
    w = torch.zeros(3, 12)
    x[:, 8:] = 1.0  # only the last of three chunks contributes
    w[:, 8:] = 2.0
    assert torch.equal(matmul.split_k_linear(x, w, 3), torch.full((2, 3), 8.0))


def test_split_k_refuses_an_uneven_split() -> None:
    with pytest.raises(ValueError, match="do not split"):
        matmul.split_k_linear(torch.zeros(2, 10), torch.zeros(3, 10), 4)
