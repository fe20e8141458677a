"""Continuous batching over the stratified cache: admission, chunked prefill, preemption, abort.

Every step is one varlen forward that mixes the running decodes (one token each) with prefill
chunks (at most ``chunk_size`` tokens in all) of requests that are still reading their prompt,
oldest first, then newly admitted ones. A request is admitted when a ring slot is free
(``cache.admit`` matches its cached prefix, so cached tokens skip prefill) and the step's pages can
be reserved (``cache.begin_step``, which first evicts unlocked tree leaves). When pages run out,
newly admitted requests go back to the queue; when decodes alone cannot grow, the newest running
request is preempted: its sequence ends without inserting anything and it is requeued with its
generated tokens as part of what it must recompute, so it is never corrupted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstrata.engine.request import Request, Status


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
        on_evict: Callable[[Request, dict[str, Any]], None],
    ) -> None:
        self.cache = cache
        self.max_running = max_running
        self.chunk_size = chunk_size
        self.OutOfPages = out_of_pages
        self.OutOfSlots = out_of_slots
        self.on_evict = on_evict  # finishes a request the pool can never hold
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- admission and release ----------------------------------------------------------------
    def _admit(self, req: Request) -> bool:
        try:
            req.seq = self.cache.admit(req.all_ids())
        except self.OutOfSlots:
            return False
        if req.admissions == 0:
            req.cached_tokens = req.seq.length
        req.admissions += 1
        req.status = Status.RUNNING
        self.running.append(req)
        return True

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
        self.release(req, insert=False)
        req.status = Status.WAITING
        self.waiting.appendleft(req)

    def preempt(self, req: Request) -> None:
        req.preemptions += 1
        self.preemptions += 1
        self._requeue(req)

    # --- one step ---------------------------------------------------------------------------
    def _ready(self, req: Request) -> bool:
        leader = req.leader
        return leader is None or leader.prompt_cached or leader.status is Status.FINISHED

    def schedule(self) -> StepPlan | None:
        """Pick this step's tokens and reserve their pages; None when there is nothing to run."""
        while self.running or self.waiting:
            plan = self._reserve(*self._pick())
            if plan is not None:
                return plan
            if len(self.running) > 1:  # decodes cannot grow: the newest running request yields
                self.preempt(self.running[-1])
            elif self.running:  # alone and still no room: the pool cannot hold this sequence
                victim = self.running[0]
                self.on_evict(victim, {"type": "length", "length": len(victim.output_ids), "pool": "full"})
            else:  # nothing runs and the head of the queue does not fit an empty pool
                self.on_evict(
                    self.waiting[0], {"type": "abort", "message": "prompt does not fit the KV pool"}
                )
        return None

    def _pick(self) -> tuple[list[Request], list[tuple[Request, int]], list[Request]]:
        decode = [r for r in self.running if not r.in_prefill]
        budget = self.chunk_size
        chunks: list[tuple[Request, int]] = []
        for r in self.running:
            if r.in_prefill and budget > 0:
                n = min(r.tokens_len - r.computed, budget)
                chunks.append((r, n))
                budget -= n
        admitted: list[Request] = []
        for r in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_running:
                break
            if not self._ready(r):
                continue
            if not self._admit(r):
                break
            self.waiting.remove(r)
            admitted.append(r)
            n = min(r.tokens_len - r.computed, budget)
            chunks.append((r, n))
            budget -= n
        return decode, chunks, admitted

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
