"""Continuous batching over the stratified cache: admission, chunked prefill, preemption, abort.

A step is one varlen forward. Prefill chunks (at most ``chunk_size`` tokens in all) go to requests
still reading their prompt, oldest first, then to newly admitted ones. By default (SGLang's, whose
``--enable-mixed-chunk`` opts in to mixing) a step that has prefill chunks runs them alone: the
running decodes wait until no prompt token can be scheduled, then run as a decode-only step (the
batch the CUDA graphs capture). With ``mixed_chunk`` every step carries the running decodes (one
token each) beside the chunks. A request is admitted when a ring slot is free
(``cache.admit`` matches its cached prefix, so cached tokens skip prefill), when the pages that are
free or evictable cover what it and the running requests will still write (the reserve below), and
when the step's pages can be taken (``cache.begin_step``, which first evicts unlocked tree leaves).

Reserve (SGLang's ``new_token_ratio``): a running request is expected to write its unread prompt
plus ``new_token_ratio`` of its remaining ``max_new_tokens``. The ratio starts at 0.7, decays
towards 0.1 with every step that needs no preemption and goes back to 0.7 on a preemption, so a
full pool stops admitting requests it would only preempt again.

When pages still run out, newly admitted requests go back to the queue; when decodes alone cannot
grow, the newest running request is preempted: its full pages go into the prefix tree (they are
immutable and correct) and it is requeued; re-admission matches them like any cached prefix, so it
recomputes only what was evicted meanwhile plus its last partial page, and it is never corrupted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstrata.engine.request import Request, Status

INIT_NEW_TOKEN_RATIO = 0.7  # SGLang's defaults: 0.7, decaying to 0.7 * 0.14 over 600 steps
MIN_NEW_TOKEN_RATIO = 0.098
NEW_TOKEN_RATIO_DECAY = (INIT_NEW_TOKEN_RATIO - MIN_NEW_TOKEN_RATIO) / 600


@dataclass
class StepPlan:
    reqs: list[Request]
    n_new: list[int]
    batch: Any  # what cache.begin_step returned


class Scheduler:
    def __init__(
        self,
        cache: Any,
        max_running: int,
        chunk_size: int,
        out_of_pages: type[Exception],
        out_of_slots: type[Exception],
        end_request: Callable[[Request, dict[str, Any]], None],
        mixed_chunk: bool = False,
        defer_fill: float = 0.75,
    ) -> None:
        self.cache = cache
        self.defer_fill = defer_fill  # see `_waits_whole`; 1: prompts are always cut, as SGLang
        self.mixed_chunk = mixed_chunk  # decodes ride along in prefill steps
        self.max_running = max_running
        self.chunk_size = chunk_size
        self.OutOfPages = out_of_pages
        self.OutOfSlots = out_of_slots
        self.end_request = end_request  # finishes a request the pool can never hold
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- admission and release ----------------------------------------------------------------
    def _admit(self, req: Request, reserved: float) -> bool:
        """Admit ``req`` when a slot is free and the pool covers ``reserved`` (what the running
        requests will still write) plus its own future tokens; a lone request is always admitted."""
        try:
            req.seq = self.cache.admit(req.all_ids())
        except self.OutOfSlots:
            return False
        if self.running and reserved + self.future_tokens(req) > self.available_tokens():
            self.cache.finish(req.seq, insert=False)  # nothing computed: nothing to keep
            req.seq = None
            return False
        req.status = Status.RUNNING
        self.running.append(req)
        return True

    def _withdraw(self, req: Request) -> None:
        """Undo an admission in the same step: nothing was computed, so nothing is kept. ``req`` is still
        in the waiting queue (marked running, so `release` leaves it there) and waits again."""
        self.release(req, insert=False)
        req.status = Status.WAITING

    def future_tokens(self, req: Request) -> float:
        """Tokens ``req`` is expected to add to the cold pool: those not yet in a full page (its
        unread prompt, and computed tokens still waiting in the ring for their page to complete)
        and ``new_token_ratio`` of its remaining output (capped by the pool)."""
        P = self.cache.page_size
        written = len(req.output_ids) + req.pending
        left = min(req.params.max_new_tokens - written, self.cache.num_pages * P)
        return req.tokens_len - req.computed // P * P + left * self.new_token_ratio

    def available_tokens(self) -> int:
        """Tokens the pool can still take: free pages and pages the tree may evict."""
        return (self.cache.num_free_pages + self.cache.num_evictable_pages) * self.cache.page_size

    def release(self, req: Request, insert: bool) -> None:
        """End the request's cache sequence (if admitted) and take it out of the queues."""
        if req.seq is not None:
            self.cache.finish(req.seq, insert=insert)
            req.seq = None
        if req in self.running:
            self.running.remove(req)
        if req.status is Status.WAITING and req in self.waiting:
            self.waiting.remove(req)

    def _requeue(self, req: Request) -> None:
        self.release(req, insert=True)  # its full pages stay in the tree for its re-admission
        req.status = Status.WAITING
        self.waiting.appendleft(req)

    def preempt(self, req: Request) -> None:
        req.preemptions += 1
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self._requeue(req)

    # --- one step ---------------------------------------------------------------------------
    def _ready(self, req: Request) -> bool:
        if req.pending:  # preempted with its last token still on the device: admitted once it lands
            return False
        leader = req.leader
        return leader is None or leader.prompt_cached or leader.status is Status.FINISHED

    def schedule(self) -> StepPlan | None:
        """Pick this step's tokens and reserve their pages; None when there is nothing to run."""
        while self.running or self.waiting:
            plan = self._plan()
            if plan is not None:
                self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
                for req in plan.reqs:
                    if not req.started:  # its first step: what it reuses now is what it reused
                        req.started = True
                        req.cached_tokens = req.seq.cached_tokens
                return plan
            if len(self.running) > 1:  # decodes cannot grow: the newest running request yields
                self.preempt(self.running[-1])
            elif self.running:  # alone and still no room: the pool cannot hold this sequence
                victim = self.running[0]
                self.end_request(victim, {"type": "length", "length": len(victim.output_ids), "pool": "full"})
            elif self.waiting[0].pending:  # preempted while its token was in flight: wait for it
                return None
            else:  # nothing runs and the head of the queue does not fit an empty pool
                self.end_request(
                    self.waiting[0], {"type": "abort", "message": "prompt does not fit the KV pool"}
                )
        return None

    def _plan(self) -> StepPlan | None:
        """The step's plan: prefill chunks alone when there are any (unless ``mixed_chunk``); when
        none of their pages can be found, the decodes alone; None when the decodes cannot grow."""
        decode, chunks, admitted = self._pick()
        if self.mixed_chunk or not chunks:
            return self._reserve(decode, chunks, admitted)
        plan = self._reserve([], chunks, admitted)
        return plan if plan is not None else self._reserve(decode, [], [])

    def _pick(self) -> tuple[list[Request], list[tuple[Request, int]], list[Request]]:
        decode: list[Request] = []
        budget = self.chunk_size
        chunks: list[tuple[Request, int]] = []
        for r in self.running:
            if not r.in_prefill:
                decode.append(r)
            elif budget > 0:
                n = min(r.tokens_len - r.computed, budget)
                chunks.append((r, n))
                budget -= n
        admitted: list[Request] = []
        if not self.waiting or budget <= 0 or len(self.running) >= self.max_running:
            return decode, chunks, admitted  # nothing to admit: no reservation to sum (decode at B=256)
        reserved = sum(self.future_tokens(r) for r in self.running)
        for r in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_running:
                break
            if not self._ready(r):
                continue
            if not self._admit(r, reserved):
                break
            if self._waits_whole(r, budget):
                self._withdraw(r)
                break
            reserved += self.future_tokens(r)
            self.waiting.remove(r)
            admitted.append(r)
            n = min(r.tokens_len - r.computed, budget)
            chunks.append((r, n))
            budget -= n
        return decode, chunks, admitted

    def _waits_whole(self, req: Request, budget: int) -> bool:
        """Whether a newly admitted ``req``, of whose prompt ``budget`` tokens would fit this step, waits
        for the next step instead of being cut: nothing of it is cached or computed, its prompt fits one
        step whole, and this step already holds at least ``defer_fill`` of the chunk. A cut prompt's tail
        would read its head back from the cache as history (the extend kernel, not the prompt-only path)
        and split the step's attention in two groups; a prompt with a cached prefix or computed tokens
        takes the extend kernel anyway, so it is cut as before."""
        left = req.tokens_len - req.computed
        held = self.chunk_size - budget
        fresh = req.computed == 0
        return fresh and budget < left <= self.chunk_size and held >= self.defer_fill * self.chunk_size

    def _reserve(
        self, decode: list[Request], chunks: list[tuple[Request, int]], admitted: list[Request]
    ) -> StepPlan | None:
        """begin_step on the largest prefix of the pick that fits: drop admissions, then prefills."""
        while True:
            reqs = decode + [r for r, _ in chunks]
            if not reqs:
                return None
            n_new = [1] * len(decode) + [n for _, n in chunks]
            try:
                return StepPlan(reqs, n_new, self.cache.begin_step([r.seq for r in reqs], n_new))
            except self.OutOfPages:
                pass
            if admitted:
                r = admitted.pop()
                chunks = [(c, n) for c, n in chunks if c is not r]
                self._requeue(r)
            elif chunks:
                chunks.pop()
            else:
                return None

    def find(self, rid: str) -> list[Request]:
        return [r for r in (*self.running, *self.waiting) if r.rid == rid or r.group == rid]
