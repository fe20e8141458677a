"""Split-K by hand (`kvstrata.engine.model.split_k_linear`): the strided chunk views give ``F.linear``'s
product for every split the input features allow, a split that does not divide them is refused, and on
CUDA a `Linear` with ``split_k`` set gives its unsplit product within BF16 rounding."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from kvstrata.engine.model import Linear, split_k_linear


@pytest.mark.parametrize("splits", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_k_equals_linear(splits: int, dtype: torch.dtype) -> None:
    torch.manual_seed(splits)
    x = torch.randn(5, 96, dtype=dtype)
    w = torch.randn(40, 96, dtype=dtype)
    ref = F.linear(x.double(), w.double())
    got = split_k_linear(x, w, splits)
    assert got.dtype == dtype and got.shape == (5, 40)
    bound = 1e-4 if dtype == torch.float32 else 2**-7 * ref.abs().max().item()
    assert (got.double() - ref).abs().max().item() <= bound


def test_split_k_sums_every_chunk() -> None:
    x = torch.zeros(2, 12)
    w = torch.zeros(3, 12)
    x[:, 8:] = 1.0  # only the last of three chunks contributes
    w[:, 8:] = 2.0
    assert torch.equal(split_k_linear(x, w, 3), torch.full((2, 3), 8.0))


def test_split_k_refuses_an_uneven_split() -> None:
    with pytest.raises(ValueError, match="do not split"):
        split_k_linear(torch.zeros(2, 10), torch.zeros(3, 10), 4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="split-K runs on CUDA only")
@pytest.mark.parametrize("bias", [False, True])
def test_linear_split_k_on_cuda(bias: bool) -> None:
    torch.manual_seed(0)
    lin = Linear(1024, 256, bias=bias).to("cuda", torch.bfloat16)
    x = torch.randn(48, 1024, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double())
    unsplit = lin(x)
    lin.split_k = 4
    split = lin(x)
    bound = 2**-7 * ref.abs().max().item()
    assert split.dtype == torch.bfloat16 and split.shape == (48, 256)
    assert (split.double() - ref).abs().max().item() <= bound
    assert (split.double() - unsplit.double()).abs().max().item() <= 2 * bound
