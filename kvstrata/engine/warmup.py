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
   hold, two tokens each: decode alone over long histories, split across programs (the split kernel,
   the merge's larger split blocks). A fresh fp8 server on one H200 still met a 4.1 s compile there
   when only rounds 1 and 2 ran;
4. ``batch``, ``batch / 2``, ... 1 requests at once (and, for FP8 history's wide decode shape, the
   batches at and below its bound) behind 32, 64, 128 ... cold pages of round 3's last prompt, which
   they share (one new token each, two generated): decode split at every batch size class, each
   split count the programs or the history allow (`decode_batches`, `history_tokens`), so each
   merge block. Rounds 1-3 alone missed, on CPU with the launch tables of commit 9426917: the merge
   of 2 splits (B=48 over 1,200 tokens, BF16 and FP8), of 4 (int4) and FP8's wide shape split (B=64
   over 1,536 tokens at 8 KV heads) (`tests/engine/test_warmup_variants.py`).

After every round (the raised pool's and the image rounds below too), the engine compiles the split
merge for every block a step can reach (`merge_splits`, `attend.warm_merges`): which blocks the rounds
meet depends on their batches and histories.

With a raised pool (the drift fallback's), the engine runs the rounds twice, the second time at fallback
level 1 (`Engine._warm_up`). A vision-language model then runs `image_rounds` over one synthetic
image, at fallback level 0: the image in a first page (written with its sink) and behind two cached
pages of text (written without), then batches of ``batch``, ``batch / 2``, ... 1 prompts (``batch`` at
most `IMAGE_WARMUP_BATCH`) sharing that prefix, each with its own tail, four tokens each: an extend
over the cached image pages and decode steps over them at those batch size classes (with an image
pool, its kernel pass and the text pass's split partials). Then the prefix
cache is emptied (pins too) and the engine's request and vision statistics start from zero.
"""

from __future__ import annotations

import random
from collections.abc import Callable
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
# The vision warm-up's largest batch: its prompts each hold the preprocessed image until they end.
IMAGE_WARMUP_BATCH = 64


@dataclass(frozen=True)
class WarmupRound:
    prompts: list[list[int]]
    max_new: list[int]


def warmup_rounds(
    batch: int,
    page_size: int,
    capacity: int,
    context: int,
    vocab: int,
    seed: int = 0,
    kv_heads: int = 1,
) -> list[WarmupRound]:
    """The warm-up's rounds (each submitted at once, the next after it ends), within ``capacity``
    tokens of KV and ``context`` tokens per sequence; ``kv_heads``: the model's (round 4)."""
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
    alone = [n for n in [*(n for n in doubling if n < longest), longest] if n > 0]
    rounds += [WarmupRound([ids(n)], [2]) for n in alone]
    if alone:
        last = rounds[-1].prompts[0]
        rounds += _shared_history_rounds(last, batch, page_size, capacity, kv_heads, ids)
    return [r for r in rounds if r.prompts]


def _shared_history_rounds(
    longest: list[int],
    batch: int,
    page_size: int,
    capacity: int,
    kv_heads: int,
    ids: Callable[[int], list[int]],
) -> list[WarmupRound]:
    """Round 4: decode over histories the batch shares, at every size of `decode_batches` over every
    history of `history_tokens`: ``b`` requests at once behind the first pages of round 3's last
    prompt (the tree holds them as cold pages, so each computes one new token), two tokens each.
    Shared pages cost one prefill; each request adds a page of its own (the pool's room bounds the
    history)."""
    room = capacity - batch * 2 * page_size  # each request's partial page and new tokens
    whole = min(len(longest), room) // page_size * page_size
    return [
        WarmupRound([[*longest[:n], *ids(1)] for _ in range(b)], [2] * b)
        for j, n in enumerate(history_tokens(page_size))
        if n <= whole
        for b in decode_batches(batch, kv_heads)
        if j == 0 or most_splits(b, kv_heads) > 2**j
    ]


def most_splits(batch: int, kv_heads: int) -> int:
    """The most splits a decode of ``batch`` sequences takes over any history: the decode launches'
    largest programs target (`memory.split_target_programs`) over its programs, one more for the tail.
    Round 4 skips the histories whose bound on the split count (``2**(j + 1)``) is past the one before
    it and this: such a batch splits there as over the shorter history."""
    from kvstrata.engine.memory import split_target_programs

    return -(-split_target_programs() // (batch * kv_heads)) + 1


def merge_splits(kv_heads: int, max_pages: int, passes: int) -> int:
    """The most split partials one decode step merges: each of its ``passes`` kernel passes (the text
    pool's, and the image or raised pool's where the engine has one) split as far as a single sequence
    allows (`most_splits`, its tail split included) over ``max_pages`` cold pages in splits of at least
    the fewest pages a split reads (`fewest_split_pages`)."""
    return passes * (min(most_splits(1, kv_heads) - 1, max(1, max_pages // fewest_split_pages())) + 1)


def decode_batches(batch: int, kv_heads: int) -> list[int]:
    """Round 4's batch sizes. A decode step's split count is ``min(cdiv(target, programs), cold pages
    // least)`` (`attend._num_splits`; programs: sequences x KV heads; least: `attend.split_floor`),
    one more for the tail where the programs allow, and the merge compiles one variant per
    power-of-two split block: as the batch halves, the programs' bound doubles. FP8 history decodes
    in a shape of its own (one warp, 32-key tiles, another target) from ``FP8_WIDE_PROGRAMS``
    programs once split (`attend.takes_wide_decode`; smaller batches over longer histories too): the
    batches at and just below that bound unsplit join the halvings."""
    from kvstrata.radix.kernels.attend import FP8_WIDE_PROGRAMS

    wide = -(-FP8_WIDE_PROGRAMS // kv_heads)
    halvings = {max(1, batch >> k) for k in range(batch.bit_length())}
    return sorted({b for b in (*halvings, wide - 1, wide) if 1 <= b <= batch}, reverse=True)


def history_tokens(page_size: int) -> list[int]:
    """Round 4's shared histories: whole pages, ``2**j * 2 * least`` of them cold (the fewest pages a
    decode split reads, `fewest_split_pages`) and one more (the request's ring), so the
    history's bound on the split count is each power of two from 2 on."""
    least = fewest_split_pages()
    return [(least * 2 ** (j + 1) + 1) * page_size for j in range(32)]


def fewest_split_pages() -> int:
    """The fewest cold pages a decode split reads under any launch table entry (``min_pages``, or
    ``fill_pages`` where a launch of few programs splits further: `attend.split_floor`)."""
    from kvstrata.radix.kernels.attend import DECODE_LAUNCH

    return min(
        min(launch["min_pages"], launch.get("fill_pages", launch["min_pages"]))
        for launch in DECODE_LAUNCH.values()
    )


def image_rounds(
    batch: int, page_size: int, room: int, vocab: int, image_token: int, image_tokens: int, seed: int = 0
) -> tuple[list[list[int]], list[list[list[int]]]]:
    """The vision warm-up's prompts, run in order: first three single prompts, (1) the image token
    near the start (its first page an image page, written with the step's sink page), (2) two pages of
    text, then (3) those two pages, the image token and three tokens: the image's pages complete in a
    step behind a cached prefix, so with no sink page; then, per batch size ``batch``, ``batch / 2``,
    ... 1, that many prompts sharing (3) up to its image, each with a tail of its own (1 to 2 pages).
    ``image_tokens``: the prompt positions the image takes; ``room``: tokens one prompt and its output
    may hold. Empty when the third prompt and a tail do not fit."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            t = rng.randrange(vocab)
            if t != image_token:
                out.append(t)
        return out

    text = ids(2 * page_size)
    head = [*text, image_token]
    if len(head) + image_tokens + 2 * page_size + 8 > room:
        return [], []
    singles = [[*ids(2), image_token, *ids(5)], text, [*head, *ids(3)]]
    sizes = sorted({max(1, batch >> k) for k in range(batch.bit_length())}, reverse=True)
    rounds = [[[*head, *ids(1 + (i * 7 + b) % (2 * page_size))] for i in range(b)] for b in sizes]
    return singles, rounds
