"""Integer grids shared by the `int8` and `int4` codecs: symmetric and asymmetric (min/max) affine maps.

Decoding is ``codes * scale`` (symmetric) or ``codes * scale + offset`` (asymmetric), with ``scale`` and
``offset`` in the scale shape so decoding is a broadcast multiply-add (`int8` stores them as float32;
`int4` derives them from 16-bit words and uses `min_max` and `affine_codes` only). A scale of 0 (an
all-zero or constant group) decodes every element to exactly ``offset``.
"""

from __future__ import annotations

import torch

from kvstrata.quant.prepare import Prepared, amax, amin, reduce_dim


def safe_divisor(scale: torch.Tensor) -> torch.Tensor:
    """``scale`` with zeros replaced by 1, for dividing data whose group is all zero (or constant)."""
    return torch.where(scale > 0, scale, torch.ones((), dtype=scale.dtype, device=scale.device))


def div(t: torch.Tensor, c: float) -> torch.Tensor:
    """``t / c`` correctly rounded on every device.

    CUDA turns a division by a Python scalar into a multiplication by its reciprocal (1 ulp off),
    so CPU- and GPU-quantized pages would differ; dividing by a same-device tensor keeps them equal.
    """
    return t / torch.full((), c, dtype=t.dtype, device=t.device)


def symmetric_encode(p: Prepared, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes in ``[-qmax, qmax]`` (float, rounded half to even) and the scale ``absmax / qmax``."""
    scale = div(p.absmax, qmax)
    codes = torch.round(p.x / safe_divisor(scale)).clamp_(-qmax, qmax)
    return codes, scale


def min_max(p: Prepared, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The range ``(lo, hi)`` of each scale group: from the data (dynamic scales) or
    ``[-absmax, absmax]`` (static ones)."""
    if p.static:
        return -p.absmax, p.absmax
    dim = reduce_dim(granularity)
    return amin(p.x, dim), amax(p.x, dim)


def affine_codes(x: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, levels: int) -> torch.Tensor:
    """Codes in ``[0, levels]`` (float, rounded half to even) of ``x ~ codes * scale + offset``."""
    return torch.round((x - offset) / safe_divisor(scale)).clamp_(0, levels)


def asymmetric_encode(
    p: Prepared, granularity: str, levels: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes in ``[0, levels]``, scale ``(hi - lo) / levels`` and offset ``lo`` (see `min_max`)."""
    lo, hi = min_max(p, granularity)
    scale = div(hi - lo, levels)
    return affine_codes(p.x, scale, lo, levels), scale, lo
