"""Piecewise decode graphs, the parts that run anywhere: bucket sizes, the forward cut at attention
(equal to the model's forward bit for bit), and the engine options (graphs off on CPU)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import tiny_models
import torch

from kvstrata.engine.cuda_graph import (
    DecodeGraphs,
    DecodePieces,
    capture_sizes,
    decode_graphs_for,
    graph_unsupported,
)
from kvstrata.engine.engine import Engine
from kvstrata.engine.loader import load_model
from kvstrata.engine.options import EngineArgs


@pytest.fixture(scope="module", params=["llama3", "qwen3"])
def tiny(request, tmp_path_factory):
    hf = tiny_models.hf_model(request.param)
    path = tiny_models.save_hf(hf, tmp_path_factory.mktemp(request.param))
    return load_model(path, dtype=torch.float32, device="cpu")


def test_capture_sizes_bucket_like_sglang():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(48) == [1, 2, 4, 8, 16, 24, 32, 40, 48]
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        capture_sizes(0)


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_pieces_equal_the_forward(tiny, batch):
    """The eager chain of pieces is the model's decode forward: the same logits, bit for bit, and
    the attention callback sees the same q/k/v per layer."""
    net = tiny.net
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, net.config.vocab_size, (batch,), generator=g)
    positions = torch.randint(0, 200, (batch,), generator=g)
    seen: dict[str, list[torch.Tensor]] = {"forward": [], "pieces": []}

    def recorder(name):
        dense = net.dense_attn_for([1] * batch)

        def attn(layer, q, k, v):
            seen[name].append(torch.cat([q, k, v], dim=1))
            return dense(layer, q, k, v)

        return attn

    with torch.inference_mode():
        want = net(ids, positions, attn=recorder("forward"))
        got = DecodePieces(net).forward(ids, positions, recorder("pieces"))
    assert torch.equal(got, want)
    assert len(seen["pieces"]) == net.config.num_layers
    assert all(torch.equal(a, b) for a, b in zip(seen["pieces"], seen["forward"], strict=True))


def test_graphs_need_cuda_and_static_rope(tiny):
    with pytest.raises(ValueError, match="CUDA device"):
        DecodeGraphs(tiny.net, 4).capture()
    assert decode_graphs_for(tiny.net, disable=False, max_bs=4) is None  # CPU: nothing to capture
    assert graph_unsupported(tiny.net) is None
    dynamic = dataclasses.replace(tiny.net.config, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert "dynamic RoPE" in graph_unsupported(SimpleNamespace(config=dynamic))


def test_engine_options():
    args = EngineArgs(max_running_requests=48)
    assert args.disable_cuda_graph is False
    assert args.resolve_cuda_graph_max_bs() == 48
    assert EngineArgs(max_running_requests=48, cuda_graph_max_bs=16).resolve_cuda_graph_max_bs() == 16
    assert EngineArgs(max_running_requests=8, cuda_graph_max_bs=16).resolve_cuda_graph_max_bs() == 8
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        EngineArgs(cuda_graph_max_bs=0).validate()


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    lengths = torch.randint(5, 40, (n,), generator=g).tolist()
    return [torch.randint(4, 300, (length,), generator=g).tolist() for length in lengths]


@pytest.mark.parametrize("batch", [1, 3, 6])
def test_engine_on_static_buffers_equals_eager(tiny, batch):
    """The graph path without graphs (pieces on the static buffers, padded to buckets 1, 2, 4; six
    sequences exceed them and run eager) gives the plain engine's greedy tokens, fp8 history with a
    ring and pages completed while decoding."""
    new = 20

    def run(static: bool) -> tuple[list[list[int]], int]:
        engine = Engine(
            model=tiny,
            kv_cache_dtype="fp8_e4m3",
            kv_plan="off",
            recent_window=16,
            page_size=8,
            max_total_tokens=2048,
            max_running_requests=8,
        )
        assert engine.runner.graphs is None  # CPU: nothing captured
        if static:
            engine.runner.graphs = DecodeGraphs(tiny.net, 4)
            engine.runner.graphs.use_pieces()
        try:
            params = {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}
            outs = engine.generate(input_ids=prompts(batch), sampling_params=params)
            engine.check_invariants()
            steps = engine.runner.graphs.replayed_steps if static else 0
            return [o["output_ids"] for o in outs], steps
        finally:
            engine.shutdown()

    eager, _ = run(False)
    static, steps = run(True)
    assert static == eager
    assert all(len(o) == new for o in static)
    if batch <= 4:
        assert steps >= new - 1
