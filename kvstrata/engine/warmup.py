"""A warm-up workload run once when the engine starts on CUDA (SGLang's server warm-up; off with
``skip_warmup``), so the first requests served do not wait for Triton to compile kernel variants.

The attention kernels compile one variant per set of constexprs (`kvstrata/radix/kernels/jit.py`):
split or not, the merge's split block, the extend kernel's query block (new tokens x query heads per
KV head), sinks. Which ones a step needs depends on its batch, its new tokens per sequence and the
history behind them, so a served run met them one by one: on one H200 a fresh server's step timeline
(``KVSTRATA_STEP_TRACE``) showed a 16-token prefill behind a cached prefix taking 2.7 s, the first
prefill chunk continuing a prompt 2.3 s and the first decode step at B=256 1.9 s, all inside the
measured run. The warm-up meets the same shapes through the engine itself, with random prompts:

1. ``batch`` prompts of 2 to 25 pages (plus part of a page), packed into prefill steps, generating 1 to
   8 tokens each: decode steps from B = ``batch`` down to ``batch / 8``;
2. prompts that extend a cached one by 2 ... 300 tokens (prefill over history, every query block),
   then decode at B = 8 down to 1 (split decode, over short and long histories);
3. one prompt longer than a prefill chunk (a chunk continued over its own history), when the pool
   and the context hold it.

Then the prefix cache is emptied and the engine's request statistics start from zero.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

EXTEND_TOKENS = (2, 5, 9, 17, 33, 65, 129, 300)  # new tokens behind a cached prefix, one query block each


@dataclass(frozen=True)
class WarmupRound:
    prompts: list[list[int]]
    max_new: list[int]


def warmup_rounds(
    batch: int, page_size: int, chunk: int, capacity: int, context: int, vocab: int, seed: int = 0
) -> list[WarmupRound]:
    """The warm-up's rounds (each submitted at once, the next after it ends), within ``capacity``
    tokens of KV and ``context`` tokens per sequence."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    limit = min(capacity, context) - 16  # per sequence: prompt + output below the context and pool
    lengths = [min(limit, page_size * (2 + i % 24) + i % page_size) for i in range(batch)]
    while sum(lengths) + 8 * batch > capacity and len(lengths) > 1:
        lengths.pop()
    first = WarmupRound([ids(n) for n in lengths], [1 + i % 8 for i in range(len(lengths))])
    base = first.prompts[-1]
    extended = [base + ids(t) for t in EXTEND_TOKENS if len(base) + t + 8 <= limit]
    rounds = [first, WarmupRound(extended, [1 + i for i in range(len(extended))])]
    long = chunk + 3 * page_size
    if long + 2 <= limit and long + 2 + len(base) + max(EXTEND_TOKENS) <= capacity:
        rounds.append(WarmupRound([ids(long)], [2]))
    return [r for r in rounds if r.prompts]
