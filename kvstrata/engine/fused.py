"""Fused kernels for the dense half of a step on CUDA: RMSNorm (alone, or after the residual add),
SiLU(gate) * up, and RoPE on q and k in one launch (Triton, `kvstrata.engine.fused_kernels`).

Each kernel follows the model's torch code rounding for rounding (inputs and outputs in the model
dtype, arithmetic in float32, a rounding to the model dtype wherever torch rounds a half-precision
intermediate), so outputs differ from the torch path only by the float32 summation order inside an
RMSNorm and the last bit of float32 ``rsqrt``/``exp``. What one launch replaces:

    add_rms_norm   x + delta, then RMSNorm      torch: add, cast, pow, mean, add, rsqrt, mul, cast, mul
    rms_norm       RMSNorm                      torch: the same without the add
    silu_mul       silu(gate) * up of [T, 2I]   torch: silu, mul
    rope_qkv       RoPE on q and k, split q/k/v    torch: neg, cat, mul, mul, add, (copies)

``MODE`` picks where they run: ``"auto"`` (CUDA tensors in bfloat16), ``"off"`` (never: the
torch code everywhere, the baseline of `benchmarks/decode_step_gpu.py`) or ``"force"`` (any device:
tests run the kernels on CPU under ``TRITON_INTERPRET=1``). Under ``"auto"`` the CPU path, which tests
compare with transformers token for token, is the torch code unchanged. Float16 stays on the torch
code on CUDA as well: on the H200 the float16 kernels were not bit-equal to torch's CUDA code (SiLU*mul
up to 2 float16 steps off, Triton's ``exp`` against CUDA's ``expf``; RoPE one step off on a few
elements, cause not found), while every bfloat16 kernel was; the kernels still take float16 under
``"force"`` (the interpreter tests).
"""

from __future__ import annotations

import torch
from torch import Tensor

MODE = "auto"
MODES = ("auto", "off", "force")
AUTO_DTYPES = (torch.bfloat16,)  # where "auto" runs them on CUDA (see the module docstring)
# `rope_qkv`: tokens x heads a program, and its warps. H200, 8,192 tokens (bitwise equal outputs): 8B
# layer (40 q/k heads of 128) 77.2 us against 93.8 for one token a program with its heads padded to a
# power of two (64); the default model's (12 of 64) 40.5 against 45.4. Blocks of 2-16 tokens x 8-16
# heads ran 76.7-87.2 us (8B) and 37.2-69.8 (default model). One run of a one-off script (not kept)
# beside the previous kernel; in a whole prefill (256 prompts of 1,536 tokens) 181 -> 136 ms.
ROPE_BLOCK = (1, 8)
ROPE_WARPS = 1


