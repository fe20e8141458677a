"""One request's state: tokens, sampling state, text, stop checks, timings, outputs."""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import Enum
from typing import Any

import torch

from kvstrata.engine.detokenizer import IncrementalDetokenizer, find_stop, stop_holdback
from kvstrata.engine.sampler import PenaltyState, SampleRow
from kvstrata.engine.sampling_params import SamplingParams


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """A sequence to generate. ``tokens`` = prompt + output; the cache holds K/V of a prefix of it."""

    def __init__(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        tokenizer: Any,
        eos_ids: frozenset[int],
        vocab: int,
        sink: Callable[[dict[str, Any]], None] | None = None,
        stream: bool = False,
        group: str | None = None,
        seed: int | None = None,
        leader: Request | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.rid = rid
        self.group = group or rid
        self.prompt_ids = prompt_ids
        self.params = params
        self.output_ids: list[int] = []
        # Overlap scheduling: the last sampled token is still on the device only (it is the input of
        # the step in flight); ``seq.token_ids`` holds a placeholder at its position until it lands.
        self.pending = False
        self.status = Status.WAITING
        self.seq: Any = None  # the cache's sequence while admitted
        self.mm: Any = None  # images: a kvstrata.multimodal MultimodalInput (feature rows, pins)
        self.leader = leader  # n > 1: siblings wait until the leader's prompt is in the tree
        self.prompt_cached = leader is None and params.n == 1
        self.sink = sink
        self.stream = stream
        self.stop_tokens = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_ids)
        self.generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
        self.penalties = PenaltyState(vocab, prompt_ids, device) if params.needs_penalties else None
        self.row = SampleRow(params, self.generator, self.penalties)
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
        self.sent_text = 0  # characters already streamed
        self.sent_ids = 0
        self.started = False  # has been in a step (admissions rolled back before one do not count)
        self.cached_tokens = 0  # prompt tokens its first step read from the prefix cache
        self.preemptions = 0
        self.finish_reason: dict[str, Any] | None = None
        self.token_logprobs: list[tuple[float, int]] = []
        self.top_logprobs: list[list[tuple[float, int]]] = []
        self.drift_logprobs: list[torch.Tensor] | None = None  # raw log-softmax rows, sampled requests
        self.created = time.perf_counter()
        self.first_token_at: float | None = None
        self.token_times: list[float] = []
        self.finished_at: float | None = None

    # --- tokens -----------------------------------------------------------------------------
    @property
    def tokens_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + self.pending

    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def computed(self) -> int:
        return self.seq.length if self.seq is not None else 0

    @property
    def in_prefill(self) -> bool:
        return self.tokens_len - self.computed > 1

    # --- appending a sampled token --------------------------------------------------------------
    def await_token(self) -> None:
        """Its sampled token stays on the device for now: the cache sees a placeholder (0) in its
        place, so the next step can be planned; `append` puts the token there."""
        self.pending = True
        if self.seq is not None:
            self.seq.token_ids.append(0)

    def append(self, token: int, now: float) -> None:
        """Record a sampled token; sets finish_reason when it ends the request."""
        self.output_ids.append(token)
        if self.seq is not None and self.pending:
            self.seq.token_ids[len(self.prompt_ids) + len(self.output_ids) - 1] = token
        elif self.seq is not None:
            self.seq.token_ids.append(token)
        self.pending = False
        if self.penalties is not None:
            self.penalties.add(token)
        if self.first_token_at is None:
            self.first_token_at = now
        self.token_times.append(now)
        if token in self.stop_tokens:
            self.finish_reason = {"type": "stop", "matched": token}
            return
        before = len(self.detok.text)
        self.detok.add([token])
        if self.params.stop:
            hit = find_stop(self.detok.text, self.params.stop, before)
            if hit is not None:
                self.detok.text = self.detok.text[: hit[0]]
                self.finish_reason = {"type": "stop", "matched": hit[1]}
                return
        if len(self.output_ids) >= self.params.max_new_tokens:
            self.finish_reason = {"type": "length", "length": self.params.max_new_tokens}

    def finish(self, reason: dict[str, Any], now: float) -> None:
        if self.finish_reason is None or reason.get("type") == "abort":
            self.finish_reason = reason
        if self.finish_reason.get("type") != "stop" or not isinstance(self.finish_reason.get("matched"), str):
            self.detok.flush()  # a character cut by the length limit comes out as U+FFFD
        self.status = Status.FINISHED
        self.finished_at = now

    # --- outputs ----------------------------------------------------------------------------
    def visible_text(self) -> str:
        text = self.detok.text
        if self.status is not Status.FINISHED and self.params.stop:
            text = text[: len(text) - stop_holdback(text, self.params.stop)]
        return text

    def meta_info(self) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": self.rid,
            "prompt_tokens": len(self.prompt_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
            "finish_reason": self.finish_reason if self.status is Status.FINISHED else None,
        }
        if self.params.return_logprob:
            meta["output_token_logprobs"] = [(lp, t, None) for lp, t in self.token_logprobs]
            if self.params.top_logprobs_num:
                meta["output_top_logprobs"] = [[(lp, t, None) for lp, t in top] for top in self.top_logprobs]
        if self.status is Status.FINISHED and self.finished_at is not None:
            meta["e2e_latency"] = self.finished_at - self.created
        return meta

    def result(self) -> dict[str, Any]:
        return {
            "text": self.visible_text(),
            "output_ids": list(self.output_ids),
            "meta_info": self.meta_info(),
        }

    def delta(self) -> dict[str, Any] | None:
        """The streamed chunk since the last one: new text and ids (None when there is nothing)."""
        text = self.visible_text()
        done = self.status is Status.FINISHED
        if len(text) == self.sent_text and len(self.output_ids) == self.sent_ids and not done:
            return None
        chunk = {
            "text": text[self.sent_text :],
            "output_ids": self.output_ids[self.sent_ids :],
            "meta_info": self.meta_info(),
            "finished": done,
        }
        if self.params.return_logprob:
            chunk["meta_info"]["output_token_logprobs"] = chunk["meta_info"]["output_token_logprobs"][
                self.sent_ids :
            ]
            if "output_top_logprobs" in chunk["meta_info"]:
                chunk["meta_info"]["output_top_logprobs"] = chunk["meta_info"]["output_top_logprobs"][
                    self.sent_ids :
                ]
        self.sent_text = len(text)
        self.sent_ids = len(self.output_ids)
        return chunk
