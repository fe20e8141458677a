"""`fp4_e2m1`: NVFP4-style 4-bit floats with FP8 E4M3 block scales and a BF16 second-level scale.

E2M1 magnitudes are {0, 0.5, 1, 1.5, 2, 3, 4, 6}; code = sign << 3 | index, two codes per byte.

Token granularity (values): blocks of 32 consecutive head_dim elements (the OCP MX formats' block).
Per page: ``codes`` ``[P, H, D/2]`` uint8, ``block_scale`` ``[P, H, D/32]`` float8_e4m3fn,
``global_scale`` ``[P, H, 1]`` bfloat16. head_dim must be a multiple of 32.

Channel granularity (keys): blocks of 16 consecutive *tokens* per head and channel. Per page:
``codes`` ``[P, H, D/2]`` uint8, ``block_scale`` ``[P/16, H, D]`` float8_e4m3fn,
``global_scale`` ``[1, H, 1]`` bfloat16 (per page and head). The tokens axis must be a multiple of 16.

``global_scale = bf16(absmax / (6 * 448))`` maps the group's absmax onto the top of the E4M3 range,
then ``block_scale = e4m3(block_absmax / (6 * global_scale))`` and ``code = e2m1(x / (block_scale *
global_scale))``; decoding multiplies the three back. BF16 instead of NVFP4's float32 global costs
nothing that matters: the largest block's scale lands within 2**-8 of 448 and rounds to it (clamped,
so the group's largest element may be clipped by at most 2**-8, half a BF16 step). Rounding a block
scale to E4M3 may clip a block's largest element by up to 1/16 (not counted as overflow: only static
clipping is).
With static scales the clip sets the global scale; block scales stay dynamic, as in NVFP4.

Why 32-channel value blocks: at 16-token pages, 8 KV heads x head_dim 128, one E4M3 per 16 value
elements plus a float32 per token held fp4 at 0.5625 B/element; with 32-element blocks and BF16
globals a page costs 0.555 B/element (keys 0.5635, values 0.547), 3.60x the tokens of BF16 history
under `kvstrata capacity`'s 8B geometry.
"""

from __future__ import annotations

import functools

import torch

from kvstrata.quant.affine import div, safe_divisor
from kvstrata.quant.codec import PartSpec, ScaledCodec, check_granularity
from kvstrata.quant.nibbles import check_even, pack, unpack
from kvstrata.quant.prepare import Prepared
from kvstrata.quant.registry import register

TOKEN_BLOCK = 32  # channels per block scale of a token (values)
CHANNEL_BLOCK = 16  # tokens per block scale of a channel (keys)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbouring magnitudes; ties round toward zero.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


@functools.lru_cache(maxsize=16)
def _table(device: torch.device) -> torch.Tensor:
    """Decode table of the 16 codes (code 8, "-0", decodes to +0); cached: decoding runs per block."""
    return torch.tensor(_MAGNITUDES + (0.0,) + tuple(-m for m in _MAGNITUDES[1:]), device=device)


def e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 code (int64 in [0, 15]) of each element of ``y`` (already within ±6)."""
    mids = torch.tensor(_MIDPOINTS, dtype=y.dtype, device=y.device)
    index = torch.bucketize(y.abs(), mids)
    return index | ((y < 0).to(torch.int64) << 3)


class Fp4E2M1Codec(ScaledCodec):
    name = "fp4_e2m1"

    def _check_geometry(self, tokens: int, head_dim: int, granularity: str) -> None:
        check_even(head_dim, self.name)
        if granularity == "token" and head_dim % TOKEN_BLOCK:
            raise ValueError(
                f"{self.name} with token granularity uses blocks of {TOKEN_BLOCK} along head_dim; "
                f"head_dim={head_dim} is not a multiple of {TOKEN_BLOCK}"
            )
        if granularity == "channel" and tokens % CHANNEL_BLOCK:
            raise ValueError(
                f"{self.name} with channel granularity uses blocks of {CHANNEL_BLOCK} tokens; the "
                f"tokens axis ({tokens}) must be a multiple of {CHANNEL_BLOCK} "
                f"(use page_size % {CHANNEL_BLOCK} == 0)"
            )

    def _encode(self, p: Prepared, granularity: str) -> dict[str, torch.Tensor]:
        x = p.x
        if granularity == "token":
            global_scale = div(p.absmax, E2M1_MAX * E4M3_MAX).to(torch.bfloat16)  # [..., T, H, 1]
            g = global_scale.to(torch.float32)
            blocks = x.unflatten(-1, (-1, TOKEN_BLOCK))  # [..., T, H, D/32, 32]
            block_amax = blocks.abs().amax(-1)  # [..., T, H, D/32]
            block_scale = self._block_scale(block_amax, g)
            divisor = safe_divisor(block_scale.to(torch.float32) * g).unsqueeze(-1)
            codes = e2m1_codes((blocks / divisor).clamp_(-E2M1_MAX, E2M1_MAX)).flatten(-2)
        else:
            amax = p.absmax.amax(-1, keepdim=True)  # [..., 1, H, 1]
            global_scale = div(amax, E2M1_MAX * E4M3_MAX).to(torch.bfloat16)
            g = global_scale.to(torch.float32)
            blocks = x.unflatten(-3, (-1, CHANNEL_BLOCK))  # [..., T/16, 16, H, D]
            block_amax = blocks.abs().amax(-3)  # [..., T/16, H, D]
            block_scale = self._block_scale(block_amax, g)
            divisor = safe_divisor(block_scale.to(torch.float32) * g).unsqueeze(-3)
            codes = e2m1_codes((blocks / divisor).clamp_(-E2M1_MAX, E2M1_MAX)).flatten(-4, -3)
        return {"codes": pack(codes), "block_scale": block_scale, "global_scale": global_scale}

    @staticmethod
    def _block_scale(block_amax: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
        ratio = block_amax / (safe_divisor(global_scale) * E2M1_MAX)
        return ratio.clamp_(0.0, E4M3_MAX).to(torch.float8_e4m3fn)

    def dequantize_parts(
        self,
        parts: dict[str, torch.Tensor],
        granularity: str,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        codes = parts["codes"]
        values = _table(codes.device)[unpack(codes)]  # [..., T, H, D]
        scale = parts["block_scale"].to(torch.float32) * parts["global_scale"].to(torch.float32)
        if granularity == "token":
            y = values.unflatten(-1, (-1, TOKEN_BLOCK)) * scale.unsqueeze(-1)
            return y.flatten(-2).to(dtype)
        y = values.unflatten(-3, (-1, CHANNEL_BLOCK)) * scale.unsqueeze(-3)
        return y.flatten(-4, -3).to(dtype)

    def page_parts(self, page_size: int, heads: int, head_dim: int, granularity: str) -> PartSpec:
        check_granularity(granularity)
        self._check_geometry(page_size, head_dim, granularity)
        if granularity == "token":
            block_shape, global_shape = (page_size, heads, head_dim // TOKEN_BLOCK), (page_size, heads, 1)
        else:
            block_shape, global_shape = (page_size // CHANNEL_BLOCK, heads, head_dim), (1, heads, 1)
        return {
            "codes": ((page_size, heads, head_dim // 2), torch.uint8),
            "block_scale": (block_shape, torch.float8_e4m3fn),
            "global_scale": (global_shape, torch.bfloat16),
        }


register(Fp4E2M1Codec())
