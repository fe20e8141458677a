"""Normalised Walsh–Hadamard rotation over the last dim (head_dim).

``H = hadamard(n) / sqrt(n)`` is symmetric and orthogonal, so it is its own inverse and
``(x H) · (y H) = x · y``: rotating both queries and keys keeps attention scores while spreading an
outlier channel over all channels, which makes per-token scales much tighter.
"""

from __future__ import annotations

import functools
import math

import torch


def check_power_of_two(n: int) -> None:
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard rotation needs head_dim to be a power of two, got {n}")


@functools.lru_cache(maxsize=32)
def hadamard_matrix(n: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    """The normalised ``n x n`` Sylvester–Hadamard matrix (entries ``±1/sqrt(n)``)."""
    check_power_of_two(n)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (h / math.sqrt(n)).to(dtype=dtype, device=device)


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """``x`` rotated over its last dim; applying it twice gives ``x`` back (up to rounding).

    Low-precision inputs (bf16/fp16) are rotated in float32 and cast back.
    """
    if not x.is_floating_point():
        raise TypeError(f"hadamard_rotate needs a floating-point tensor, got dtype {x.dtype}")
    n = x.shape[-1]
    check_power_of_two(n)
    compute = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    h = hadamard_matrix(n, compute, str(x.device))
    return (x.to(compute) @ h).to(x.dtype)
