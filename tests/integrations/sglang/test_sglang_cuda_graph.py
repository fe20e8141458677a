"""Decode steps of ``--attention-backend kvstrata`` as SGLang's CUDA graphs run them, on CPU.

A captured graph replays the same kernels on the same buffers; what changes between replays is what
``init_forward_metadata_out_graph`` copies in and ``init_forward_metadata_in_graph`` gathers. Here both
run exactly as SGLang's decode graph runner calls them (a batch padded to its bucket with row 0,
sequence length 1 and slot 0), and the forward runs eagerly on the static step, which is what a
replay executes: the static buffers must equal the eager plan of the same batch, and the outputs and
pool contents must equal kvstrata's own cache.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from kvstrata.quant import relative_rmse
from tests.integrations.sglang.conftest import PAGE
from tests.integrations.sglang.test_sglang_pool_attention import (
    HEAD_DIM,
    KV_HEADS,
    Q_HEADS,
    World,
    assert_pool_equals_cache,
    run_schedule,
)

BUCKET = 3  # run_schedule decodes two requests: one padding entry
# Requests of up to 128 tokens: the static page table has 32 columns, so the decode kernel splits each
# history in two (as on a GPU at small batches), at half the interpreted work of the default 256.
REPLAY_CONTEXT = 128


def capture(w: World, bs: int):
    """What SGLang's capture does for bucket ``bs``: a batch of padding only (``capture_prepare``),
    then the warm-up forward on the static step. Returns that step."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    w.backend.init_cuda_graph_state(max_bs=8, max_num_tokens=8)
    fb = SimpleNamespace(
        forward_mode=ForwardMode.DECODE,
        batch_size=bs,
        req_pool_indices=torch.zeros(bs, dtype=torch.long),
        seq_lens=torch.ones(bs, dtype=torch.long),
        seq_lens_cpu=torch.ones(bs, dtype=torch.long),
        out_cache_loc=torch.zeros(bs, dtype=torch.long),
    )
    w.backend.init_forward_metadata_out_graph(fb, in_capture=True)
    w.backend.init_forward_metadata_in_graph(fb)
    for layer in w.layers:
        q = torch.randn(bs, Q_HEADS * HEAD_DIM, dtype=torch.bfloat16)
        k, v = (torch.randn(bs, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(2))
        w.backend.forward_decode(q, k, v, layer, fb)
    return w.pool.step


@pytest.mark.parametrize("stale_padding", [False, True])
def test_graph_plan_equals_eager_plan(stale_padding: bool):
    """The static buffers of a padded decode step (host plan + device gathers) hold what the eager
    plan of the same batch holds; padding reads nothing and writes only ring slot 0; entries that
    complete no page have page id `NO_PAGE` (the page-quantize kernel skips them).
    ``stale_padding``: the padded entries name a live request's row (a request-row buffer whose padded
    tail was not reset) with sequence length 1: still padding, that row's ring untouched."""
    from kvstrata.integrations.sglang.graph import NO_PAGE, DecodeGraphState

    w = World("fp8_e4m3")
    pool, P = w.pool, PAGE
    R, null = pool.ring.capacity, pool.ring.null_row
    req_to_token = w.req_pool.req_to_token
    state = DecodeGraphState(8, req_to_token.shape[1], P, R, null, torch.device("cpu"))
    checked = []

    def check(w: World, batch, decode: bool) -> None:
        if not decode:
            w.step(batch, decode)
            return
        n = len(batch)
        live = [w.rows[name] for name, _, _ in batch]
        rows = live + [live[0] if stale_padding else 0] * (BUCKET - n)
        prefix = [L for _, L, _ in batch] + [0] * (BUCKET - n)
        book = copy.deepcopy(pool.rings)
        plan = book.plan_decode(rows, w.req_pool.req_generation[rows].tolist(), prefix)
        step = state.load(plan)
        state.gather(BUCKET, req_to_token)
        w.step(batch, decode)
        eager = pool.step
        (g,) = eager.groups
        assert step is state.steps[BUCKET] and step.num_tokens == BUCKET
        lengths = state.lengths[:, :BUCKET].tolist()
        assert lengths[0][:n] == g.cold_pages and lengths[1][:n] == g.ring_len
        assert lengths[0][n:] == lengths[1][n:] == [0] * (BUCKET - n) and lengths[2] == [0] * BUCKET
        ring_rows = state.ring_rows
        for i in range(n):
            cold, ring = g.cold_pages[i], g.ring_len[i]
            assert torch.equal(state.page_table[i, :cold].long(), g.page_table[i, :cold])
            assert torch.equal(ring_rows[i, :ring], g.ring_rows[i, :ring])
            assert (ring_rows[i, ring:] == null).all()
        done = plan.complete.bool()
        assert torch.equal(state.page_ids[:BUCKET][done], eager.write.page_ids)
        assert (state.page_ids[:BUCKET][~done] == NO_PAGE).all()
        sources = state.sources[: BUCKET * P].view(BUCKET, P)
        assert torch.equal(sources[done].reshape(-1), eager.write.kernel_sources(P))
        assert (sources[~done] == null).all()
        ring_dst = state.views["ring_dst"][:BUCKET]
        assert torch.equal(ring_dst[:n], eager.write.ring_dst)
        assert torch.equal(eager.write.ring_src, torch.arange(n))
        assert (ring_dst[n:] < R).all()  # slot 0 belongs to row 0, which no request gets
        assert plan.rows[n:].tolist() == [0] * (BUCKET - n)
        for row in rows[:n]:
            assert book.ring(row) == pool.rings.ring(row)
        checked.append(int(done.sum()))

    run_schedule(w, check)
    assert len(checked) == 8 and sum(checked) > 0  # every decode step, some completing a page


def test_replayed_decode_equals_kvstrata_cache(monkeypatch):
    """Decode steps run on the captured step of their bucket (Triton kernels, interpreted on CPU):
    pool contents equal kvstrata's own cache bit for bit, attention outputs up to the split-KV merge
    (the static page table is as wide as a request can be long, so the kernel splits the history)."""
    from kvstrata.radix.kernels.attend import DECODE_LAUNCH, _num_splits

    monkeypatch.setitem(DECODE_LAUNCH[False], "min_pages", 16)  # splits of this short history
    target = DECODE_LAUNCH[False]["programs"]
    assert _num_splits(BUCKET * KV_HEADS, REPLAY_CONTEXT // PAGE, target, 16) == 2  # the kernel splits
    w = World("fp8_e4m3", "triton", max_context=REPLAY_CONTEXT)
    captured = capture(w, BUCKET)
    padding_page = fill_page(w.pool.cold, 0, 0x5A)  # SGLang's padding page: no decode step writes it
    worst = []

    def check(w: World, batch, decode: bool) -> None:
        _, outs, refs = w.step(batch, decode, graph_bs=BUCKET if decode else None)
        assert (w.pool.step is captured) == decode
        for out, ref in zip(outs, refs, strict=True):
            worst.append(relative_rmse(out.float(), ref.reshape(out.shape).float()))
        assert_pool_equals_cache(w, batch)

    run_schedule(w, check)
    print(f"replayed decode vs kvstrata's cache: worst relative RMSE {max(worst):.2e}")
    assert max(worst) < 2**-8  # the bf16 rounding of the output
    assert w.pool.quantized_pages == w.ref.quantized_pages > 0
    # Entries that complete no page (padding, and 15 of 16 steps of a request) quantize nothing.
    assert all(torch.equal(a, b) for a, b in zip(page_bytes(w.pool.cold, 0), padding_page, strict=True))


def cold_buffers(cold) -> list[torch.Tensor]:
    """Every buffer (codes, scales) of every layer of a `ColdPool`, K and V; pages first."""
    return [t for side in (cold.k, cold.v) for layer in side for t in layer.values()]


def page_bytes(cold, page: int) -> list[torch.Tensor]:
    """Copies of the bytes of cold page ``page`` in every buffer."""
    return [t[page : page + 1].contiguous().view(torch.uint8).clone() for t in cold_buffers(cold)]


def fill_page(cold, page: int, byte: int) -> list[torch.Tensor]:
    """Set every byte of cold page ``page`` to ``byte``; its bytes as `page_bytes` returns them."""
    for t in cold_buffers(cold):
        t[page : page + 1].view(torch.uint8).fill_(byte)
    return page_bytes(cold, page)


def test_graph_refusals_are_clear():
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    w = World("fp8_e4m3")  # torch kernels: their masks come from host lists, not graph buffers
    with pytest.raises(ValueError, match="Triton kernels only"):
        w.backend.init_cuda_graph_state(max_bs=8, max_num_tokens=8)
    w = World("fp8_e4m3", "triton")
    w.backend.init_cuda_graph_state(max_bs=8, max_num_tokens=8)
    assert w.backend.get_cuda_graph_seq_len_fill_value() == 1
    extend = SimpleNamespace(forward_mode=ForwardMode.EXTEND, req_pool_indices=torch.tensor([1]))
    with pytest.raises(NotImplementedError, match="--disable-prefill-cuda-graph"):
        w.backend.init_forward_metadata_out_graph(extend)
