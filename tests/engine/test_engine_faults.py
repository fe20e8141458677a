"""Faults inside a step: a failing plan, a failing forward pass, NaN logits.

Each ends exactly the requests it touches with an error response, returns every page and ring slot,
and leaves the engine serving. Results are awaited with a timeout: a request that is never answered
fails the test instead of hanging it.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

import pytest
import torch

import kvstrata.radix.cache as cache_module
from kvstrata.engine.engine import Engine

TIMEOUT_S = 60
POISON = 4242  # a prompt ending in this token id gets NaN logits from the patched model


@pytest.fixture(scope="module")
def engine(default_model):
    eng = Engine(
        model=default_model,
        kv_cache_dtype="auto",
        recent_window=16,
        page_size=16,
        max_total_tokens=512,
        max_running_requests=4,
        chunked_prefill_size=256,
    )
    yield eng
    eng.shutdown()


def generate(engine: Engine, **kwargs: Any) -> Any:
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        return pool.submit(engine.generate, **kwargs).result(timeout=TIMEOUT_S)
    finally:
        pool.shutdown(wait=False)  # an unanswered request must fail the test, not hang it


def assert_clean(engine: Engine) -> None:
    stats = engine.check_invariants()
    assert stats.running == 0
    assert stats.tiers["cold"].used == stats.tiers["cold"].cached  # only the tree holds pages
    assert stats.tiers["ring"].used == 0


def assert_serving(engine: Engine) -> None:
    out = generate(engine, input_ids=list(range(200, 240)), sampling_params={"max_new_tokens": 3})
    assert out["meta_info"]["completion_tokens"] == 3
    assert out["meta_info"]["finish_reason"]["type"] == "length"


def test_a_plan_that_fails_ends_its_requests_with_an_error(engine, monkeypatch):
    real = cache_module.build_step
    calls = {"n": 0}

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:  # the second step: a decode step after the prefill
            raise torch.OutOfMemoryError("injected: out of memory while planning")
        return real(*args, **kwargs)

    errors_before = engine.get_stats().requests_finished_total["error"]
    monkeypatch.setattr(cache_module, "build_step", failing)
    out = generate(
        engine, input_ids=list(range(300, 350)), sampling_params={"max_new_tokens": 8, "ignore_eos": True}
    )
    monkeypatch.setattr(cache_module, "build_step", real)
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "out of memory while planning" in reason["message"]
    assert out["meta_info"]["completion_tokens"] == 1  # the prefill's token, then the failed step
    assert engine.get_stats().requests_finished_total["error"] == errors_before + 1
    assert_clean(engine)
    assert_serving(engine)


def test_a_forward_pass_that_fails_ends_its_requests_and_the_next_ones_are_served(engine):
    net = engine.runner.net
    calls = {"n": 0}

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected: forward failed")
        return net(*args, **kwargs)

    engine.runner.net = failing
    try:
        outs = generate(
            engine,
            input_ids=[list(range(400, 440)), list(range(500, 530))],
            sampling_params={"max_new_tokens": 6, "ignore_eos": True},
        )
    finally:
        engine.runner.net = net
    for out in outs:  # both were in the failing step
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "forward failed" in reason["message"]
    assert_clean(engine)
    assert_serving(engine)


def test_nan_logits_end_only_the_affected_request(engine):
    net = engine.runner.net

    def poisoned(
        input_ids: torch.Tensor, positions: torch.Tensor, attn: Any, logits_at: Any, **kw: Any
    ) -> Any:
        logits = net(input_ids, positions, attn=attn, logits_at=logits_at, **kw)
        bad = input_ids[logits_at] == POISON
        return logits.masked_fill(bad.unsqueeze(1), float("nan"))

    before = engine.get_stats()
    engine.runner.net = poisoned
    try:
        outs = generate(
            engine,
            input_ids=[[*range(600, 630), POISON], list(range(700, 730))],
            sampling_params={"max_new_tokens": 5, "ignore_eos": True, "temperature": 0.7, "seed": 1},
        )
    finally:
        engine.runner.net = net
    bad, good = outs
    reason = bad["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["error"] and "non-finite logits" in reason["message"]
    assert bad["output_ids"] == []
    assert good["meta_info"]["finish_reason"]["type"] == "length"
    assert good["meta_info"]["completion_tokens"] == 5
    after = engine.get_stats()
    assert after.nonfinite_logits_total == before.nonfinite_logits_total + 1
    assert after.requests_finished_total["error"] == before.requests_finished_total["error"] + 1
    assert_clean(engine)
    assert_serving(engine)
