"""Image pages in a pool of their own (``--vision-kv-dtype``): attention reads each page in its pool's
codec (equal to a dense reference built from codec round trips), bytes per tier are exact, pins count
image pages at their own size, and eviction makes room in the pool that is short."""

from __future__ import annotations

import pytest
import torch
from radix_helpers import TokenKV, dense_attention, roundtrip, run_step, small_cache

from kvstrata.radix import OutOfPages, PinBudgetExceeded
from kvstrata.radix.pool import KEY_GRANULARITY, VALUE_GRANULARITY

DATA = TokenKV(kv_heads=2, q_heads=4, head_dim=8)
SCALE = 8**-0.5
IMAGE = 1000  # token ids from here on are image tokens (pad ids past the vocabulary)
P = 4


def image_cache(image_codec: str = "bf16", **overrides: object):
    params: dict[str, object] = dict(
        layer_codecs=["int4", "int4"],
        image_codec=image_codec,
        image_pages=8,
        image_token_from=IMAGE,
    )
    params.update(overrides)
    return small_cache(**params)


def reference(seq, n: int, text_codec: str, image_codec: str) -> torch.Tensor:
    """Dense attention of ``seq``'s next ``n`` tokens over K/V whose cold pages (before the ring) went
    through the codec of their pool: ``image_codec`` when the page holds an image token."""
    L, stop = seq.length, seq.length + n
    q, k, v = DATA.span(seq.extra_key, seq.token_ids, 0, stop)
    k, v = k.clone(), v.clone()
    for j in range(seq.ring_start // P):
        codec = image_codec if max(seq.token_ids[j * P : (j + 1) * P]) >= IMAGE else text_codec
        rows = slice(j * P, (j + 1) * P)
        k[rows] = roundtrip(codec, k[rows], KEY_GRANULARITY)
        v[rows] = roundtrip(codec, v[rows], VALUE_GRANULARITY)
    return dense_attention(q[L:stop], k, v, L, SCALE)


def step_and_compare(cache, seqs, n_new, image_codec: str, tol: float = 1e-5) -> float:
    """One step; each sequence's output equals the reference; returns the largest distance from the
    reference that would store image pages in the text codec (int4)."""
    refs = [reference(s, n, "int4", image_codec) for s, n in zip(seqs, n_new, strict=True)]
    as_text = [reference(s, n, "int4", "int4") for s, n in zip(seqs, n_new, strict=True)]
    outs = run_step(cache, seqs, n_new, DATA, SCALE)
    gap, row = 0.0, 0
    for ref, text_ref, n in zip(refs, as_text, n_new, strict=True):
        for out in outs:
            got = out[row : row + n].double()
            torch.testing.assert_close(got, ref, atol=tol, rtol=0)
            gap = max(gap, float((got - text_ref).abs().max()))
        row += n
    cache.check_invariants()
    return gap


def image_prompt(
    text_before: int, image_tokens: int, text_after: int, image_id: int = IMAGE + 7
) -> list[int]:
    return [*range(1, 1 + text_before), *[image_id] * image_tokens, *range(50, 50 + text_after)]


@pytest.mark.parametrize("image_codec", ["fp32", "bf16"])
@pytest.mark.parametrize("block_pages", [64, 1])
def test_image_pages_read_in_their_codec(image_codec: str, block_pages: int):
    cache = image_cache(image_codec, block_pages=block_pages)
    tokens = image_prompt(3, 8, 13)  # pages 0-2 hold image tokens, 3-5 are text
    seq = cache.admit(tokens)
    gaps = []
    for n in (5, 7, 6, 1, 1, 1, 1, 1, 1):  # chunked prefill then decode: pages complete in several steps
        gaps.append(step_and_compare(cache, [seq], [n], image_codec))
    assert [cache.is_image_page(p) for p in seq.page_ids] == [True, True, True, False, False, False]
    assert max(gaps) > 1e-3  # int4 image pages would have given another answer
    cache.finish(seq)
    # the image prefix from the tree, next to a text-only prompt in the same step (two groups)
    again = cache.admit([*tokens[:16], 77, 78, 79, 80])
    other = cache.admit(list(range(200, 215)))
    assert again.cached_tokens == 16
    step_and_compare(cache, [again, other], [3, 14], image_codec)
    step_and_compare(cache, [again, other], [1, 1], image_codec)  # both cross into their ring / cold
    for s in (again, other):
        cache.finish(s)
    cache.check_invariants()


def test_image_tier_bytes_and_pins_count_image_pages_at_their_size():
    cache = image_cache("bf16", num_pages=16, layer_codecs=["fp8_e4m3", "fp8_e4m3"], pin_budget_bytes=10**6)
    text_bytes, image_bytes = cache.pool.page_bytes, cache.image_pool.page_bytes
    assert image_bytes == 2 * 2 * P * 2 * 8 * 2  # layers x (K, V) x page x heads x dim x bf16
    assert text_bytes == 276  # per layer: fp8 codes of K and V (2 x 64 B) + exponents (K: 2 per page, V: 8)
    tokens = image_prompt(3, 8, 10)  # 3 image pages, then 2 text pages (21 tokens)
    seq = cache.admit(tokens)
    run_step(cache, [seq], [len(tokens)], DATA, SCALE)
    cache.finish(seq)
    cache.check_invariants()
    tiers = cache.stats().tiers
    image, cold = tiers["image"], tiers["cold"]
    assert (image.total, image.used, image.cached, image.unit_bytes) == (8, 3, 3, image_bytes)
    assert (cold.total, cold.used, cold.cached) == (16, 2, 2)
    assert image.bytes("total") == sum(
        t[: cache.image_pool.null_page].nbytes
        for b in (*cache.image_pool.k, *cache.image_pool.v)
        for t in b.values()
    )
    assert image.bytes_per_token == image_bytes / P
    pin = cache.pins.pin(tokens[:20], kind="image")  # 3 image pages + 2 text pages
    assert cache.pinned_bytes == 3 * image_bytes + 2 * text_bytes
    assert cache.pins.to_json()[0]["bytes"] == 3 * image_bytes + 2 * text_bytes
    tiers = cache.stats().tiers
    assert (tiers["image"].pinned, tiers["cold"].pinned) == (3, 2)
    assert cache.stats().pinned_pages == 5 and cache.stats().pinned_bytes == cache.pinned_bytes
    cache.pins.unpin(pin.pin_id)
    # the budget is counted in bytes: 2 image pages fit, 3 do not
    cache.pin_budget_bytes = 2 * image_bytes + text_bytes
    with pytest.raises(PinBudgetExceeded, match=f"pinning {3 * image_bytes} more bytes"):
        cache.pins.pin(tokens[:12])
    assert cache.pins.pin(tokens[:8]).tokens == 8 and cache.pinned_bytes == 2 * image_bytes
    cache.check_invariants()


def test_image_pool_evicts_its_own_leaves_and_refuses_when_pinned():
    cache = image_cache("bf16", image_pages=4, num_pages=32, pin_budget_bytes=10**6)  # not about budgets

    def prefill(tokens: list[int]):
        seq = cache.admit(tokens)
        run_step(cache, [seq], [len(tokens)], DATA, SCALE)
        cache.finish(seq)
        cache.check_invariants()

    a, b, c = (image_prompt(0, 8, 5, IMAGE + i) for i in (1, 2, 3))  # 2 image pages + 1 text page each
    prefill(a)
    prefill(b)
    assert cache.image_pool.allocator.num_free == 0
    prefill(c)  # evicts a's leaf, the least recently used (its 2 image pages and its text page)
    assert cache.match_prefix(a).tokens == 0 and cache.match_prefix(b).tokens == 12
    assert cache.evicted_pages == 3 and cache.stats().tiers["cold"].cached == 2
    cache.pins.pin(b[:8])
    cache.pins.pin(c[:8])
    free = (cache.pool.allocator.num_free, cache.image_pool.allocator.num_free, cache.tree.total_pages)
    seq = cache.admit(a)
    with pytest.raises(OutOfPages, match="need 2 image pages: 0 free, 0 evictable, 4 locked or pinned"):
        cache.begin_step([seq], [len(a)])
    assert (
        cache.pool.allocator.num_free,
        cache.image_pool.allocator.num_free,
        cache.tree.total_pages,
    ) == free
    cache.check_invariants()
    text = list(range(300, 340))  # text pages never touch the image pool
    cache.finish(seq, insert=False)
    prefill(text)
    assert cache.match_prefix(b).tokens == 12 and cache.match_prefix(c).tokens == 12
