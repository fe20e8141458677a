"""CUDA parity: every codec gives the CPU result on the GPU, also through a gathered page pool."""

from __future__ import annotations

import pytest
import torch
from quant_helpers import as_pages, gaussian_kv

from kvstrata.quant import get_codec, list_codecs
from kvstrata.quant.rotation import hadamard_rotate

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("granularity", ["token", "channel"])
@pytest.mark.parametrize("name", list_codecs())
def test_cuda_matches_cpu(name: str, granularity: str):
    codec = get_codec(name)
    x = as_pages(gaussian_kv(tokens=64, heads=2, head_dim=64))
    x[1, 3, 0, 5] = float("nan")
    clip = torch.full((2, 1), 3.0)
    for static in (None, clip):
        cpu = codec.quantize(x, granularity, static_absmax=static)
        gpu = codec.quantize(x.cuda(), granularity, static_absmax=None if static is None else static.cuda())
        assert (gpu.overflow, gpu.nonfinite) == (cpu.overflow, cpu.nonfinite)
        assert gpu.nbytes() == cpu.nbytes()
        for part, tensor in cpu.parts.items():  # bit-identical pages (NaN payloads aside)
            other = gpu.parts[part].cpu()
            if tensor.dtype in (torch.float32, torch.bfloat16):
                assert torch.allclose(other, tensor, rtol=0, atol=0, equal_nan=True), part
            else:
                assert torch.equal(other.view(torch.uint8), tensor.view(torch.uint8)), part
        # decoding may differ in the last bit: the GPU may fuse code * scale + offset into one FMA
        y_gpu, y_cpu = codec.dequantize(gpu).cpu(), codec.dequantize(cpu)
        assert torch.allclose(y_gpu, y_cpu, rtol=1e-6, atol=1e-5, equal_nan=True)
        ids = torch.tensor([3, 0], device="cuda")
        gathered = {part: t[ids] for part, t in gpu.parts.items()}
        y = codec.dequantize_parts(gathered, granularity, 64, torch.bfloat16)
        assert y.device.type == "cuda" and y.dtype == torch.bfloat16
        assert torch.equal(y, codec.dequantize(gpu, torch.bfloat16)[ids])


def test_rotation_on_cuda():
    x = torch.randn(8, 2, 128, device="cuda")
    assert torch.allclose(hadamard_rotate(hadamard_rotate(x)), x, atol=1e-5)