def applies(x: Tensor) -> bool:
    """Whether the fused kernels run for ``x`` under the current ``MODE``."""
    if MODE not in MODES:
        raise ValueError(f"fused.MODE must be one of {MODES}, got {MODE!r}")
    if MODE == "off":
        return False
    return MODE == "force" or (x.is_cuda and x.dtype in AUTO_DTYPES)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _warps(block: int) -> int:
    return max(1, min(8, block // 512))


def _rows(x: Tensor) -> Tensor:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"fused kernels take 2-D rows with unit column stride, got {tuple(x.shape)}")
    return x


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of the rows of ``x`` [T, N], as `RMSNorm.forward` computes it in the model dtype."""
    return _norm(x, None, weight, eps)[1]


def add_rms_norm(
    x: Tensor, delta: Tensor, weight: Tensor, eps: float, out: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``s = x + delta`` (the residual stream; written into ``out`` if given) and the RMSNorm of ``s``
    in one pass: (s, norm(s))."""
    for t in (delta, out):
        if t is not None and (t.shape != x.shape or t.dtype != x.dtype):
            raise ValueError(
                f"add_rms_norm: {tuple(t.shape)} {t.dtype} does not fit x {tuple(x.shape)} {x.dtype}"
            )
    return _norm(x, delta, weight, eps, out)


def _norm(
    x: Tensor, delta: Tensor | None, weight: Tensor, eps: float, out_sum: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    from kvstrata.engine.fused_kernels import rms_norm_kernel

    x = _rows(x)
    T, N = x.shape
    if weight.shape != (N,):
        raise ValueError(f"RMSNorm weight {tuple(weight.shape)} does not fit rows of {N}")
    out = torch.empty_like(x)
    total = x if delta is None else _rows(out_sum) if out_sum is not None else torch.empty_like(x)
    d = x if delta is None else _rows(delta)
    if T:
        block = _next_pow2(N)
        rms_norm_kernel[(T,)](
            x, d, weight, total, out, x.stride(0), d.stride(0), total.stride(0), out.stride(0), N, eps,
            ADD=delta is not None, BLOCK=block, num_warps=_warps(block),
        )  # fmt: skip
    return total, out


def silu_mul(gate_up: Tensor) -> Tensor:
    """``silu(gate) * up`` of ``gate_up`` [T, 2I] (gate columns first, then up) -> [T, I]."""
    from kvstrata.engine.fused_kernels import silu_mul_kernel

    gate_up = _rows(gate_up)
    T, width = gate_up.shape
    if width % 2:
        raise ValueError(f"silu_mul needs an even width (gate and up), got {width}")
    n = width // 2
    out = torch.empty((T, n), dtype=gate_up.dtype, device=gate_up.device)
    if T:
        block = min(1024, _next_pow2(n))
        grid = (T, -(-n // block))
        silu_mul_kernel[grid](gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=block, num_warps=4)
    return out


def rope_qkv(
    qk: Tensor,
    v: Tensor,
    cos: Tensor,
    sin: Tensor,
    q_heads: int,
    out: tuple[Tensor, Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """`apply_rope` on ``qk`` [T, Hq + Hkv, D] (q heads, then k heads; any token and head strides, unit
    stride within a head: the q/k part of a fused QKV projection) and the split into q [T, Hq, D],
    k, v [T, Hkv, D] in one launch; ``v`` [T, Hkv, D] (unit stride within a head) is copied. cos/sin
    [T, 1, D]. Written into ``out`` (q, k, v: any row stride, contiguous heads), or new tensors."""
    from kvstrata.engine.fused_kernels import rope_qkv_kernel

    T, H, D = qk.shape
    kv_heads = H - q_heads
    if D % 2 or qk.stride(2) != 1 or v.stride(2) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError(f"rope needs an even head_dim and unit-stride heads, got {tuple(qk.shape)}")
    if cos.shape != (T, 1, D) or sin.shape != (T, 1, D) or v.shape != (T, kv_heads, D):
        raise ValueError(
            f"rope: cos/sin {tuple(cos.shape)} or v {tuple(v.shape)} do not fit {tuple(qk.shape)}"
        )
    shapes = ((T, q_heads, D), (T, kv_heads, D), (T, kv_heads, D))
    if out is None:
        out = tuple(torch.empty(s, dtype=qk.dtype, device=qk.device) for s in shapes)  # type: ignore[assignment]
    q, k, v_out = out
    for t, s in zip(out, shapes, strict=True):
        if t.shape != s or t.stride(2) != 1 or t.stride(1) != D or t.dtype != qk.dtype:
            raise ValueError(
                f"rope: an output of shape {tuple(t.shape)} does not fit {s} with contiguous heads"
            )
    if T:
        block_t, block_h = ROPE_BLOCK
        block_h = min(block_h, _next_pow2(H))
        grid = (-(-T // block_t), -(-H // block_h) + -(-kv_heads // block_h))
        rope_qkv_kernel[grid](
            qk, v, cos, sin, q, k, v_out, qk.stride(0), qk.stride(1), v.stride(0), v.stride(1),
            cos.stride(0), sin.stride(0), q.stride(0), k.stride(0), v_out.stride(0), T, q_heads, kv_heads,
            HALF=D // 2, BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=_next_pow2(D // 2),
            num_warps=ROPE_WARPS,
        )  # fmt: skip
    return q, k, v_out
