"""The warm-up compiles every kernel variant serving launches: each (kernel, constexprs, launch
options, argument specialization) a served workload's steps record (`kernel_variants`) was recorded
in the warm-up already, for FP8 (both decode shapes, split and not), int4 (`decode4`) and BF16 history.

On CPU under the interpreter with the real launch tables, the kernels not run (`record_variants`'s
``execute`` off: only the launches matter), on a tiny model with 8 KV heads so that a decode of
64 or more sequences reaches `attend.FP8_WIDE_PROGRAMS` programs, as on the GPU.
"""

from __future__ import annotations

import os
import random

import pytest
import tiny_models
import torch

if torch.cuda.is_available():
    pytest.skip("records interpreted launches (CPU)", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")

from kernel_variants import record_variants  # noqa: E402

from kvstrata.engine.engine import Engine  # noqa: E402
from kvstrata.engine.loader import load_model  # noqa: E402
from kvstrata.engine.warmup import merge_splits  # noqa: E402

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def eight_kv_heads(tmp_path_factory):
    net = tiny_models.hf_model("qwen3", num_key_value_heads=8, max_position_embeddings=2048)
    return load_model(tiny_models.save_hf(net, tmp_path_factory.mktemp("kv8")), dtype=torch.float32)


def _serve(engine: Engine) -> None:
    """Decode at B=72, 48, 31 and 7 over 1-2K-token histories (B=72: the wide FP8 shape, split), single
    requests over 1-2K, a 16-token extend behind a cached 1,520-token prompt."""
    rng = random.Random(1)

    def ids(n: int) -> list[int]:
        return [rng.randrange(300) for _ in range(n)]

    for batch, length in ((72, 1536), (48, 1200), (31, 2000), (7, 1800), (1, 2000), (1, 1100)):
        prompts = [ids(length + i) for i in range(batch)]
        engine.generate(input_ids=prompts, sampling_params=dict(GREEDY, max_new_tokens=6))
    cached = ids(1520)
    for prompt in (cached, cached + ids(16)):
        engine.generate(input_ids=[prompt], sampling_params=dict(GREEDY, max_new_tokens=3))


def _warm_blocks_cover(warm, engine: Engine, passes: int) -> None:
    """The warm-up compiled the split merge for every block up to `warmup.merge_splits`'s bound (its
    `attend.merge_block`)."""
    from kvstrata.radix.kernels.attend import merge_block

    most = merge_splits(8, -(-engine.max_context // 16), passes)
    merges = set(_merges(warm))
    assert _warmed_merges(most, merge_block(most)) <= merges, (most, merges)


def _merges(variants) -> list[tuple[int, str]]:
    """(``BLOCK_S``, ``LOOPED``) of each recorded split-merge launch."""
    merges = [dict(parts) for name, parts in variants if name.endswith("_merge_kernel")]
    return [(int(d["BLOCK_S"]), d["LOOPED"]) for d in merges]


def _warmed_merges(most: int, top: int) -> set[tuple[int, str]]:
    """The merge variants a warm-up for ``most`` splits compiles, ``top`` its largest block: each
    power-of-two block up to it, and it looped where ``most`` is past it."""
    return {(2**i, "False") for i in range(top.bit_length())} | ({(top, "True")} if most > top else set())


@pytest.mark.parametrize("codec", ["fp8_e4m3", "int4", "auto"])
def test_warmup_meets_every_served_variant(eight_kv_heads, codec: str) -> None:
    with record_variants(execute=False) as warm:
        engine = Engine(
            model=eight_kv_heads, attention_backend="triton", kv_cache_dtype=codec, warmup="on",
            max_running_requests=80, page_size=16, max_total_tokens=150_000,
        )  # fmt: skip
    try:
        _warm_blocks_cover(warm, engine, passes=1)
        with record_variants(execute=False) as served:
            _serve(engine)
    finally:
        engine.shutdown()
    kernel = "_decode4_kernel" if codec == "int4" else "_decode_kernel"
    assert kernel in {name.rsplit(".", 1)[1] for name, _ in served}
    # the workload meets what the warm-up's rounds 1-3 alone missed (recorded before round 4 was added):
    # merges of 2 (BF16) or 4 (int4) splits, FP8's wide shape split. Where the partials fit
    # ``merge_reads`` chunks the decode kernel merges them itself: its merging variant (``MERGE_S``).
    decodes = [dict(parts) for name, parts in served if name.endswith(kernel)]
    assert any(d["SPLIT"] == "True" and d["MERGE_S"] != "0" for d in decodes)
    wide_split = {"num_warps": "1", "SPLIT": "True"}
    fp8_decodes = [dict(parts) for name, parts in served if name.endswith("_decode_kernel")]
    assert any(wide_split.items() <= d.items() for d in fp8_decodes) is (codec == "fp8_e4m3")
    missing = [name for name, _ in served - warm]
    assert not missing, f"{len(missing)} served variants the warm-up did not compile: {sorted(missing)}"


def test_warmup_meets_the_raised_pools_variants(eight_kv_heads) -> None:
    """With the drift fallback's raised pool, steps over raised pages add a kernel pass (the text
    pass then writes partials): served at fallback level 1, over new prompts and over prompts cached
    at level 0 (text pages, then raised ones), every variant was met by the warm-up's second run."""
    with record_variants(execute=False) as warm:
        engine = Engine(
            model=eight_kv_heads, attention_backend="triton", kv_cache_dtype="fp8_e4m3", warmup="on",
            max_running_requests=80, page_size=16, max_total_tokens=150_000,
            drift_sample_rate=1e-9, drift_threshold=1e9,
        )  # fmt: skip
    assert engine.cache.raised_pool is not None and engine.drift is not None
    try:
        _warm_blocks_cover(warm, engine, passes=2)
        rng = random.Random(2)
        cached = [[rng.randrange(300) for _ in range(700 + 9 * i)] for i in range(24)]
        with record_variants(execute=False) as served:
            engine.generate(input_ids=cached, sampling_params=dict(GREEDY, max_new_tokens=1))
            engine.drift.policy.level = 1  # new text pages raised (the engine thread reads it each step)
            _serve(engine)
            longer = [p + [rng.randrange(300) for _ in range(40)] for p in cached]
            engine.generate(input_ids=longer, sampling_params=dict(GREEDY, max_new_tokens=20))
    finally:
        engine.shutdown()
    raised_pass = [
        d
        for d in map(dict, (parts for _, parts in served))
        if d.get("HAS_SINKS") == "False" and d.get("SPLIT") == "True"
    ]
    assert raised_pass  # the raised pool's pass: no sink page, split partials
    missing = [name for name, _ in served - warm]
    assert not missing, f"{len(missing)} served variants the warm-up did not compile: {sorted(missing)}"


def test_warm_merges_compiles_every_split_block() -> None:
    """`attend.warm_merges` launches the split merge once for each block up to the power of two at or
    above the most splits: 5 splits, blocks 1, 2, 4 and 8; 1,539 splits (three passes at 128K tokens),
    blocks 1 to `attend.MERGE_BLOCK_S` (128), the most a merge program reads at once, and that block
    looped (more splits than it holds), the variant such a step launches."""
    from kvstrata.radix.kernels.attend import MERGE_BLOCK_S, Partials, merge_partials, warm_merges

    for most, top in ((5, 8), (128, 128), (1539, MERGE_BLOCK_S)):
        with record_variants() as seen:
            assert warm_merges(most, 4, 32, torch.float32, torch.device("cpu")) == top
        assert sorted(_merges(seen)) == sorted(_warmed_merges(most, top))
    assert MERGE_BLOCK_S == 128
    # every merge a step of at most that many splits launches is one the warm-up compiled
    with record_variants() as warm:
        warm_merges(1539, 4, 32, torch.float32, torch.device("cpu"))
    for splits in (1, 3, 100, 128, 129, 700, 1539):
        with record_variants() as served:
            merge_partials(
                [Partials(torch.zeros(1, 4, splits, 32), torch.zeros(1, 4, splits))], torch.empty(1, 4, 32)
            )
        assert served <= warm, (splits, served - warm)


def test_warmup_meets_bf16_decode_at_many_programs(eight_kv_heads) -> None:
    """Model-dtype history decodes in `attend.RAW_MANY_DECODE`'s shape from `RAW_MANY_PROGRAMS`
    (sequence, KV head) programs (B >= 128 at 8 KV heads): decode steps at B=130 and B=100 are served in
    both shapes, and the warm-up (its rounds from B=144 down) compiled each variant they launched."""
    from kvstrata.radix.kernels.attend import RAW_MANY_DECODE, RAW_MANY_PROGRAMS

    assert RAW_MANY_PROGRAMS // 8 <= 130
    model = load_model(eight_kv_heads.path, dtype=torch.bfloat16)  # the shape is for 2-byte models
    with record_variants(execute=False) as warm:
        engine = Engine(
            model=model, attention_backend="triton", kv_cache_dtype="auto", warmup="on",
            max_running_requests=144, page_size=16, max_total_tokens=150_000,
        )  # fmt: skip
    try:
        rng = random.Random(3)
        with record_variants(execute=False) as served:
            for batch in (130, 100):
                prompts = [[rng.randrange(300) for _ in range(300 + i)] for i in range(batch)]
                engine.generate(input_ids=prompts, sampling_params=dict(GREEDY, max_new_tokens=3))
    finally:
        engine.shutdown()
    decodes = [dict(parts) for name, parts in served if name.endswith("_decode_kernel")]
    many = {"BLOCK_N": str(RAW_MANY_DECODE["block_n"]), "HEADS_TOGETHER": "True"}
    assert any(many.items() <= d.items() for d in decodes)
    assert any(d.get("HEADS_TOGETHER") == "False" for d in decodes)
    missing = [name for name, _ in served - warm]
    assert not missing, f"{len(missing)} served variants the warm-up did not compile: {sorted(missing)}"
