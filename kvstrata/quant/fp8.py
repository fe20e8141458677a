"""FP8 codecs `fp8_e4m3` (max 448) and `fp8_e5m2` (max 57344) with a power-of-two scale per group.

Layout per page: ``codes`` ``[P, H, D]`` in the torch float8 dtype and ``scale_exp``, the scale's
biased exponent as uint8 (E8M0, as the OCP MX formats store it): ``[P, H, 1]`` per token and head
(token granularity) or ``[1, H, 1]`` per head over the whole page (channel granularity: keys).

The scale is ``2 ** (scale_exp - 127)``, the smallest power of two with ``absmax / scale <= fp8_max``.
A power-of-two scale costs a float format no precision (it only shifts the exponent; at most one
binade of subnormal range moves). That is also why keys need no per-channel scale here: a float
code's error is relative to the element, not to its group's absmax, so a channel far below the page's
absmax keeps its precision as long as it stays within E4M3's 2**17 normal-plus-subnormal range, and
what falls below only loses an absolute error under ``absmax * 2**-19``, nothing to a dot product.
One byte per page and head instead of one per channel: keys cost 1.0000 B/element, not 1.0625.
Encoding clamps to ``±fp8_max`` before the cast (round to nearest even), so no code is ever NaN/Inf
whatever the backend's cast does out of range.
"""

from __future__ import annotations

import torch

from kvstrata.quant.affine import div
from kvstrata.quant.codec import PartSpec, ScaledCodec, scale_shape
from kvstrata.quant.prepare import Prepared
from kvstrata.quant.registry import register

EXP_BIAS = 127


def pow2_scale_exponent(absmax: torch.Tensor, fmax: float) -> torch.Tensor:
    """``ceil(log2(absmax / fmax))`` as int32 in ``[-127, 127]`` (0 for an all-zero group)."""
    mantissa, exponent = torch.frexp(
        div(absmax, fmax)
    )  # ratio = mantissa * 2**exponent, mantissa in [0.5, 1)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)  # exact powers of two
    return exponent.clamp(-EXP_BIAS, EXP_BIAS)


class Fp8Codec(ScaledCodec):
    def __init__(self, name: str, storage_dtype: torch.dtype) -> None:
        self.name = name
        self.storage_dtype = storage_dtype
        self.fmax = float(torch.finfo(storage_dtype).max)

    def _encode(self, p: Prepared, granularity: str) -> dict[str, torch.Tensor]:
        absmax = p.absmax if granularity == "token" else p.absmax.amax(-1, keepdim=True)
        exponent = pow2_scale_exponent(absmax, self.fmax)
        # Exact: a power-of-two scaling (as ldexp, which torch runs as a slower pow + mul).
        y = (p.x * torch.exp2(-exponent.to(p.x.dtype))).clamp_(-self.fmax, self.fmax)
        return {"codes": y.to(self.storage_dtype), "scale_exp": (exponent + EXP_BIAS).to(torch.uint8)}

    def dequantize_parts(
        self,
        parts: dict[str, torch.Tensor],
        granularity: str,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        scale = torch.exp2(parts["scale_exp"].to(torch.float32) - EXP_BIAS)
        return (parts["codes"].to(torch.float32) * scale).to(dtype)

    def page_parts(self, page_size: int, heads: int, head_dim: int, granularity: str) -> PartSpec:
        return {
            "codes": ((page_size, heads, head_dim), self.storage_dtype),
            "scale_exp": (scale_shape(page_size, heads, 1, granularity), torch.uint8),
        }


register(Fp8Codec("fp8_e4m3", torch.float8_e4m3fn))
register(Fp8Codec("fp8_e5m2", torch.float8_e5m2))
