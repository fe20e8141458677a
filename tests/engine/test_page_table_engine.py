"""A CPU engine (on any machine) with the cache's device page table (`SlotPageTable`, used on CUDA)
forced on gives token-for-token the greedy outputs of the list-built plans: fp8 history with sinks and a
short window (cold pages are read every step), shared prefixes (inserts swap pages for the tree's copies),
and a pool small enough to preempt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from graph_steps import DRIFT_ON

from kvstrata import Engine
from kvstrata.radix.page_table import SlotPageTable

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
PROMPTS = [[3, 9, 27, 81] * 12, [3, 9, 27, 81] * 12 + [5, 6], [7] * 40, [11, 13, 17] * 9, [3, 9, 27, 81] * 8]


def generate(path: Path, table: bool, total_tokens: int) -> list[list[int]]:
    with Engine(model=str(path), load_format="dummy", device="cpu", kv_cache_dtype="fp8_e4m3",
                recent_window=16, kv_plan="off", max_total_tokens=total_tokens, max_running_requests=4,
                chunked_prefill_size=32, seed=0) as engine:  # fmt: skip
        cache = engine.core.cache
        assert cache.page_tables is None  # the CPU default: plans built from the lists
        if table:
            cache.page_tables = SlotPageTable(cache.ring.slots.total, cache.nulls.page, cache.device, width=2)
        params = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
        out = engine.generate(input_ids=PROMPTS, sampling_params=params)
        engine.check_invariants()
    return [o["output_ids"] for o in out]


@pytest.mark.parametrize("total_tokens", [4096, 320])  # 320: 20 pages for 5 requests of up to 90 tokens
def test_greedy_outputs_equal_with_and_without_the_device_table(tmp_path: Path, total_tokens: int) -> None:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    lists = generate(tmp_path, table=False, total_tokens=total_tokens)
    assert generate(tmp_path, table=True, total_tokens=total_tokens) == lists
    assert all(len(o) == 40 for o in lists)


def generate_raised(path: Path, table: bool) -> tuple[list[list[list[int]]], list[int]]:
    """With the drift monitor's raised pool: three rounds of `PROMPTS` (level 0, then level 1 twice,
    the last over the tree's cached pages); the outputs and, with the table, the steps per round that
    took it (the others were built from the lists: a sequence held a raised page)."""
    with Engine(model=str(path), load_format="dummy", device="cpu", kv_cache_dtype="fp8_e4m3",
                recent_window=16, kv_plan="off", max_total_tokens=4096, max_running_requests=4,
                chunked_prefill_size=32, **DRIFT_ON) as engine:  # fmt: skip
        cache = engine.core.cache
        assert cache.raised_pool is not None and cache.page_tables is None
        synced = [0]
        if table:
            tables = SlotPageTable(cache.ring.slots.total, cache.nulls.page, cache.device, width=2)
            sync = tables.sync

            def counted(seqs):
                synced[0] += 1
                return sync(seqs)

            tables.sync = counted  # type: ignore[method-assign]
            cache.page_tables = tables
        params = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
        outs, steps = [], []
        for level in (0, 1, 1):
            engine.drift.policy.level = level  # read by the engine thread at its next step
            out = engine.generate(input_ids=PROMPTS, sampling_params=params)
            outs.append([o["output_ids"] for o in out])
            steps.append(synced[0])
            synced[0] = 0
        engine.check_invariants()
    return outs, steps


def test_device_table_beside_a_raised_pool(tmp_path: Path) -> None:
    """The device table serves the steps whose sequences hold only text-pool pages, also with a raised
    pool; a step with a raised page is built from the lists. Same tokens as the lists alone."""
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    lists, _ = generate_raised(tmp_path, table=False)
    tabled, steps = generate_raised(tmp_path, table=True)
    assert tabled == lists
    level0, raised_new, raised_cached = steps
    assert level0 >= 40  # every step of the level-0 round took the table (85 here)
    # at level 1 each sequence's first new page is raised: only a step before any has one takes it (1)
    assert raised_new <= 2 and raised_cached <= 2
