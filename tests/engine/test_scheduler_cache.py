"""The scheduler over a real (small) cache, with the model replaced by random K/V: what preemption
keeps, what admission reserves and what a request's cached tokens count."""

from __future__ import annotations

import torch

from kvstrata.engine.request import Request
from kvstrata.engine.sampling_params import SamplingParams
from kvstrata.engine.scheduler import Scheduler
from kvstrata.radix import CacheConfig, OutOfPages, OutOfSlots, StratifiedKVCache

P, LAYERS, H, D = 16, 2, 2, 8


def make(num_pages: int, max_running: int = 4) -> tuple[StratifiedKVCache, Scheduler, list]:
    cache = StratifiedKVCache(
        CacheConfig(
            num_layers=LAYERS,
            kv_heads=H,
            head_dim=D,
            page_size=P,
            recent_window=16,
            layer_codecs=["fp32"] * LAYERS,
            ring_dtype=torch.float32,
            num_pages=num_pages,
            max_running=max_running,
        )
    )
    ended: list = []
    sched = Scheduler(cache, max_running, 512, OutOfPages, OutOfSlots, lambda r, why: ended.append((r, why)))
    return cache, sched, ended


def request(rid: str, prompt: list[int], max_new: int) -> Request:
    return Request(rid, prompt, SamplingParams(max_new_tokens=max_new), None, frozenset(), vocab=1000)


def run(cache: StratifiedKVCache, sched: Scheduler) -> list[Request]:
    """One step: random K/V through every layer; every request that reached its end gets token 7."""
    plan = sched.schedule()
    assert plan is not None
    T = plan.batch.num_tokens
    for layer in range(LAYERS):
        q, k, v = torch.randn(T, H, D), torch.randn(T, H, D), torch.randn(T, H, D)
        cache.attention(layer, plan.batch, q, k, v, D**-0.5)
    cache.end_step(plan.batch)
    sampled = [r for r in plan.reqs if r.computed == r.tokens_len]
    for r in sampled:
        r.append(7, 0.0)
    cache.check_invariants()
    return plan.reqs


def test_a_preempted_request_keeps_its_full_pages_and_reads_them_back() -> None:
    cache, sched, _ = make(num_pages=32)
    req = request("a", list(range(100, 139)), max_new=10)  # 39 tokens
    sched.add(req)
    run(cache, sched)  # prefill: 39 tokens have K/V, 2 full pages; one token sampled
    assert req.cached_tokens == 0 and req.tokens_len == 40
    sched.preempt(req)
    assert cache.tree.total_pages == 2  # its full pages went into the tree, not back to the pool
    assert sched.new_token_ratio == 0.7  # a preemption: the reserve goes back to its initial ratio
    cache.check_invariants()
    reqs = run(cache, sched)  # re-admitted: matches its own 32 tokens, recomputes the other 8
    assert reqs == [req] and req.seq.cached_tokens == 32 and req.computed == 40
    assert req.cached_tokens == 0  # what its first step reused: a re-admission does not change it
    assert req.preemptions == 1


def test_admission_reserves_pages_for_the_running_requests_output() -> None:
    """10 pages; each request: a 15-token prompt and 120 tokens to generate (8 full pages in the
    end). The first one is expected to write 15 + 0.7 * 120 = 99 tokens, so a second one waits
    instead of being admitted, prefilled and preempted; as the ratio decays (no preemption) two run
    together, and one preemption puts it back to 0.7. Measured without the reserve: 5 preemptions
    and 50 pages quantized for these 32 pages of output; with it: 1 and 37."""
    cache, sched, ended = make(num_pages=10)
    reqs = [request(f"r{i}", list(range(200 + 20 * i, 215 + 20 * i)), max_new=120) for i in range(4)]
    for r in reqs:
        sched.add(r)
    steps = 0
    while sched.has_work() and steps < 2000:
        run(cache, sched)
        steps += 1
        for r in list(sched.running):
            if len(r.output_ids) >= 120:
                sched.release(r, insert=True)
                r.status = r.status.FINISHED
    assert not sched.has_work() and not ended
    assert all(len(r.output_ids) == 120 for r in reqs)
    assert sum(r.preemptions for r in reqs) <= 1
    assert cache.quantized_pages <= 4 * 8 + 5  # recomputed pages: at most one preemption's worth
