from __future__ import annotations

import pytest
import torch

from kvstrata.quant import get_codec, relative_rmse
from kvstrata.quant.rotation import hadamard_matrix, hadamard_rotate


@pytest.mark.parametrize("n", [1, 2, 16, 64, 128])
def test_matrix_is_orthogonal_and_symmetric(n: int):
    h = hadamard_matrix(n, torch.float64)
    assert torch.allclose(h @ h.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
    assert torch.equal(h, h.T)
    assert torch.allclose(h.abs(), torch.full((n, n), n**-0.5, dtype=torch.float64))


def test_self_inverse_and_dot_products_kept():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(10, 4, 128, generator=g), torch.randn(10, 4, 128, generator=g)
    assert torch.allclose(hadamard_rotate(hadamard_rotate(k)), k, atol=1e-5)
    scores = torch.einsum("thd,shd->hts", q, k)
    rotated = torch.einsum("thd,shd->hts", hadamard_rotate(q), hadamard_rotate(k))
    assert torch.allclose(rotated, scores, atol=1e-4)


def test_dtype_and_device_preserved():
    x = torch.randn(3, 2, 64).bfloat16()
    y = hadamard_rotate(x)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert torch.allclose(hadamard_rotate(y).float(), x.float(), atol=0.05)


def test_errors():
    with pytest.raises(ValueError, match="power of two, got 96"):
        hadamard_rotate(torch.randn(2, 96))
    with pytest.raises(TypeError, match="floating-point"):
        hadamard_rotate(torch.ones(2, 64, dtype=torch.int64))


def test_rotation_tames_an_outlier_channel_for_int4_per_token():
    """Keys with one +40 outlier channel: per-token int4 wastes its 16 levels on the outlier; the
    rotation spreads it over all 128 channels (40 / sqrt(128) = 3.5 each), so errors drop ~3.5x."""
    g = torch.Generator().manual_seed(2)
    k = torch.randn(64, 2, 128, generator=g)
    k[..., 5] += 40.0
    codec = get_codec("int4")
    plain = codec.dequantize(codec.quantize(k))
    rotated = hadamard_rotate(codec.dequantize(codec.quantize(hadamard_rotate(k))))
    bulk = torch.ones(128, dtype=torch.bool)
    bulk[5] = False
    assert 0.20 < relative_rmse(k, plain) < 0.23  # measured 0.216
    assert relative_rmse(k, rotated) < 0.065  # measured 0.061
    assert 0.75 < relative_rmse(k[..., bulk], plain[..., bulk]) < 0.85  # measured 0.80
    assert relative_rmse(k[..., bulk], rotated[..., bulk]) < 0.24  # measured 0.225
