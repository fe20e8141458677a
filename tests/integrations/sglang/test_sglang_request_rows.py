"""Decode steps planned from host data only (`request_rows`): no host read of a device tensor, and a
request row that is unknown or no longer the request's raises instead of naming another ring.

The "device" of the no-read tests is PyTorch's ``meta`` device: its tensors have shapes but no data,
so any host read of them (``tolist``, ``item``, ``cpu``, ``numpy``, ``int``) raises, while the device
half of a step's plan (gathers, the graph's input copy, the row check) still runs.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvstrata.integrations.sglang.graph import NO_PAGE
from kvstrata.integrations.sglang.options import PluginOptions
from kvstrata.integrations.sglang.pool import pool_class
from kvstrata.integrations.sglang.request_rows import RequestRows, StaleRequestRows
from tests.integrations.sglang.conftest import HEAD_DIM, KV_HEADS, LAYERS, PAGE, alloc_row, free_row

WINDOW = 2 * PAGE
CONTEXT = 64
BUCKET = 4


def make_backend(req_device: str, pool_device: str, ring_device: str, **pool_kwargs):
    """Backend (the Triton kernels' graph contract) over SGLang's request rows on ``req_device`` and a
    stratified pool made on ``pool_device`` whose ring and step buffers go to ``ring_device``."""
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    from kvstrata.integrations.sglang.attention_backend import KvstrataAttnBackend
    from kvstrata.integrations.sglang.kernels import TritonStrataKernels

    req_pool = ReqToTokenPool(size=8, max_context_len=CONTEXT, device=req_device, enable_memory_saver=False)
    pool = pool_class(PluginOptions(codec="fp8_e4m3", recent_window=WINDOW))(
        size=8 * CONTEXT,
        page_size=PAGE,
        dtype=torch.bfloat16,
        head_num=KV_HEADS,
        head_dim=HEAD_DIM,
        layer_num=LAYERS,
        device=pool_device,
        enable_memory_saver=False,
        **pool_kwargs,
    )
    pool.device = ring_device
    runner = SimpleNamespace(token_to_kv_pool=pool, req_to_token_pool=req_pool)
    return KvstrataAttnBackend(runner, TritonStrataKernels())


def meta_world():
    """`make_backend` with its device tensors on the meta device (no kernel launched; the cold pages
    are not read); the host tensors (``req_generation``) stay on the CPU. The pool itself is made on
    the CPU: SGLang's pool asks torch for a device module, which meta has not."""
    backend = make_backend("meta", "cpu", "meta")
    assert backend.pool.req_to_token_pool.req_generation.device.type == "cpu"
    return backend


def meta_decode_batch(rids: list[str], prefix_lens: list[int], bs: int):
    """A decode batch as SGLang's replay view (or, unpadded, its ForwardBatch) holds it: device rows,
    lengths and slots on the meta device; host sequence lengths; padded entries of length 1."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    pad = bs - len(rids)
    seq_lens_cpu = torch.tensor([L + 1 for L in prefix_lens] + [1] * pad)
    device = {"dtype": torch.long, "device": "meta"}
    return SimpleNamespace(
        forward_mode=ForwardMode.DECODE,
        batch_size=bs,
        rids=rids,
        req_pool_indices=torch.empty(bs, **device),
        seq_lens=torch.empty(bs, **device),
        seq_lens_cpu=seq_lens_cpu,
        out_cache_loc=torch.empty(bs, **device),
    )


@pytest.mark.parametrize("path", ["graph replay", "eager"])
def test_decode_steps_read_nothing_from_the_device(path: str):
    backend = meta_world()
    req_pool = backend.pool.req_to_token_pool
    rows = [alloc_row(req_pool) for _ in range(3)]
    rids = ["a", "b", "c"]
    backend.requests.record(rids, rows)  # what their extend steps record
    prefix = [2 * PAGE, PAGE, 3 * PAGE]  # page aligned: each ring starts at its cached prefix
    if path == "graph replay":
        backend.init_cuda_graph_state(max_bs=8, max_num_tokens=8)
        backend.init_forward_metadata_out_graph(meta_decode_batch([], [], BUCKET), in_capture=True)
        backend.init_forward_metadata_in_graph(meta_decode_batch([], [], BUCKET))
    for _ in range(2 * PAGE):  # every entry completes pages
        fb = meta_decode_batch(rids, prefix, BUCKET if path == "graph replay" else len(rids))
        if path == "graph replay":
            backend.init_forward_metadata_out_graph(fb)
            backend.init_forward_metadata_in_graph(fb)
        else:
            backend.init_forward_metadata(fb)
        step = backend.pool.step
        assert step.num_tokens == fb.batch_size
        (group,) = step.groups
        cold = [backend.pool.rings.ring(row).start // PAGE for row in rows]  # after the step: >= before
        if path == "eager":  # as wide as the batch's history (the kernel splits by the width)
            assert group.page_table.shape[1] <= max(1, *cold)
        else:
            assert group.page_table.shape[1] == CONTEXT // PAGE
        prefix = [L + 1 for L in prefix]
    for row, L in zip(rows, prefix, strict=True):
        assert backend.pool.rings.ring(row).length == L
    assert backend.pool.quantized_pages == 2 * len(rows)


def test_old_host_read_fails_on_the_meta_device():
    """The no-read test can fail: a host read of the batch's device rows raises there."""
    fb = meta_decode_batch(["a"], [PAGE], 1)
    with pytest.raises(NotImplementedError, match="meta"):
        fb.req_pool_indices.tolist()


def test_unknown_or_stale_rows_raise():
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    req_pool = ReqToTokenPool(size=8, max_context_len=CONTEXT, device="cpu", enable_memory_saver=False)
    requests = RequestRows(req_pool)
    a, b = alloc_row(req_pool), alloc_row(req_pool)
    requests.record(["a", "b"], [a, b])
    rows, generations = requests.rows_of(["b", "a"])
    assert rows.tolist() == [b, a]
    assert generations.tolist() == req_pool.req_generation[[b, a]].tolist()
    with pytest.raises(StaleRequestRows, match="'z' decodes, but no extend step"):
        requests.rows_of(["a", "z"])
    free_row(req_pool, a)
    req_pool.req_generation[a] += 1  # row a allocated again (the free-list order differs by version)
    c = a  # for a request whose extend step has not run yet
    with pytest.raises(StaleRequestRows, match=f"'a' decodes on request row {a}, which was allocated again"):
        requests.rows_of(["a"])
    requests.record(["c"], [c])  # its extend step: the row is c's now, "a" is gone
    assert requests.rows_of(["c"])[0].tolist() == [a]
    with pytest.raises(StaleRequestRows, match="'a' decodes, but no extend step"):
        requests.rows_of(["a"])
    assert set(requests.row_of) == {"b", "c"}
    requests.record(["b"], [alloc_row(req_pool)])  # re-prefilled on a new row after a retraction
    assert requests.rows_of(["b"])[0].tolist() != [b]
    assert requests.owner[b] is None


def test_two_entries_on_one_row_raise():
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    req_pool = ReqToTokenPool(size=8, max_context_len=CONTEXT, device="cpu", enable_memory_saver=False)
    requests = RequestRows(req_pool)
    requests.record(["a"], [alloc_row(req_pool)])
    with pytest.raises(StaleRequestRows, match="two decode entries on one request row"):
        requests.rows_of(["a", "a"])


def test_backend_refuses_unmapped_decode_batches_before_planning():
    backend = meta_world()
    req_pool = backend.pool.req_to_token_pool
    row = alloc_row(req_pool)
    backend.requests.record(["a"], [row])
    backend.init_cuda_graph_state(max_bs=8, max_num_tokens=8)
    before = backend.pool.rings.ring(row)
    with pytest.raises(StaleRequestRows, match="'b' decodes"):
        backend.init_forward_metadata_out_graph(meta_decode_batch(["a", "b"], [PAGE, PAGE], BUCKET))
    with pytest.raises(StaleRequestRows, match="no request ids"):
        backend.init_forward_metadata_out_graph(
            SimpleNamespace(**{**vars(meta_decode_batch(["a"], [PAGE], BUCKET)), "rids": None})
        )
    with pytest.raises(StaleRequestRows, match="'b' decodes"):
        backend.init_forward_metadata(meta_decode_batch(["b"], [PAGE], 1))
    assert backend.pool.rings.ring(row) == before  # nothing planned


@pytest.mark.parametrize("path", ["graph replay", "eager"])
def test_rows_other_than_sglangs_fail_the_device_check(path: str):
    """Request ids that name other rows than the batch's own (device-side check; immediate on CPU)."""
    from kvstrata.integrations.sglang.attention_backend import KvstrataAttnBackend
    from kvstrata.integrations.sglang.kernels import TritonStrataKernels
    from kvstrata.integrations.sglang.warmup import forward_batch
    from tests.integrations.sglang.conftest import make_pools

    req_pool, pool, _ = make_pools(pool_class(PluginOptions(codec="fp8_e4m3", recent_window=WINDOW)))
    backend = KvstrataAttnBackend(
        SimpleNamespace(token_to_kv_pool=pool, req_to_token_pool=req_pool), TritonStrataKernels()
    )
    backend.init_cuda_graph_state(max_bs=8, max_num_tokens=8)
    a, b = alloc_row(req_pool), alloc_row(req_pool)
    backend.requests.record(["a", "b"], [a, b])
    loc = torch.zeros(2, dtype=torch.long)
    good = forward_batch([a, b], [PAGE, PAGE], [1, 1], loc, True, rids=["a", "b"])
    swapped = forward_batch([b, a], [PAGE, PAGE], [1, 1], loc, True, rids=["a", "b"])

    def step(fb) -> None:
        if path == "eager":
            backend.init_forward_metadata(fb)
        else:
            backend.init_forward_metadata_out_graph(fb)
            backend.init_forward_metadata_in_graph(fb)

    step(good)
    with pytest.raises(RuntimeError, match="host-planned request rows differ from SGLang's"):
        step(swapped)


def test_replay_view_hook_adds_the_request_ids():
    """After SGLang's ``load_plugins()`` (which applies the registered hooks), the decode graph
    runner's replay view of a batch carries the batch's request ids."""
    import inspect
    from unittest.mock import MagicMock

    from sglang.srt.model_executor.runner import decode_cuda_graph_runner as runner
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    from kvstrata.integrations.sglang import register

    load_plugins()
    # Where kvstrata runs from a path, not installed (the GPU machine), no entry point found it and
    # load_plugins() applied no kvstrata hook: register, then apply what is not patched yet.
    register()
    HookRegistry.apply_hooks()
    fb = MagicMock(rids=["a", "b"], seq_lens_sum=None)
    args = {name: MagicMock() for name in inspect.signature(runner.build_replay_fb_view).parameters}
    args.update(
        forward_batch=fb, bs=4, raw_bs=2, num_tokens=4, seq_len_fill_value=1, is_encoder_decoder=False
    )
    view = runner.build_replay_fb_view(**args)
    assert view.rids == ["a", "b"]
    assert view.num_padding == 2


def test_metadata_preparation_refuses_capture(monkeypatch):
    """Captured into SGLang's metadata glue graph, the host plan would replay frozen: refused (SGLang
    then runs the preparation eagerly), before anything is planned."""
    backend = meta_world()
    row = alloc_row(backend.pool.req_to_token_pool)
    backend.requests.record(["a"], [row])
    backend.init_cuda_graph_state(max_bs=8, max_num_tokens=8)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="cannot be captured"):
        backend.init_forward_metadata_out_graph(meta_decode_batch(["a"], [PAGE], BUCKET))
    assert backend.pool.rings.ring(row).length == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures a CUDA graph")
