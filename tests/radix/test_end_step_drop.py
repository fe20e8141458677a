"""`end_step(batch, drop=...)`: the dropped sequences end the step as if they had not been in it."""

from __future__ import annotations

import math

import torch
from radix_helpers import TokenKV, small_cache

SCALE = 1 / math.sqrt(8)
DATA = TokenKV(2, 4, 8)


def test_dropped_sequence_keeps_its_length_and_gives_back_the_step_pages() -> None:
    cache = small_cache(num_pages=16)
    kept, dropped = cache.admit(list(range(31))), cache.admit(list(range(100, 131)))
    batch = cache.begin_step([kept, dropped], [30, 30])
    parts = [DATA.span(None, s.token_ids, 0, 30) for s in (kept, dropped)]
    q, k, v = (torch.cat([p[i] for p in parts]) for i in range(3))
    for layer in range(cache.cfg.num_layers):
        cache.attention(layer, batch, q, k, v, SCALE)
    free_before = cache.num_free_pages
    dropped_pages = len(batch.new_pages[1])
    assert dropped_pages > 0
    cache.end_step(batch, drop=[1])
    assert (kept.length, dropped.length) == (30, 0)
    assert dropped.page_ids == [] and not dropped.in_step and not dropped.ring_clobbered
    assert cache.num_free_pages == free_before + dropped_pages
    cache.check_invariants()
    cache.finish(dropped)
    cache.finish(kept)
    assert (
        cache.match_prefix(list(range(31))).tokens == 28
        and cache.match_prefix(list(range(100, 131))).tokens == 0
    )
    cache.check_invariants()
