"""Error measures for codec round trips."""

from __future__ import annotations

import torch


def relative_rmse(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """``||approx - reference|| / ||reference||`` over the finite elements of ``reference``.

    An all-zero reference gives the absolute error norm instead (0 for an exact round trip).
    """
    ref = reference.to(torch.float64)
    finite = torch.isfinite(ref)
    diff = (approx.to(torch.float64) - ref)[finite]
    norm = ref[finite].norm()
    return float(diff.norm() / norm) if norm > 0 else float(diff.norm())