def test_gather_and_row_check_replay_in_a_cuda_graph():
    """On a GPU: the device half of a decode step, row check included, captured once and replayed with
    each step's host plan; the replayed page tables and ring lengths are the requests' own."""
    backend = make_backend("cuda", "cuda", "cuda", enable_alt_stream=False)
    req_pool = backend.pool.req_to_token_pool
    rows = [alloc_row(req_pool) for _ in range(2)]
    for row in rows:
        req_pool.req_to_token[row] = torch.arange(row * CONTEXT, (row + 1) * CONTEXT, dtype=torch.int32)
    backend.requests.record(["a", "b"], rows)
    backend.init_cuda_graph_state(max_bs=8, max_num_tokens=8)
    device_rows = torch.zeros(BUCKET, dtype=torch.long, device="cuda")  # SGLang's static buffer

    def view(prefix: list[int], rids: list[str]):
        fb = meta_decode_batch(rids, prefix, BUCKET)
        fb.req_pool_indices = device_rows
        return fb

    backend.init_forward_metadata_out_graph(view([], []), in_capture=True)
    backend.init_forward_metadata_in_graph(view([], []))  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.init_forward_metadata_in_graph(view([], []))
    state, plans = backend.graph, []
    load = state.load
    state.load = lambda plan: (plans.append(plan), load(plan))[1]
    R, null = backend.pool.ring.capacity, backend.pool.ring.null_row
    prefix = [2 * PAGE, 3 * PAGE]
    completed = 0
    for _ in range(PAGE + 1):
        device_rows.copy_(torch.tensor(rows + [0] * (BUCKET - 2)))
        backend.init_forward_metadata_out_graph(view(prefix, ["a", "b"]))
        graph.replay()
        torch.cuda.synchronize()  # a failed row check would raise here
        plan = plans[-1]
        assert torch.equal(state.lengths[:, :BUCKET].cpu().long(), plan.lengths)
        for i, row in enumerate(rows):
            expected = (req_pool.req_to_token[row, : state.width * PAGE : PAGE] // PAGE).int()
            assert torch.equal(state.page_table[i], expected)
            held = int(plan.lengths[1, i])
            start, base = int(plan.ring_start[i]), int(plan.ring_base[i])
            ring = [base + (start + j) % R for j in range(held)] + [null] * (R - held)
            assert state.ring_rows[i].tolist() == ring
            page = int(expected[int(plan.page_col[i])]) if int(plan.complete[i]) else NO_PAGE
            assert int(state.page_ids[i]) == page
        completed += plan.pages_completed
        prefix = [L + 1 for L in prefix]
    assert completed == 2  # each request completed a page inside the replays
