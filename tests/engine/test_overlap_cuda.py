"""CUDA: overlap scheduling (the default there) gives the same greedy tokens as planning each step
after the read-back, with decode steps in CUDA graphs and above the largest captured size (eager),
requests of different lengths and stop tokens ending some mid-batch, BF16 and fp8 history."""

from __future__ import annotations

import pytest
import tiny_models
import torch

from kvstrata.engine.engine import Engine
from kvstrata.engine.loader import load_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tiny_models.save_hf(tiny_models.hf_model("llama3"), tmp_path_factory.mktemp("llama3"))
    return load_model(path, dtype="float32", device="cuda")


def requests(n: int, seed: int) -> tuple[list[list[int]], list[dict]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 60, (n,), generator=g).tolist()
    ps = [torch.randint(4, 300, (length,), generator=g).tolist() for length in lengths]
    news = torch.randint(1, 40, (n,), generator=g).tolist()
    params = [{"temperature": 0, "max_new_tokens": k, "ignore_eos": True} for k in news]
    for p in params[::3]:
        p["stop_token_ids"] = list(range(4, 40))  # likely to end some requests early
    return ps, params


def run(model, kv: str, overlap: bool, ps: list[list[int]], params: list[dict]) -> tuple[list, int]:
    engine = Engine(
        model=model,
        kv_cache_dtype=kv,
        kv_plan="off",
        recent_window=16,
        page_size=16,
        max_total_tokens=4096,
        max_running_requests=16,
        cuda_graph_max_bs=12,
        disable_overlap_schedule=not overlap,
    )
    try:
        assert engine.core.overlap == overlap
        outs = engine.generate(input_ids=ps, sampling_params=params)
        stats = engine.check_invariants()
        assert stats.running == 0
        assert stats.tiers["cold"].used == stats.tiers["cold"].cached
        return [(o["output_ids"], o["meta_info"]["finish_reason"]) for o in outs], engine.core.deferred_steps
    finally:
        engine.shutdown()


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("batch", [3, 11, 16])
def test_overlap_greedy_equals_read_back_first(tiny_model, kv, batch):
    ps, params = requests(batch, seed=batch)
    off, _ = run(tiny_model, kv, False, ps, params)
    on, deferred = run(tiny_model, kv, True, ps, params)
    assert on == off
    assert deferred > 0
