"""A warm-up workload run once when the engine starts (``warmup``: `kvstrata serve` runs it on CUDA,
SGLang's server warm-up), so the first requests served do not wait for Triton to compile kernels.

The attention kernels compile one variant per set of constexprs (`kvstrata/radix/kernels/jit.py`):
split or not, the merge's split block, the extend kernel's query block (new tokens x query heads per
KV head), sinks. Which ones a step needs depends on its batch, its new tokens per sequence and the
history behind them, so a served run met them one by one: on one H200 a fresh server's step timeline
(``KVSTRATA_STEP_TRACE``) showed a 16-token prefill behind a cached prefix taking 2.7 s, the first
prefill chunk continuing a prompt 2.3 s and the first decode step at B=256 1.9 s, all inside the
measured run. The warm-up meets the same shapes through the engine itself, with random prompts:

1. ``batch`` prompts of 2 to 25 pages (plus part of a page), packed into prefill steps (prompts
   continued across chunks among them), generating 1 to 8 tokens each: decode steps from
   B = ``batch`` down to ``batch / 8``;
2. prompts that extend a cached one's whole pages by 2 ... 300 tokens (prefill over history, every
   query block, token counts on and off multiples of 16: ``EXTEND_TOKENS``),
   then decode at B = 8 down to 1 over short histories (one split);
3. one request at a time over 32, 64, 128 ... pages and the longest context the pool and the model
   hold, two tokens each: decode alone over long histories, split across programs (the split kernel
   and each power-of-two split count of the merge). A fresh fp8 server on one H200 still met a 4.1 s
   compile there when only rounds 1 and 2 ran.

Then the prefix cache is emptied and the engine's request statistics start from zero.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# New tokens behind a cached prefix: every query block of the extend kernel (new tokens x query heads
# per KV head, rounded up to 16, 32, 64 or 128 rows) for 1 to 16 query heads per KV head, and token
# counts on and off multiples of 16. They extend the last prompt of round 1 cut to whole pages, the
# prefix the tree holds, so each step computes exactly these counts: extending the whole prompt (17
# pages and 15 tokens at B=256) computed 15 more each, so no extend ran with fewer than 17 tokens, and
# a served fp8 run on one H200 compiled for 3.7 s on its first 16-token extend (1,520 cached tokens of
# a 1,536-token prompt).
EXTEND_TOKENS = (2, 3, 5, 9, 16, 17, 32, 33, 65, 129, 300)
MIN_SPLIT_PAGES = 32  # the shortest history whose decode splits (kvstrata/radix/kernels/attend.py)


@dataclass(frozen=True)
class WarmupRound:
    prompts: list[list[int]]
    max_new: list[int]


def warmup_rounds(
    batch: int, page_size: int, capacity: int, context: int, vocab: int, seed: int = 0
) -> list[WarmupRound]:
    """The warm-up's rounds (each submitted at once, the next after it ends), within ``capacity``
    tokens of KV and ``context`` tokens per sequence."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    limit = min(capacity, context) - 16  # per sequence: prompt + output below the context and pool
    if limit < 1:
        return []  # no prompt fits with its output: nothing to warm up
    lengths = [min(limit, page_size * (2 + i % 24) + i % page_size) for i in range(batch)]
    while sum(lengths) + 8 * batch > capacity and len(lengths) > 1:
        lengths.pop()
    first = WarmupRound([ids(n) for n in lengths], [1 + i % 8 for i in range(len(lengths))])
    base = first.prompts[-1][: len(first.prompts[-1]) // page_size * page_size]  # the cached pages
    extended = [base + ids(t) for t in EXTEND_TOKENS if len(base) + t + 8 <= limit]
    rounds = [first, WarmupRound(extended, [1 + i for i in range(len(extended))])]
    # alone over long histories (round 2's cached prompts stay in the pool, evictable)
    longest = limit - 4
    doubling = [page_size * MIN_SPLIT_PAGES * 2**k for k in range(32)]
    rounds += [WarmupRound([ids(n)], [2]) for n in [*(n for n in doubling if n < longest), longest] if n > 0]
    return [r for r in rounds if r.prompts]
