"""Input preparation shared by all quantizing codecs: checks, NaN/Inf policy, static clipping, absmax.

NaN/Inf policy: non-finite inputs are counted and replaced by 0 *before* any scale is computed, so a
bad element never inflates (or poisons) the scale of its token, channel or neighbours. It decodes to
exactly 0 with symmetric and float codecs, and to the grid point nearest 0 (within half a step) with
the asymmetric min/max ones (`int4`, `int8_asym`).

Static clipping: with ``static_absmax`` every finite element is clamped to ``[-clip, clip]`` (the
clip broadcast against the data) and the scale comes from the clip, not the data; each element with
``|x| > clip`` counts once as overflow.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Prepared:
    """Finite, clipped float32 data plus the absmax that sizes its scales.

    ``absmax`` has the scale shape: ``[..., tokens, heads, 1]`` (token) or ``[..., 1, heads, head_dim]``
    (channel). ``static`` tells asymmetric codecs to use ``[-absmax, absmax]`` as their range.
    """

    x: torch.Tensor
    absmax: torch.Tensor
    static: bool
    overflow: int
    nonfinite: int


def reduce_dim(granularity: str) -> int:
    """The axis a scale is reduced over: head_dim for token scales, tokens for channel scales."""
    return -1 if granularity == "token" else -3


def check_input(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"quantize needs a floating-point tensor, got dtype {x.dtype}")
    if x.dim() < 3:
        raise ValueError(f"expected [..., tokens, heads, head_dim], got shape {tuple(x.shape)}")


def amax(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t.amax(dim, keepdim=True)`` that returns zeros when the reduced axis is empty."""
    if t.shape[dim] == 0:
        shape = list(t.shape)
        shape[dim] = 1
        return t.new_zeros(shape)
    return t.amax(dim=dim, keepdim=True)


def amin(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t.amin(dim, keepdim=True)`` that returns zeros when the reduced axis is empty."""
    return -amax(-t, dim)


def prepare(x: torch.Tensor, granularity: str, static_absmax: torch.Tensor | None) -> Prepared:
    """Apply the NaN/Inf policy and static clipping, and compute the absmax per scale group."""
    check_input(x)
    xf = x.to(torch.float32)
    finite = torch.isfinite(xf)
    nonfinite = int(finite.numel() - finite.sum().item())
    if nonfinite:
        xf = torch.where(finite, xf, torch.zeros((), dtype=xf.dtype, device=xf.device))
    dim = reduce_dim(granularity)
    if static_absmax is None:
        return Prepared(xf, amax(xf.abs(), dim), False, 0, nonfinite)
    clip = static_absmax.to(device=xf.device, dtype=torch.float32)
    if (clip < 0).any() or not torch.isfinite(clip).all():
        raise ValueError("static_absmax must be finite and >= 0")
    try:
        clip_full = torch.broadcast_to(clip, xf.shape)
    except RuntimeError as exc:
        raise ValueError(
            f"static_absmax of shape {tuple(clip.shape)} does not broadcast to data {tuple(xf.shape)}"
        ) from exc
    overflow = int((xf.abs() > clip_full).sum().item())
    xf = torch.maximum(torch.minimum(xf, clip_full), -clip_full)
    return Prepared(xf, amax(clip_full, dim), True, overflow, nonfinite)
