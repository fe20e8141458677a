"""`benchmarks/flashinfer_peer.py`, the FlashInfer column of `attention_gpu.py`, on CPU: its page table,
its float32 reference (which decides whether a FlashInfer case is timed at all) against SDPA over the
same K/V laid out contiguously, and the case loop driven by a stand-in `flashinfer` module (the real
one needs CUDA) that attends over the pages it is given, or returns a wrong output."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import flashinfer_peer as peer  # noqa: E402


@pytest.mark.parametrize(("context", "pages", "last"), [(37, 3, 5), (32, 2, 16), (1, 1, 1)])
def test_paged_layout(context: int, pages: int, last: int):
    indptr, indices, last_len, got_pages = peer.paged_layout(3, context, device="cpu")
    assert got_pages == pages
    assert indptr.tolist() == [0, pages, 2 * pages, 3 * pages]
    assert indices.tolist() == list(range(3 * pages))
    assert last_len.tolist() == [last] * 3
    assert {t.dtype for t in (indptr, indices, last_len)} == {torch.int32}
    assert (got_pages - 1) * peer.PAGE + last_len[0].item() == context


def test_tensor_cores_as_sglang_chooses():
    assert peer.uses_tensor_cores(torch.bfloat16, 32, 8)
    assert not peer.uses_tensor_cores(torch.bfloat16, 9, 3)
    assert peer.uses_tensor_cores(torch.float8_e4m3fn, 9, 3)


def _paged(k: torch.Tensor, v: torch.Tensor, pages: int, poison: float) -> torch.Tensor:
    """``[batch * pages, 2, PAGE, hkv, d]`` pages of contiguous ``k``/``v`` ``[batch, context, hkv, d]``,
    the last page's unused rows set to ``poison``."""
    batch, context, hkv, d = k.shape
    kv = torch.full((batch, pages * peer.PAGE, 2, hkv, d), poison)
    kv[:, :context, 0] = k
    kv[:, :context, 1] = v
    return (
        kv.view(batch, pages, peer.PAGE, 2, hkv, d)
        .transpose(2, 3)
        .reshape(batch * pages, 2, peer.PAGE, hkv, d)
    )


@pytest.mark.parametrize("context", [37, 48])
def test_reference_is_sdpa_over_the_pages(context: int):
    """Every sequence against SDPA (GQA) on the same K/V; the padding rows of the last page (set huge)
    take no part."""
    torch.manual_seed(0)
    batch, hq, hkv, d = 3, 8, 2, 16
    q = torch.randn(batch, hq, d)
    k, v = torch.randn(2, batch, context, hkv, d)
    pages = -(-context // peer.PAGE)
    kv = _paged(k, v, pages, 1e4)
    want = F.scaled_dot_product_attention(
        q[:, :, None].double(), k.transpose(1, 2).double(), v.transpose(1, 2).double(), enable_gqa=True
    )[:, :, 0]
    for seq in range(batch):
        got = peer.reference(q, kv, seq, pages, context)
        assert (got.double() - want[seq]).abs().max().item() < 1e-5


class _Wrapper:
    """A stand-in for FlashInfer's `BatchDecodeWithPagedKVCacheWrapper`: keeps what `plan` was given
    and attends over those pages (``broken``: writes zeros)."""

    broken = False
    made: list[_Wrapper] = []

    def __init__(self, workspace, layout, **kwargs):
        assert layout == "NHD" and kwargs["use_cuda_graph"]
        self.kwargs = kwargs
        _Wrapper.made.append(self)

    def plan(self, indptr, indices, last, hq, hkv, d, page, **kwargs):
        self.planned = (indptr.tolist(), indices.tolist(), last.tolist(), hq, hkv, d, page, kwargs)

    def run(self, q, kv, out):
        indptr, indices, last, _, _, _, page, _ = self.planned
        for seq in range(q.shape[0]):
            own = indices[indptr[seq] : indptr[seq + 1]]
            assert own == list(range(own[0], own[0] + len(own)))
            context = (len(own) - 1) * page + last[seq]
            got = peer.reference(q, kv, own[0] // len(own), len(own), context)
            out[seq] = 0 if self.broken else got.to(out.dtype)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    module = types.ModuleType("flashinfer")
    module.__version__ = "stand-in"
    module.BatchDecodeWithPagedKVCacheWrapper = _Wrapper
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr(peer, "WORKSPACE_BYTES", 1024)
    monkeypatch.setattr(_Wrapper, "broken", False)
    _Wrapper.made.clear()
    return module


def test_rows_check_then_time_each_kv_dtype(fake_flashinfer):
    timed = []

    def bench(step):
        step()
        timed.append(step)
        return 0.5

    rows = peer.rows(bench, "8b", 2, 40, 8, 2, 16, device="cpu")
    assert [r["codec"] for r in rows] == ["flashinfer bf16", "flashinfer fp8_e4m3"]
    assert len(timed) == 2 and all(r["ms"] == 0.5 for r in rows)
    pages = 3
    assert rows[0]["bytes"] == 2 * pages * 2 * peer.PAGE * 2 * 16 * 2 + 2 * 2 * 8 * 16 * 2
    assert rows[1]["bytes"] == 2 * pages * 2 * peer.PAGE * 2 * 16 * 1 + 2 * 2 * 8 * 16 * 2
    assert [r["tensor_cores"] for r in rows] == [True, True]
    first = _Wrapper.made[0]
    assert first.planned[3:7] == (8, 2, 16, peer.PAGE)
    assert first.planned[7]["kv_data_type"] == torch.bfloat16
    assert _Wrapper.made[1].planned[7]["kv_data_type"] == torch.float8_e4m3fn


def test_rows_refuse_a_wrong_output(fake_flashinfer, monkeypatch):
    monkeypatch.setattr(_Wrapper, "broken", True)
    with pytest.raises(RuntimeError, match="flashinfer bf16 B=2 40: sequence 0 off by"):
        peer.rows(lambda step: 0.5, "8b", 2, 40, 8, 2, 16, device="cpu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_random_pages_are_standard_normal_in_their_dtype(dtype, monkeypatch):
    """Drawn three pages at a time (40 pages: the last slice short), every page standard normal."""
    monkeypatch.setattr(peer, "RANDOM_SLICE_ELEMENTS", 3 * 2 * peer.PAGE * 2 * 16)
    kv = peer.random_pages((40, 2, peer.PAGE, 2, 16), dtype, "cpu")
    assert kv.dtype == dtype and kv.shape == (40, 2, peer.PAGE, 2, 16)
    per_page = kv.float().flatten(1)
    assert per_page.isfinite().all()
    assert (per_page.mean(1).abs() < 0.2).all() and ((per_page.std(1) - 1).abs() < 0.15).all()
