"""A decode step's kernel launches worked out once and reused across its layers, and the output
written into the caller's buffer (``out=``): the same bits as fresh launches per layer with the result
copied, the same stored K/V."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_helpers import DEVICES, fill
from radix_helpers import small_cache

from kvstrata.radix.kernels import attend

HKV, HQ, D, P = 2, 6, 32, 16
SCALE = 1 / math.sqrt(D)
CODECS = ["fp8_e4m3", "int8", "fp8_e4m3"]  # layers 0 and 2 share their launch


class NoReuse(dict):
    """A stand-in for the step launch table that keeps nothing: every layer works out its launch."""

    def setdefault(self, key, default=None):  # noqa: ANN001, ANN201
        return {}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bytes (NaN included)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def run_steps(
    device: str, reuse: bool, steps: int = 3, kernels: bool = True
) -> tuple[list[torch.Tensor], object, int]:
    cache = small_cache(
        num_layers=len(CODECS),
        kv_heads=HKV,
        head_dim=D,
        page_size=P,
        recent_window=16,
        layer_codecs=CODECS,
        num_pages=48,
        max_running=4,
        sinks=True,
        device=device,
    )
    g = torch.Generator().manual_seed(3)
    seqs = fill(cache, [37, 15, 60], g, HQ, SCALE)  # 15 + 1: a page completes in the first step
    outs, launches = [], 0
    for _ in range(steps):
        batch = cache.begin_step(seqs, [1] * len(seqs))
        for layer in range(len(CODECS)):
            q, k, v = (torch.randn(len(seqs), n, D, generator=g).to(device) for n in (HQ, HKV, HKV))
            k[1, 0, 3] = float("nan") if layer == 1 else k[1, 0, 3]  # sequence 1 completes a page
            if not kernels:
                got = cache.attention(layer, batch, q, k, v, SCALE)
            elif reuse:
                buf = torch.full_like(q, float("nan"))
                got = cache.attention(layer, batch, q, k, v, SCALE, kernels=True, out=buf)
                assert got is buf
            else:
                got = cache.attention(layer, batch, q, k, v, SCALE, kernels=True)
            outs.append(got.clone())
        if reuse:
            launches = len(attend._STEP_LAUNCHES[batch])
        cache.end_step(batch)
    return outs, cache, launches


@pytest.mark.parametrize("device", DEVICES)
def test_reused_launches_and_out_buffer_match_fresh_launches(device, monkeypatch):
    reused, cache, launches = run_steps(device, reuse=True)
    assert launches == 2  # one per distinct layer codec, the third layer reused the first's
    with monkeypatch.context() as m:
        m.setattr(attend, "_STEP_LAUNCHES", NoReuse())
        fresh, ref_cache, _ = run_steps(device, reuse=False)
    assert len(reused) == len(fresh) == 3 * len(CODECS)
    for a, b in zip(reused, fresh, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)  # NaN: layer 1's key
    assert same_bits(cache.ring.k, ref_cache.ring.k) and same_bits(cache.ring.v, ref_cache.ring.v)
    for layer in range(len(CODECS)):
        for name, part in cache.pool.k[layer].items():
            assert same_bits(part, ref_cache.pool.k[layer][name])
        for name, part in cache.pool.v[layer].items():
            assert same_bits(part, ref_cache.pool.v[layer][name])
    assert cache.absmax == ref_cache.absmax and cache.nonfinite == ref_cache.nonfinite


@pytest.mark.parametrize("device", DEVICES)
def test_out_buffer_must_fit(device):
    cache = small_cache(
        num_layers=1,
        kv_heads=HKV,
        head_dim=D,
        page_size=P,
        recent_window=16,
        layer_codecs=["fp8_e4m3"],
        device=device,
    )
    seqs = fill(cache, [20], torch.Generator().manual_seed(0), HQ, SCALE)
    batch = cache.begin_step(seqs, [1])
    q, k, v = (
        torch.zeros(1, HQ, D, device=device),
        torch.zeros(1, HKV, D, device=device),
        torch.zeros(1, HKV, D, device=device),
    )
    with pytest.raises(ValueError, match="out must be"):
        cache.attention(0, batch, q, k, v, SCALE, kernels=True, out=torch.empty(1, HQ, D + 1, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_encoder_counts_of_a_step_reduced_at_once_match_the_torch_store(device):
    """The kernels' encoder counts, kept per layer and reduced once a step, equal the torch store's."""
    _, got, _ = run_steps(device, reuse=True)
    _, ref, _ = run_steps(device, reuse=False, kernels=False)
    assert got.nonfinite == ref.nonfinite and got.absmax == ref.absmax
    assert got.nonfinite["k"][1] >= 1 and got.nonfinite["k"][0] == got.nonfinite["k"][2] == 0
