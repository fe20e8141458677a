"""Two 4-bit codes per byte along head_dim: element ``2i`` in the low nibble, ``2i + 1`` in the high one."""

from __future__ import annotations

import torch


def check_even(head_dim: int, codec: str) -> None:
    if head_dim % 2:
        raise ValueError(f"{codec} packs two values per byte along head_dim; head_dim={head_dim} is odd")


def pack(codes: torch.Tensor) -> torch.Tensor:
    """Pack integer codes in ``[0, 15]`` of shape ``[..., D]`` into uint8 ``[..., D // 2]``."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack`: uint8 ``[..., D // 2]`` to int64 codes ``[..., D]`` (ready for indexing)."""
    p = packed.to(torch.int64)
    return torch.stack((p & 0xF, p >> 4), dim=-1).flatten(-2)
