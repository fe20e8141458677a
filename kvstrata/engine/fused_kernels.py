"""The Triton kernels behind `kvstrata.engine.fused` (imported on first use, so a CPU start never loads
Triton for them). Arithmetic in float32; every `_round` is a rounding to the model dtype where the
torch code rounds a half-precision intermediate."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _round(x, dt: tl.constexpr):
    """float32 ``x`` rounded to nearest even in ``dt``, still as float32 (so that a later cast to ``dt``
    is exact). BF16 by its bits: the interpreter's BF16 cast truncates, the GPU's rounds."""
    if dt == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        return tl.where(x != x, x, rounded)
    else:
        return x.to(dt).to(tl.float32)


@triton.jit
def rms_norm_kernel(X, DELTA, W, SUM, OUT, stride_x, stride_d, stride_s, stride_o, N, eps,
                    ADD: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """One row per program: (x [+ delta] -> SUM), then weight * rmsnorm -> OUT."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    dt = OUT.dtype.element_ty
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0)
    if ADD:  # the residual add, rounded as torch's add is
        d = tl.load(DELTA + row * stride_d + cols, mask=ok, other=0.0)
        x32 = _round(x.to(tl.float32) + d.to(tl.float32), dt)
        tl.store(SUM + row * stride_s + cols, x32.to(dt), mask=ok)
    else:
        x32 = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(x32 * x32, axis=0) / N + eps)
    normed = _round(x32 * inv, dt)
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + row * stride_o + cols, _round(w * normed, dt).to(dt), mask=ok)


@triton.jit
def silu_mul_kernel(GU, OUT, stride_gu, stride_o, N, BLOCK: tl.constexpr):
    """silu(gate) * up for one block of one row of [T, 2N] (gate columns first)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    dt = OUT.dtype.element_ty
    g = tl.load(GU + row * stride_gu + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_gu + N + cols, mask=ok, other=0.0).to(tl.float32)
    s = _round(g / (1.0 + tl.exp(-g)), dt)
    tl.store(OUT + row * stride_o + cols, _round(s * u, dt).to(dt), mask=ok)


@triton.jit
def rope_qkv_kernel(QK, V_IN, COS, SIN, Q, K, V, stride_qkt, stride_qkh, stride_vit, stride_vih, stride_ct,
                    stride_st, stride_q, stride_k, stride_v, T, HQ, HKV, HALF: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """``BLOCK_T`` tokens x ``BLOCK_H`` heads. The first ``cdiv(HQ + HKV, BLOCK_H)`` head blocks rotate q
    and k heads of QK (x * cos + rotate_half(x) * sin) into Q and K; the rest copy v heads into V.
    Outputs have unit head stride 2 * HALF, any row stride."""
    tok = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)[:, None, None]
    block = tl.program_id(1)
    cols = tl.arange(0, BLOCK_D)[None, None, :]
    D: tl.constexpr = 2 * HALF
    dt = Q.dtype.element_ty
    qk_blocks = tl.cdiv(HQ + HKV, BLOCK_H)
    if block < qk_blocks:
        heads = block * BLOCK_H + tl.arange(0, BLOCK_H)[None, :, None]
        c_ok = (tok < T) & (cols < HALF)
        ok = c_ok & (heads < HQ + HKV)
        src = QK + tok * stride_qkt + heads * stride_qkh + cols
        x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
        c1 = tl.load(COS + tok * stride_ct + cols, mask=c_ok, other=0.0).to(tl.float32)
        c2 = tl.load(COS + tok * stride_ct + HALF + cols, mask=c_ok, other=0.0).to(tl.float32)
        s1 = tl.load(SIN + tok * stride_st + cols, mask=c_ok, other=0.0).to(tl.float32)
        s2 = tl.load(SIN + tok * stride_st + HALF + cols, mask=c_ok, other=0.0).to(tl.float32)
        lo = _round(_round(x1 * c1, dt) + _round(-x2 * s1, dt), dt).to(dt)
        hi = _round(_round(x2 * c2, dt) + _round(x1 * s2, dt), dt).to(dt)
        is_q = heads < HQ
        q_dst = Q + tok * stride_q + heads * D + cols
        tl.store(q_dst, lo, mask=ok & is_q)
        tl.store(q_dst + HALF, hi, mask=ok & is_q)
        k_dst = K + tok * stride_k + (heads - HQ) * D + cols
        tl.store(k_dst, lo, mask=ok & (heads >= HQ))
        tl.store(k_dst + HALF, hi, mask=ok & (heads >= HQ))
    else:
        heads = (block - qk_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)[None, :, None]
        ok = (tok < T) & (cols < HALF) & (heads < HKV)
        for half in tl.static_range(2):
            v = tl.load(V_IN + tok * stride_vit + heads * stride_vih + half * HALF + cols, mask=ok, other=0.0)
            tl.store(V + tok * stride_v + heads * D + half * HALF + cols, v, mask=ok)
