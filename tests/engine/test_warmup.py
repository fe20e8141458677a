"""The start-up warm-up (`kvstrata/engine/warmup.py`): its workload's shapes, and an engine that ran
it is indistinguishable from one that did not (same greedy tokens, empty prefix cache, zero counters,
a step timeline summarized from after it)."""

from __future__ import annotations

import pytest
import torch
from prompt_texts import PROMPT_TEXTS

from kvstrata.engine.engine import Engine
from kvstrata.engine.options import EngineArgs
from kvstrata.engine.trace import TRACE_ENV, WARMUP_DONE, read_trace, summarize
from kvstrata.engine.warmup import EXTEND_TOKENS, decode_batches, history_tokens, merge_splits, warmup_rounds
from kvstrata.radix import StratifiedKVCache
from kvstrata.server.config import ServerConfig


def test_rounds_cover_batch_extends_and_long_histories() -> None:
    rounds = warmup_rounds(batch=64, page_size=16, capacity=100_000, context=8192, vocab=1000)
    first, extend, *alone = rounds[:7]
    assert len(first.prompts) == 64 and sorted(set(first.max_new)) == list(range(1, 9))
    assert {len(p) for p in first.prompts} >= {32, 32 + 16 * 23 + 15}  # 2 to 25 pages, partial ones too
    base = first.prompts[-1][: len(first.prompts[-1]) // 16 * 16]  # its whole pages: what the tree holds
    assert len(base) >= 32 and len(first.prompts[-1]) > len(base)  # here a partial page is cut
    assert [len(p) - len(base) for p in extend.prompts] == list(EXTEND_TOKENS)
    assert all(p[: len(base)] == base for p in extend.prompts)  # they extend a cached prompt
    # token counts on and off multiples of 16 (Triton's integer specialization), beside short query blocks
    assert {t % 16 == 0 for t in EXTEND_TOKENS if t >= 16} == {True, False} and min(EXTEND_TOKENS) <= 4
    # one request at a time over 32, 64, ... 256 pages, then the longest context (8192 - 16 - 4)
    assert [len(r.prompts[0]) for r in alone] == [512, 1024, 2048, 4096, 8172]
    assert all(len(r.prompts) == 1 and r.max_new == [2] for r in alone)
    assert all(0 <= t < 1000 for r in rounds for p in r.prompts for t in p)
    # round 4: 64, 32, ... 1 requests behind 17, 33, 65, 129, 257 whole pages of the last prompt (16 x
    # 2**j cold, 2 x the 8 pages a split of a launch with few programs reads), one new token each
    shared = rounds[7:]
    longest = alone[-1].prompts[0]
    assert [(len(r.prompts), len(r.prompts[0])) for r in shared] == [
        (b, 16 * pages + 1) for pages in (17, 33, 65, 129, 257) for b in (64, 32, 16, 8, 4, 2, 1)
    ]
    assert all(
        p[:-1] == longest[: len(p) - 1] and r.max_new == [2] * len(r.prompts)
        for r in shared
        for p in r.prompts
    )


def test_shared_history_batches_meet_the_wide_fp8_bound() -> None:
    """With 8 KV heads, FP8 decode takes its wide shape unsplit from 64 sequences (`attend.FP8_WIDE_PROGRAMS`
    512 programs; fewer sequences over longer histories once split): round 4 decodes at 64 and 63
    besides the halvings of the batch."""
    assert decode_batches(256, 8) == [256, 128, 64, 63, 32, 16, 8, 4, 2, 1]
    assert decode_batches(48, 8) == [48, 24, 12, 6, 3, 1]  # the wide shape out of reach
    assert history_tokens(16)[:3] == [16 * 17, 16 * 33, 16 * 65]


def test_merge_splits_bound_a_steps_partials() -> None:
    """`merge_splits`: per pass, one sequence's splits under the largest programs target (4,096: 512 at
    8 KV heads, 1,366 at 3) or its history's (pages over the fewest a split reads: 8, where a launch
    of few programs splits below its ``min_pages``, `attend.split_floor`), whichever is fewer, one
    more for the tail; times the step's passes."""
    assert merge_splits(8, 128, 1) == 17 and merge_splits(8, 128, 2) == 34
    assert merge_splits(8, 8192, 1) == 513 and merge_splits(8, 65536, 3) == 3 * 513
    assert merge_splits(3, 512, 1) == 65 and merge_splits(3, 65536, 1) == 1367
    assert merge_splits(8, 10, 1) == 2  # a history shorter than one split still gets a tail split


@pytest.mark.parametrize("group", [1, 2, 4, 8, 16])
def test_extends_meet_every_query_block(group: int) -> None:
    """Every query block an extend (2 or more new tokens) can take with ``group`` query heads per KV head
    is met by some warm-up extend: the block is a constexpr of the kernel, a new one compiles."""

    from kvstrata.radix.kernels.attend import EXTEND_LAUNCH, query_block

    for block_m in {launch["block_m"] for launch in EXTEND_LAUNCH.values()}:
        met = {query_block(t * group, block_m) for t in EXTEND_TOKENS}
        assert met == {query_block(t * group, block_m) for t in range(2, 1024)}, block_m


def test_rounds_fit_a_small_pool_and_context() -> None:
    capacity, context = 1000, 300
    rounds = warmup_rounds(batch=32, page_size=16, capacity=capacity, context=context, vocab=50)
    assert [len(r.prompts[0]) for r in rounds[2:]] == [280]  # 32 pages would not fit the context
    first = rounds[0]
    assert sum(len(p) for p in first.prompts) + 8 * len(first.prompts) <= capacity
    for r in rounds:
        limit = min(capacity, context) - 8
        assert all(len(p) + n <= limit for p, n in zip(r.prompts, r.max_new, strict=True))


@pytest.mark.parametrize("context", [8, 16, 17, 20, 40])
def test_rounds_never_send_an_empty_prompt(context: int) -> None:
    rounds = warmup_rounds(batch=4, page_size=16, capacity=10_000, context=context, vocab=50)
    assert all(p and len(p) + n <= context for r in rounds for p, n in zip(r.prompts, r.max_new, strict=True))
    assert bool(rounds) is (context > 16)  # too short a context for any prompt and its output: none


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_warm_engine_serves_like_a_cold_one(default_model, kv: str, tmp_path, monkeypatch) -> None:
    prompts = [default_model.tokenizer.encode(t) for t in PROMPT_TEXTS[:3]]
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    opts = dict(
        kv_cache_dtype=kv, recent_window=16 if kv != "auto" else None, page_size=16, max_total_tokens=1536,
        max_running_requests=4, chunked_prefill_size=64,
    )  # fmt: skip
    outs = {}
    for warm in (False, True):
        trace = tmp_path / f"trace_{warm}.jsonl"
        monkeypatch.setenv(TRACE_ENV, str(trace))
        engine = Engine(model=default_model, warmup="on" if warm else "off", **opts)
        try:
            stats = engine.check_invariants()
            assert stats.tiers["cold"].used == stats.tiers["cold"].cached == 0  # warm-up prefixes: gone
            snap = engine.get_stats()
            assert snap.requests_received_total == snap.generation_tokens_total == snap.steps_total == 0
            outs[warm] = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
            assert engine.get_stats().requests_received_total == len(prompts)
        finally:
            engine.shutdown()
        # the timeline's summary starts after the warm-up: only the served prompts' steps and tokens
        records = read_trace(trace.read_text().splitlines())
        assert [r["name"] for r in records if r["kind"] == "mark"] == ([WARMUP_DONE] if warm else [])
        timeline = summarize(records)
        assert (timeline.warmup_steps > 0) is warm
        fed = sum(len(p) for p in prompts) + len(prompts) * (params["max_new_tokens"] - 1)
        assert sum(k.tokens for k in timeline.kinds.values()) == fed  # CPU: no overlap, exact
    assert outs[True] == outs[False]


def test_extends_compute_exactly_their_tokens(default_model, monkeypatch) -> None:
    """The warm-up's extends run with exactly ``EXTEND_TOKENS`` new tokens behind the cached prefix
    (each extend kernel query block, 16 to 128 rows), not that plus the base prompt's partial page."""
    behind: list[int] = []
    begin_step = StratifiedKVCache.begin_step

    def spy(self, seqs, n_new):
        behind.extend(n for s, n in zip(seqs, n_new, strict=True) if s.length and n > 1)
        return begin_step(self, seqs, n_new)

    monkeypatch.setattr(StratifiedKVCache, "begin_step", spy)
    engine = Engine(
        model=default_model, warmup="on", max_total_tokens=1200, max_running_requests=4, page_size=16
    )
    engine.shutdown()
    assert set(EXTEND_TOKENS) <= set(behind)


def test_warmup_modes() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert [EngineArgs(warmup=m).resolve_warmup(cpu) for m in ("off", "cuda", "on")] == [False, False, True]
    assert [EngineArgs(warmup=m).resolve_warmup(cuda) for m in ("off", "cuda", "on")] == [False, True, True]
    with pytest.raises(ValueError, match="warmup"):
        EngineArgs(warmup="sometimes").validate()
    assert ServerConfig().warmup_mode() == "cuda"  # `kvstrata serve` warms up on CUDA
    assert ServerConfig(skip_server_warmup=True).warmup_mode() == "off"
