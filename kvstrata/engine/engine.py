"""`kvstrata.Engine`: SGLang-style offline API over the stratified cache, on its own thread.

Callers (any thread, or an asyncio loop) validate and tokenize here, then only post to the engine
thread's inbox (`EngineCore`); results come back through per-request sinks: a `queue.Queue` for
`generate`, an asyncio queue for `async_generate`, fed through its loop's `LoopMailbox` (one wake-up of
the loop per engine step for all its requests).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import queue
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import torch

from kvstrata.engine.core import EngineCore, ResultCallback
from kvstrata.engine.delivery import LoopMailbox
from kvstrata.engine.detokenizer import byte_table
from kvstrata.engine.full_graph import graph_kind
from kvstrata.engine.inputs import normalize_inputs
from kvstrata.engine.kvplan import plan_summary
from kvstrata.engine.loader import LoadedModel, load_model
from kvstrata.engine.options import EngineArgs, image_hosts
from kvstrata.engine.request import Request
from kvstrata.engine.sampling_params import SamplingParams
from kvstrata.engine.stats import EngineEvent, EngineStats
from kvstrata.engine.trace import WARMUP_DONE
from kvstrata.engine.warmup import IMAGE_WARMUP_BATCH, image_rounds, merge_splits, warmup_rounds

log = logging.getLogger("kvstrata.engine")


class Engine:
    """``Engine(model=None | path | LoadedModel, dtype=..., kv_cache_dtype=..., ...)``: see `EngineArgs`.

    A `LoadedModel` (from ``load_model``) is used as is, so several engines can share one set of
    weights (tests, benchmarks); its dtype and device then win over ``dtype`` and ``device``.
    """

    def __init__(self, model: str | LoadedModel | None = None, **kwargs: Any) -> None:
        attention_backend = kwargs.pop("attention_backend", "auto")
        preloaded = model if isinstance(model, LoadedModel) else None
        self.args = args = EngineArgs(model=None if preloaded else model, **kwargs)
        args.validate()
        if preloaded is None:
            device = args.resolve_device()
            preloaded = load_model(
                model, dtype=args.resolve_dtype(device), device=device, load_format=args.load_format
            )
        self.model = preloaded
        if preloaded.vision is not None:
            preloaded.vision.set_limits(
                args.max_image_bytes, args.max_image_pixels, args.image_fetch_timeout, image_hosts(args)
            )
        self.config = self.model.config
        self.tokenizer = self.model.tokenizer
        self.core = core = EngineCore(args, self.model, attention_backend)
        self.device, self.dtype = core.device, core.dtype
        self.cache, self.cache_config, self.runner = core.cache, core.cache_config, core.runner
        self.stats, self.drift = core.stats, core.drift
        self.capacity_tokens = self.cache.num_pages * args.page_size  # text pool + raised pool
        self.max_context = self.config.max_position_embeddings
        self.eos_ids = frozenset(self.config.eos_token_ids)
        for skip_special_tokens in (True, False):  # built (and checked) now, not in a request's submission
            byte_table(self.tokenizer, skip_special_tokens)
        self._closed = False
        self._final: dict[str, Any] | None = None  # what the engine answers after shutdown released it
        self._mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopMailbox] = (
            weakref.WeakKeyDictionary()
        )
        if args.resolve_warmup(self.device):
            try:
                self._warm_up()
            except BaseException:
                self.shutdown()
                raise

    def _warm_up(self) -> None:
        """Run the warm-up workload (`kvstrata/engine/warmup.py`), then forget it: the prefix cache is
        emptied, the request statistics start from zero (the cache's own page counters keep it) and the
        step timeline, when on, gets a mark its summary starts from."""
        start = time.perf_counter()
        rounds = warmup_rounds(
            self.args.max_running_requests,
            self.args.page_size,
            self.capacity_tokens,
            self.max_context,
            self.config.vocab_size,
            kv_heads=self.config.kv_heads,
        )
        drift, self.drift = self.drift, None  # warm-up requests are never drift samples
        # With a raised pool (the drift fallback's wider codecs), the workload runs again at fallback
        # level 1, new pages raised: a step over raised pages adds a kernel pass and the text pass
        # then writes split partials (`attend._cold_passes`), variants of their own. The engine thread
        # reads the level every iteration; warm-up requests are not sampled, so the drift worker,
        # which also sets it, is idle.
        levels = (0, 1) if drift is not None and self.cache.raised_pool is not None else (0,)
        images = 0
        try:
            for level in levels:
                if drift is not None:
                    drift.policy.level = level
                for r in rounds:
                    params = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in r.max_new]
                    self.generate(input_ids=r.prompts, sampling_params=params)
                self._flush_when_idle()
            if drift is not None:
                drift.policy.level = 0  # images at the level served nearly always: text pages unraised
            images = self._warm_up_images()
            self._warm_up_merges()
        finally:
            if drift is not None:
                drift.policy.level = 0
            self.drift = drift
        self.stats.reset()
        if self.core.trace is not None:
            self.core.trace.mark(WARMUP_DONE)  # the timeline's summary starts here
        log.info(
            "warm-up: %d requests in %.1f s",
            len(levels) * sum(len(r.prompts) for r in rounds) + images,
            time.perf_counter() - start,
        )

    def _warm_up_merges(self) -> None:
        """Compile the Triton split merge for every split block a decode step can reach
        (`attend.warm_merges`, `warmup.merge_splits`): the rounds meet only those of their own steps."""
        if self.runner.backend.name != "triton":
            return
        from kvstrata.radix.kernels.attend import warm_merges

        cfg, cache = self.config, self.cache
        passes = 1 + (cache.image_pool is not None) + (cache.raised_pool is not None)
        pages = -(-self.max_context // self.args.page_size)
        most = merge_splits(cfg.kv_heads, pages, passes)
        warm_merges(most, cfg.q_heads, cfg.head_dim, self.dtype, self.device)

    def _warm_up_images(self) -> int:
        """A vision-language model's warm-up rounds (`warmup.image_rounds`) over one synthetic image;
        returns the requests run (0 for a text model). Leaves the cache empty and the vision
        statistics at zero."""
        vision = self.model.vision
        if vision is None:
            return 0
        from PIL import Image

        size = vision.cfg.vision.image_size
        image = Image.new("RGB", (size, size), (128, 96, 64))
        # Each prompt of a round preprocesses the image again and keeps its pixels until it ends
        # (Idefics3 tiles: about 27 MB a prompt): rounds of at most IMAGE_WARMUP_BATCH prompts.
        batch, page = min(self.args.max_running_requests, IMAGE_WARMUP_BATCH), self.args.page_size
        # the shared prompt within the context, and within the pool beside every tail (at most 2 pages + 2)
        room = min(self.max_context, self.capacity_tokens - batch * 3 * page)
        singles, rounds = image_rounds(
            batch,
            page,
            room,
            self.config.vocab_size,
            vision.image_token_id,
            vision.prompt_tokens(image),
        )
        if not singles:
            log.info("warm-up: no image rounds (a prompt with an image does not fit %d tokens)", room)
            return 0
        # 4 tokens: when a round's extends take several prefill steps, its later decode steps still
        # hold every prompt of the round
        params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
        for ids in singles:
            self.generate(input_ids=ids, image_data=image if ids.count(vision.image_token_id) else None,
                          sampling_params=params)  # fmt: skip
        for prompts in rounds:
            self.generate(input_ids=prompts, image_data=[image] * len(prompts), sampling_params=params)
        self._flush_when_idle()
        with vision.stats.lock:
            vision.stats.encoded_images = vision.stats.cached_images = 0
        return len(singles) + sum(len(p) for p in rounds)

    def _flush_when_idle(self) -> None:
        for _ in range(1000):  # the last step's read-back may still be settling
            if self.flush_cache():
                return
            time.sleep(0.01)
        raise RuntimeError("warm-up: the engine did not become idle")

    # ============================================================== public API
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        stream: bool = False,
        rid: str | list[str] | None = None,
        return_logprob: bool | None = None,
        top_logprobs_num: int | None = None,
        image_data: Any = None,
    ) -> Any:
        """One prompt -> a result dict (a list of n with n > 1); a list of prompts -> a list.

        With ``stream=True``: an iterator of chunks with incremental ``text`` (``index`` in a batch).
        ``image_data`` (vision-language models, as SGLang): for one prompt an image or a list of images,
        for a batch one such entry per prompt; an image is a ``data:`` URL, an allow-listed http(s) URL,
        bytes or a PIL image, and the prompt holds one image token per image.
        """
        sink_q: queue.Queue[dict[str, Any]] = queue.Queue()
        reqs, single = self._submit(
            prompt, input_ids, sampling_params, rid, return_logprob, top_logprobs_num, stream, sink_q.put,
            image_data,
        )  # fmt: skip
        if stream:
            return self._stream_sync(reqs, sink_q)
        results = self._collect_sync(reqs, sink_q)
        return results[0] if single and len(results) == 1 else results

    def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        stream: bool = False,
        rid: str | list[str] | None = None,
        return_logprob: bool | None = None,
        top_logprobs_num: int | None = None,
        image_data: Any = None,
    ) -> Any:
        """``await engine.async_generate(...)``; ``async for c in engine.async_generate(..., stream=True)``.

        Must be called on the event loop. Cancelling the await (or closing the stream) aborts the request.
        """
        loop = asyncio.get_running_loop()
        aq: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        mailbox = self._mailboxes.get(loop)
        if mailbox is None:
            mailbox = self._mailboxes[loop] = LoopMailbox(loop)
        reqs, single = self._submit(
            prompt,
            input_ids,
            sampling_params,
            rid,
            return_logprob,
            top_logprobs_num,
            stream,
            mailbox.sink(aq),
            image_data,
        )
        if stream:
            return self._stream_async(reqs, aq)
        return self._collect_async(reqs, aq, single)

    def submit(
        self,
        input_ids: list[int] | list[list[int]],
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None,
        sink: ResultCallback,
        rid: str | list[str] | None = None,
        image_data: Any = None,
        stream: bool = True,
    ) -> list[str]:
        """Submit requests whose chunks go to ``sink`` (called on the engine thread; a sink with a
        ``mailbox`` attribute gets ``mailbox.flush()`` once per step, as `LoopMailbox` does) and return
        their ids in the engine's order (prompt * n + sample). For a caller that moves the chunks on
        itself: the server's engine process (kvstrata/server/engine_process.py)."""
        reqs, _ = self._submit(None, input_ids, sampling_params, rid, None, None, stream, sink, image_data)
        return [r.rid for r in reqs]

    def abort(self, rid: str) -> None:
        """Abort a request (or all n samples of a group) by id; its pages and ring slot come back."""
        with contextlib.suppress(RuntimeError):  # shut down: every request has already ended
            self.core.post("abort", rid)

    def flush_cache(self) -> bool:
        """Drop every cached prefix; only when no request is running or queued (as SGLang)."""
        return bool(self.core.call("flush", None))

    def cache_stats(self) -> Any:
        """``cache.stats()`` snapshot, taken on the engine thread."""
        return self.core.call("cache_stats", None)

    def pin(
        self,
        prompt: str | None = None,
        input_ids: list[int] | None = None,
        image_data: Any = None,
        ttl_s: float | None = None,
        label: str = "",
    ) -> dict[str, Any]:
        """Pin a prompt's full pages (a text prefix, or one with images): they are computed first if
        not cached (one greedy token), then pinned; returns the pin (``id``, ``tokens``, ``bytes``...).

        Raises ``ValueError`` for a bad prompt or image and `PinBudgetExceeded` over the pin budget.
        """
        self._live()
        batch = normalize_inputs(prompt, input_ids, None, None, self.tokenizer)
        if not batch.single:
            raise ValueError("pin takes one prompt")
        ids = batch.ids[0]
        images = self._images_per_prompt(image_data, 1, True)[0]
        self.generate(
            input_ids=ids, image_data=images or None, sampling_params={"max_new_tokens": 1, "temperature": 0}
        )
        if images:
            ids, _ = self.model.vision.build(ids, images)
        return self.core.call("pin", {"tokens": ids, "ttl_s": ttl_s, "label": label})

    def unpin(self, pin_id: str) -> dict[str, Any]:
        """Release a pin by id (``KeyError`` when there is none); its pages become evictable."""
        return self.core.call("unpin", pin_id)

    def list_pins(self) -> list[dict[str, Any]]:
        return self.core.call("pins", None)

    def check_invariants(self) -> Any:
        """``cache.check_invariants()`` on the engine thread (raises there, re-raised here); returns stats."""
        return self.core.call("check", None)

    def get_stats(self) -> EngineStats:
        """Engine counters and gauges (plain data), with the latest cache and drift snapshots."""
        cache = (
            None if self._closed or self.core.stopping else self.cache_stats()
        )  # also refreshes the counts
        snap = self.stats.snapshot(self.drift.stats() if self.drift else None)
        snap.cache = cache
        return snap

    def subscribe(self, fn: Callable[[EngineEvent], None]) -> Callable[[], None]:
        """Call ``fn(event)`` for each RequestFinished / DriftSample; returns an unsubscribe function."""
        return self.stats.subscribe(fn)

    def layer_codecs(self) -> list[str]:
        """Per layer, the codec name new cold pages are written in (``"k/v"`` when K and V differ): the
        raised pool's while the drift fallback raises precision."""
        if self._final is not None:
            return list(self._final["server_info"]["layer_codecs"])
        pool = self.cache.raised_pool if self.cache.raised else self.cache.pool
        assert pool is not None
        return list(pool.codec_names)

    def raised_codecs(self) -> list[str]:
        """Per layer, the codec of the drift fallback's raised pool (empty without one)."""
        if self._final is not None:
            return list(self._final["raised_codecs"])
        return list(self.cache.raised_pool.codec_names) if self.cache.raised_pool is not None else []

    def get_server_info(self) -> dict[str, Any]:
        if self._final is not None:
            return dict(self._final["server_info"])
        c = self.cache_config
        return {
            "model": self.model.name,
            "model_path": str(self.model.path),
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "kv_cache_dtype": self.args.kv_cache_dtype,
            "layer_codecs": self.layer_codecs(),
            "kv_plan": plan_summary(self.core.kv_plan),
            "sinks": c.sinks,
            "page_size": c.page_size,
            "recent_window": self.args.recent_window,
            "max_recent_window": c.max_recent_window,
            "num_pages": c.num_pages,
            "raised_pages": c.raised_pages,
            "max_total_tokens": self.capacity_tokens,
            "max_running_requests": c.max_running,
            "chunked_prefill_size": self.args.chunked_prefill_size,
            "attention_backend": self.runner.backend.name,
            "cuda_graphs": graph_kind(self.runner.graphs),
            "context_length": self.max_context,
            "drift_sample_rate": self.args.drift_sample_rate,
            "drift_threshold": self.args.drift_threshold,
            "fallback_level": self.drift.stats().level if self.drift else 0,
            "version": _version(),
        }

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tokenize: bool = False
    ) -> Any:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass input_ids")
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=tokenize
        )

    def wait_drift_idle(self, timeout: float = 60.0) -> bool:
        """Block until the drift worker has scored everything queued (tests, benchmarks)."""
        return self.drift.wait_idle(timeout) if self.drift else True

    def shutdown(self) -> None:
        """Stop the engine thread (requests still queued or running end as aborted), then give back
        the device memory the engine holds, as SGLang's ``Engine.shutdown`` does by ending its
        processes: the KV pools, ring, sinks, CUDA graphs and workspaces, and the weights unless the
        caller passed in the `LoadedModel` (then only the engine's reference to it goes). Afterwards
        ``cache``, ``runner`` and ``model`` are None; the statistics, server info, codecs and vision
        counters still answer (as they were at shutdown: a metrics scrape of an app that outlives its
        engine keeps working) and what needs the model raises ``RuntimeError``. If the engine thread
        is still in a step after `EngineCore.stop`'s wait, nothing is freed; a later call tries again."""
        if not self._closed:
            self.core.stop()
            self._closed = True
        if self._final is not None:
            return
        if not self.core.release():
            log.warning(
                "shutdown: the engine thread is still in a step; its memory is kept until shutdown() again"
            )
            return
        self._final = {
            "server_info": self.get_server_info(),
            "raised_codecs": self.raised_codecs(),
            "vision_stats": self.vision_stats(),
        }
        self.cache = self.runner = self.model = None  # type: ignore[assignment]
        gc.collect()  # the dropped objects refer to each other (callbacks, graphs' closures)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _live(self) -> None:
        if self._closed:
            raise RuntimeError("engine is shut down")

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ============================================================== submission (caller thread)
    def _submit(
        self,
        prompt: Any,
        input_ids: Any,
        sampling_params: Any,
        rid: Any,
        return_logprob: bool | None,
        top_logprobs_num: int | None,
        stream: bool,
        sink: ResultCallback,
        image_data: Any = None,
    ) -> tuple[list[Request], bool]:
        if self._closed or self.core.stopping:
            raise RuntimeError("engine is shut down")
        batch = normalize_inputs(prompt, input_ids, sampling_params, rid, self.tokenizer)
        images = self._images_per_prompt(image_data, len(batch.ids), batch.single)
        reqs: list[Request] = []
        for ids, raw, req_id, imgs in zip(batch.ids, batch.params, batch.rids, images, strict=True):
            mm = None
            if imgs:
                ids, mm = self.model.vision.build(ids, imgs)
            params = SamplingParams.from_dict(raw)
            if return_logprob is not None:
                params.return_logprob = return_logprob
            if top_logprobs_num is not None:
                params.top_logprobs_num = top_logprobs_num
                params.return_logprob = params.return_logprob or top_logprobs_num > 0
            params.validate()
            self._check_length(ids, params, mm.pad_ids if mm is not None else frozenset())
            group = req_id or uuid.uuid4().hex
            leader: Request | None = None
            for i in range(params.n):
                rid_i = group if params.n == 1 else f"{group}-{i}"
                seed = None if params.seed is None else params.seed + i
                req = Request(
                    rid_i, ids, params, self.tokenizer, self.eos_ids, self.config.vocab_size,
                    sink=sink, stream=stream, group=group, seed=seed, leader=leader, device=self.device,
                )  # fmt: skip
                if mm is not None:
                    self._attach_images(req, mm if leader is None else mm.fork())
                elif self.drift is not None and self.drift.should_sample():
                    req.drift_logprobs = []  # the drift monitor re-scores text only
                if params.n > 1 and leader is None:
                    leader = req
                reqs.append(req)
        rids = [r.rid for r in reqs]
        if len(set(rids)) != len(rids):
            # Results are collected by rid: two requests under one rid would never both be delivered.
            raise ValueError(f"request ids must be unique within a call, got {rids}")
        self.stats.received(len(reqs))
        self.core.post("add", reqs)
        return reqs, batch.single

    def _images_per_prompt(self, image_data: Any, n_prompts: int, single: bool) -> list[list[Any]]:
        if image_data is None or (isinstance(image_data, list) and not image_data):
            return [[] for _ in range(n_prompts)]
        if self.model.vision is None:
            raise ValueError(
                f"the model {self.model.name!r} takes no images (it is not a vision-language model)"
            )
        if single:
            return [image_data if isinstance(image_data, list) else [image_data]]
        if not isinstance(image_data, list) or len(image_data) != n_prompts:
            raise ValueError(
                f"image_data for a batch needs one entry (an image or a list) per prompt ({n_prompts})"
            )
        return [[] if x is None else x if isinstance(x, list) else [x] for x in image_data]

    def _attach_images(self, req: Request, mm: Any) -> None:
        """Placeholder pad ids are not text: the detokenizer and penalties see the text ids only."""
        from kvstrata.engine.detokenizer import IncrementalDetokenizer
        from kvstrata.engine.sampler import PenaltyState, SampleRow

        req.mm = mm
        text = mm.text_ids(req.prompt_ids)
        req.detok = IncrementalDetokenizer(self.tokenizer, text, req.params.skip_special_tokens)
        if req.penalties is not None:
            req.penalties = PenaltyState(self.config.vocab_size, text, self.device)
            req.row = SampleRow(req.params, req.generator, req.penalties)

    def vision_stats(self) -> dict[str, int]:
        """Images encoded by the vision tower and images whose tower run was skipped (span cached)."""
        if self._final is not None:
            return dict(self._final["vision_stats"])
        vision = self.model.vision
        if vision is None:
            return {"encoded_images": 0, "cached_images": 0}
        return {"encoded_images": vision.stats.encoded_images, "cached_images": vision.stats.cached_images}

    def _check_length(
        self, ids: list[int], params: SamplingParams, pad_ids: frozenset[int] = frozenset()
    ) -> None:
        if not ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size and t not in pad_ids]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of range [0, {self.config.vocab_size})")
        limit = min(self.max_context, self.capacity_tokens)
        if len(ids) >= limit:
            raise ValueError(
                f"the prompt has {len(ids)} tokens; this engine takes at most {limit - 1} "
                f"(context length {self.max_context}, KV pool {self.capacity_tokens} tokens)"
            )

    # ============================================================== result plumbing (caller side)
    @staticmethod
    def _collect_sync(reqs: list[Request], q: queue.Queue[dict[str, Any]]) -> list[dict[str, Any]]:
        got: dict[str, dict[str, Any]] = {}
        while len(got) < len(reqs):
            chunk = q.get()
            got[chunk["meta_info"]["id"]] = chunk
        return [got[r.rid] for r in reqs]

    def _stream_sync(self, reqs: list[Request], q: queue.Queue[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        index = {r.rid: i for i, r in enumerate(reqs)}
        done = 0
        try:
            while done < len(reqs):
                chunk = q.get()
                chunk["index"] = index[chunk["meta_info"]["id"]]
                done += chunk["finished"]
                yield chunk
        finally:
            if done < len(reqs):
                for r in reqs:
                    self.abort(r.rid)

    async def _collect_async(
        self, reqs: list[Request], q: asyncio.Queue[dict[str, Any]], single: bool
    ) -> dict[str, Any] | list[dict[str, Any]]:
        got: dict[str, dict[str, Any]] = {}
        try:
            while len(got) < len(reqs):
                chunk = await q.get()
                got[chunk["meta_info"]["id"]] = chunk
        finally:
            if len(got) < len(reqs):
                for r in reqs:
                    self.abort(r.rid)
        results = [got[r.rid] for r in reqs]
        return results[0] if single and len(results) == 1 else results

    async def _stream_async(
        self, reqs: list[Request], q: asyncio.Queue[dict[str, Any]]
    ) -> AsyncIterator[dict[str, Any]]:
        index = {r.rid: i for i, r in enumerate(reqs)}
        done = 0
        try:
            while done < len(reqs):
                chunk = await q.get()
                chunk["index"] = index[chunk["meta_info"]["id"]]
                done += chunk["finished"]
                yield chunk
        finally:
            if done < len(reqs):
                for r in reqs:
                    self.abort(r.rid)


def _version() -> str:
    from kvstrata import __version__

    return __version__
