"""CUDA: the engine on the GPU. Greedy output equals a transformers argmax loop token for token
(float32, tiny random Llama-3 and Qwen3 checkpoints), with chunked prefill, cold pages and prefix
reuse; quantized histories and a bfloat16 model run batched with preemption and aborts and leave the
cache clean.
"""

from __future__ import annotations

import threading

import pytest
import tiny_models
import torch

from kvstrata.engine.engine import Engine
from kvstrata.engine.loader import load_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

NEW = 24


@pytest.fixture(scope="module", params=["llama3", "qwen3"])
def tiny(request, tmp_path_factory):
    hf = tiny_models.hf_model(request.param)
    path = tiny_models.save_hf(hf, tmp_path_factory.mktemp(request.param))
    return hf.to("cuda"), path


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 90, (n,), generator=g).tolist()
    return [torch.randint(4, 300, (length,), generator=g).tolist() for length in lengths]


@torch.no_grad()
def argmax_loop(hf: torch.nn.Module, ids: list[int], new: int) -> list[int]:
    """Greedy decoding by full recomputation: no cache, no generate() logic, EOS ignored."""
    seq = torch.tensor([ids], device="cuda")
    for _ in range(new):
        nxt = hf(seq).logits[0, -1].argmax()
        seq = torch.cat([seq, nxt.view(1, 1)], dim=1)
    return seq[0, len(ids) :].tolist()


def clean(engine: Engine) -> None:
    stats = engine.check_invariants()
    assert stats.running == 0
    assert stats.tiers["cold"].used == stats.tiers["cold"].cached


def test_greedy_on_cuda_equals_transformers(tiny):
    hf, path = tiny
    model = load_model(path, dtype=torch.float32, device="cuda")
    assert model.net.device.type == "cuda"
    engine = Engine(
        model=model,
        kv_cache_dtype="auto",
        recent_window=16,
        page_size=16,
        chunked_prefill_size=40,
        max_total_tokens=2048,
        max_running_requests=4,
    )
    try:
        ps = prompts(6, seed=1)
        params = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
        outs = engine.generate(input_ids=ps, sampling_params=params)
        expected = [argmax_loop(hf, p, NEW) for p in ps]
        assert [o["output_ids"] for o in outs] == expected
        # The same prompts again: their full pages come from the tree and skip prefill.
        again = engine.generate(input_ids=ps, sampling_params=params)
        assert [o["output_ids"] for o in again] == expected
        # every full page of each prompt but the one holding its last token
        assert [o["meta_info"]["cached_tokens"] for o in again] == [(len(p) - 1) // 16 * 16 for p in ps]
        clean(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("kv_cache_dtype, dtype", [("fp8_e4m3", "bfloat16"), ("int4", "float32")])
def test_quantized_batch_with_preemption_and_abort_stays_clean(tiny, kv_cache_dtype, dtype):
    _, path = tiny
    model = load_model(path, dtype=dtype, device="cuda")
    engine = Engine(
        model=model,
        kv_cache_dtype=kv_cache_dtype,
        recent_window=16,
        page_size=16,
        chunked_prefill_size=64,
        max_total_tokens=256,  # 16 pages for 6 requests that want up to 8 each: preemption
        max_running_requests=4,
    )
    try:
        ps = prompts(6, seed=2)
        params = {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 40, "ignore_eos": True, "seed": 3}
        results: list[dict] = []
        aborted: list[dict] = []

        def run_and_abort() -> None:
            """r5 streams; it is aborted after its third chunk, so the abort always finds it running."""
            chunks = []
            long = {**params, "max_new_tokens": 200}
            for chunk in engine.generate(input_ids=ps[5], sampling_params=long, rid="r5", stream=True):
                chunks.append(chunk)
                if len(chunks) == 3:
                    engine.abort("r5")
            aborted.append(chunks[-1])

        workers = [
            threading.Thread(
                target=lambda p=p, i=i: results.append(
                    engine.generate(input_ids=p, sampling_params=params, rid=f"r{i}")
                )
            )
            for i, p in enumerate(ps[:5])
        ]
        workers.append(threading.Thread(target=run_and_abort))
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        assert len(results) == 5 and len(aborted) == 1
        assert aborted[0]["meta_info"]["finish_reason"]["type"] == "abort"
        assert 3 <= aborted[0]["meta_info"]["completion_tokens"] < 200
        for r in results:
            assert r["meta_info"]["finish_reason"]["type"] == "length"
            if "pool" not in r["meta_info"]["finish_reason"]:
                assert len(r["output_ids"]) == 40
            assert all(0 <= t < 300 for t in r["output_ids"])
        clean(engine)
        # Every page comes back once the tree lets go: nothing leaked to the aborted or preempted requests.
        assert engine.flush_cache()
        cold = engine.check_invariants().tiers["cold"]
        assert cold.used == 0 and cold.free == cold.total == 16
    finally:
        engine.shutdown()


def test_shutdown_gives_the_device_memory_back(tiny):
    """An engine that loaded its own weights returns them, its pools and its CUDA graphs at shutdown:
    allocated memory drops back to where it was, with no ``del`` and no collection by the caller. The
    tolerance is for the cuBLAS workspaces torch keeps per thread and stream (32 MiB each on Hopper)."""
    _, path = tiny
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    engine = Engine(
        str(path), device="cuda", dtype="bfloat16", kv_cache_dtype="fp8_e4m3", page_size=16,
        max_total_tokens=1 << 23, max_running_requests=4,
    )  # fmt: skip
    engine.generate(input_ids=prompts(1, seed=4)[0], sampling_params={"max_new_tokens": 8})
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    engine.shutdown()
    left = torch.cuda.memory_allocated() - before
    assert held > 1 << 30  # eight million tokens of cache: at least 1 GiB
    assert left <= 1 << 27, f"{left / 2**20:.1f} MiB still allocated of {held / 2**20:.1f} MiB"
