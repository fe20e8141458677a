"""`kvstrata.Engine`: SGLang-style offline API over the stratified cache, on its own thread.

Callers (any thread, or an asyncio loop) only put commands in an inbox; the engine thread owns the
model, the cache and the scheduler, runs one step at a time, and hands results back through
per-request sinks (a `queue.Queue`, or an asyncio queue fed with ``call_soon_threadsafe``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import torch

from kvstrata.engine.attention import get_backend
from kvstrata.engine.drift import DriftJob, DriftMonitor, fallback_window
from kvstrata.engine.inputs import normalize_inputs
from kvstrata.engine.loader import LoadedModel, load_model
from kvstrata.engine.options import EngineArgs, pool_pages
from kvstrata.engine.request import Request, Status
from kvstrata.engine.runner import StepRunner
from kvstrata.engine.sampling_params import SamplingParams
from kvstrata.engine.scheduler import Scheduler
from kvstrata.engine.stats import EngineEvent, EngineStats, RequestFinished, StatsCollector

log = logging.getLogger("kvstrata.engine")
Sink = Callable[[dict[str, Any]], None]


class Engine:
    """``Engine(model=None | path | LoadedModel, dtype=..., kv_cache_dtype=..., ...)``: see `EngineArgs`.

    A `LoadedModel` (from ``load_model``) is used as is, so several engines can share one set of
    weights (tests, benchmarks); its dtype and device then win over ``dtype`` and ``device``.
    """

    def __init__(self, model: str | LoadedModel | None = None, **kwargs: Any) -> None:
        from kvstrata.radix import CacheConfig, OutOfPages, OutOfSlots, StratifiedKVCache

        attention_backend = kwargs.pop("attention_backend", "torch")
        preloaded = model if isinstance(model, LoadedModel) else None
        self.args = args = EngineArgs(model=None if preloaded else model, **kwargs)
        args.validate()
        if preloaded is not None:
            self.model = preloaded
            self.device, self.dtype = preloaded.net.device, preloaded.net.dtype
        else:
            self.device = args.resolve_device()
            self.dtype = args.resolve_dtype(self.device)
            self.model = load_model(model, dtype=self.dtype, device=self.device)
        self.config = cfg = self.model.config
        self.tokenizer = self.model.tokenizer
        codecs = args.resolve_layer_codecs(cfg.num_layers, self.dtype)
        scales = None
        if args.kv_scales:
            from kvstrata.quant.scales import ScalesFile

            scales = ScalesFile.load(args.kv_scales)
            scales.check_geometry(cfg.num_layers, cfg.kv_heads, cfg.head_dim)
        drift_on = args.drift_sample_rate > 0
        top_level = args.drift_max_level if drift_on else 0
        max_window = fallback_window(args.recent_window, args.page_size, top_level)
        self.cache_config = CacheConfig(
            num_layers=cfg.num_layers,
            kv_heads=cfg.kv_heads,
            head_dim=cfg.head_dim,
            page_size=args.page_size,
            recent_window=args.recent_window,
            max_recent_window=max_window,
            layer_codecs=codecs,
            ring_dtype=args.resolve_ring_dtype(self.dtype),
            num_pages=pool_pages(args, self.device, _page_bytes(codecs, cfg, args.page_size)),
            max_running=args.max_running_requests,
            sinks=args.resolve_sinks(codecs),
            rotation=args.rotation,
            scales=scales,
            device=self.device,
        )
        self.cache = StratifiedKVCache(self.cache_config)
        self.capacity_tokens = self.cache_config.num_pages * args.page_size
        self.max_context = cfg.max_position_embeddings
        self.eos_ids = frozenset(cfg.eos_token_ids)
        backend = get_backend(attention_backend, self.cache, cfg.attn_scale)
        self.runner = StepRunner(self.model.net, self.cache, backend, self.device)
        self.scheduler = Scheduler(
            self.cache,
            args.max_running_requests,
            args.chunked_prefill_size,
            OutOfPages,
            OutOfSlots,
            self._finish,
        )
        self.stats = StatsCollector()
        self.drift: DriftMonitor | None = None
        self._pending_window: int | None = None
        if drift_on:
            self.drift = DriftMonitor(
                self.model.net.dense_forward,
                args.drift_sample_rate,
                args.drift_threshold,
                args.recent_window,
                args.drift_max_level,
                page_size=args.page_size,
                metric=args.drift_metric,
                max_tokens=args.drift_max_tokens,
                alpha=args.drift_ewma_alpha,
                cooldown=args.drift_cooldown,
                on_level=self._on_level,
                on_sample=self.stats.emit,
                seed=args.seed,
            )
        if args.seed is not None:
            torch.manual_seed(args.seed)
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="kvstrata-engine", daemon=True)
        self._thread.start()

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
    ) -> Any:
        """One prompt -> a result dict (a list of n with n > 1); a list of prompts -> a list.

        With ``stream=True``: an iterator of chunks with incremental ``text`` (``index`` in a batch).
        """
        sink_q: queue.Queue[dict[str, Any]] = queue.Queue()
        reqs, single = self._submit(
            prompt, input_ids, sampling_params, rid, return_logprob, top_logprobs_num, stream, sink_q.put
        )
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
    ) -> Any:
        """``await engine.async_generate(...)``; ``async for c in engine.async_generate(..., stream=True)``.

        Must be called on the event loop. Cancelling the await (or closing the stream) aborts the request.
        """
        loop = asyncio.get_running_loop()
        aq: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

        def sink(chunk: dict[str, Any]) -> None:
            loop.call_soon_threadsafe(aq.put_nowait, chunk)

        reqs, single = self._submit(
            prompt, input_ids, sampling_params, rid, return_logprob, top_logprobs_num, stream, sink
        )
        if stream:
            return self._stream_async(reqs, aq)
        return self._collect_async(reqs, aq, single)

    def abort(self, rid: str) -> None:
        """Abort a request (or all n samples of a group) by id; its pages and ring slot come back."""
        self._post("abort", rid)

    def flush_cache(self) -> bool:
        """Drop every cached prefix; only when no request is running or queued (as SGLang)."""
        return bool(self._call("flush", None))

    def cache_stats(self) -> Any:
        """``cache.stats()`` snapshot, taken on the engine thread."""
        return self._call("cache_stats", None)

    def check_invariants(self) -> Any:
        """``cache.check_invariants()`` on the engine thread (raises there, re-raised here); returns stats."""
        return self._call("check", None)

    def get_stats(self) -> EngineStats:
        """Engine counters and gauges (plain data), with the latest cache and drift snapshots."""
        snap = self.stats.snapshot(self.drift.stats() if self.drift else None)
        if not self._closed:
            snap.cache = self.cache_stats()
        return snap

    def subscribe(self, fn: Callable[[EngineEvent], None]) -> Callable[[], None]:
        """Call ``fn(event)`` for each RequestFinished / DriftSample; returns an unsubscribe function."""
        return self.stats.subscribe(fn)

    def get_server_info(self) -> dict[str, Any]:
        c = self.cache_config
        return {
            "model": self.model.name,
            "model_path": str(self.model.path),
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "kv_cache_dtype": self.args.kv_cache_dtype,
            "layer_codecs": list(c.layer_codecs),
            "sinks": c.sinks,
            "page_size": c.page_size,
            "recent_window": self.args.recent_window,
            "max_recent_window": c.max_recent_window,
            "num_pages": c.num_pages,
            "max_total_tokens": self.capacity_tokens,
            "max_running_requests": c.max_running,
            "chunked_prefill_size": self.args.chunked_prefill_size,
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
        if self._closed:
            return
        self._post("shutdown", None)
        self._thread.join(timeout=30)
        if self.drift is not None:
            self.drift.close()
        self._closed = True

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
        sink: Sink,
    ) -> tuple[list[Request], bool]:
        if self._closed or self._stopping:
            raise RuntimeError("engine is shut down")
        batch = normalize_inputs(prompt, input_ids, sampling_params, rid, self.tokenizer)
        reqs: list[Request] = []
        for ids, raw, req_id in zip(batch.ids, batch.params, batch.rids, strict=True):
            params = SamplingParams.from_dict(raw)
            if return_logprob is not None:
                params.return_logprob = return_logprob
            if top_logprobs_num is not None:
                params.top_logprobs_num = top_logprobs_num
                params.return_logprob = params.return_logprob or top_logprobs_num > 0
            params.validate()
            self._check_length(ids, params)
            group = req_id or uuid.uuid4().hex
            leader: Request | None = None
            for i in range(params.n):
                rid_i = group if params.n == 1 else f"{group}-{i}"
                seed = None if params.seed is None else params.seed + i
                req = Request(
                    rid_i, ids, params, self.tokenizer, self.eos_ids, self.config.vocab_size,
                    sink=sink, stream=stream, group=group, seed=seed, leader=leader,
                )  # fmt: skip
                if self.drift is not None and self.drift.should_sample():
                    req.drift_logprobs = []
                if params.n > 1 and leader is None:
                    leader = req
                reqs.append(req)
        self.stats.received(len(reqs))
        self._post("add", reqs)
        return reqs, batch.single

    def _check_length(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of range [0, {self.config.vocab_size})")
        limit = min(self.max_context, self.capacity_tokens)
        if len(ids) >= limit:
            raise ValueError(
                f"the prompt has {len(ids)} tokens; this engine takes at most {limit - 1} "
                f"(context length {self.max_context}, KV pool {self.capacity_tokens} tokens)"
            )

    def _post(self, kind: str, payload: Any) -> None:
        self._inbox.put((kind, payload))
        self._wake.set()

    def _call(self, kind: str, payload: Any) -> Any:
        if self._closed or self._stopping:
            raise RuntimeError("engine is shut down")
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._post(kind, (payload, fut))
        return fut.result(timeout=60)

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

    # ============================================================== engine thread
    def _loop(self) -> None:
        with torch.inference_mode():
            while not self._stopping:
                try:
                    self._iterate()
                except Exception as exc:  # a failed step ends the requests in it, never the engine
                    log.exception("engine step failed")
                    self._fail_running(exc)
            self._abort_all("engine shut down")

    def _iterate(self) -> None:
        self._drain_inbox()
        self.stats.queue_sizes(len(self.scheduler.running), len(self.scheduler.waiting))
        if self._stopping:
            return
        if self._pending_window is not None:
            window, self._pending_window = self._pending_window, None
            self.cache.set_recent_window(window)
        if self.scheduler.has_work():
            self._step()
        else:
            self._wake.wait(timeout=1.0)
            self._wake.clear()

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                for req in payload:
                    if req.params.max_new_tokens == 0:
                        self._finish(req, {"type": "length", "length": 0})
                    else:
                        self.scheduler.add(req)
            elif kind == "abort":
                for req in self.scheduler.find(payload):
                    self._finish(req, {"type": "abort", "message": "aborted by request"})
            elif kind == "shutdown":
                self._stopping = True
            else:
                arg, fut = payload
                try:
                    fut.set_result(self._command(kind, arg))
                except Exception as exc:
                    fut.set_exception(exc)

    def _command(self, kind: str, arg: Any) -> Any:
        if kind == "cache_stats":
            return self.cache.stats()
        if kind == "flush":
            if self.scheduler.has_work():
                return False
            self.cache.reset()
            return True
        if kind == "check":  # tests: invariants checked on the thread that owns the cache
            self.cache.check_invariants()
            return self.cache.stats()
        raise ValueError(f"unknown command {kind!r}")

    def _step(self) -> None:
        plan = self.scheduler.schedule()
        self.stats.queue_sizes(len(self.scheduler.running), len(self.scheduler.waiting))
        if plan is None:
            return
        sampled, out, logits = self.runner.run(plan)
        now = time.perf_counter()
        for req in plan.reqs:
            if req.leader is None and not req.prompt_cached and req.computed >= len(req.prompt_ids):
                self.cache.cache_prefix(req.seq)  # n > 1: siblings now match the prompt's pages
                req.prompt_cached = True
        if out is None:
            self.stats.step(0, len(self.scheduler.running), len(self.scheduler.waiting))
            return
        for i, req in enumerate(sampled):
            tok = out.tokens[i]
            if req.params.return_logprob:
                req.token_logprobs.append((out.token_logprobs[i], tok))
                req.top_logprobs.append([(lp, t) for t, lp in out.top_logprobs[i] or []])
            if req.drift_logprobs is not None and len(req.drift_logprobs) < self.args.drift_max_tokens:
                req.drift_logprobs.append(torch.log_softmax(logits[i].float(), dim=-1).cpu())
            req.append(tok, now)
            if req.finish_reason is None and req.tokens_len >= self.max_context:
                req.finish_reason = {"type": "length", "length": len(req.output_ids)}
            if req.finish_reason is not None:
                self._finish(req, req.finish_reason)
            elif req.stream and req.sink is not None:
                chunk = req.delta()
                if chunk is not None:
                    _deliver(req.sink, chunk)
        self.stats.step(len(sampled), len(self.scheduler.running), len(self.scheduler.waiting))

    def _finish(self, req: Request, reason: dict[str, Any]) -> None:
        """End a request (any state): release its cache sequence, deliver, record stats."""
        if req.status is Status.FINISHED:
            return
        aborted = reason.get("type") == "abort"
        self.scheduler.release(req, insert=not aborted)
        now = time.perf_counter()
        req.finish(reason, now)
        if self.drift is not None and req.drift_logprobs and not aborted:
            job = DriftJob(req.rid, req.all_ids(), len(req.prompt_ids), torch.stack(req.drift_logprobs))
            self.drift.submit(job)  # before the result goes out, so wait_drift_idle() sees it
        req.drift_logprobs = None
        if req.sink is not None:
            chunk = req.delta() if req.stream else req.result()
            if chunk is not None:
                _deliver(req.sink, chunk)
        times = req.token_times
        self.stats.finished(
            RequestFinished(
                rid=req.rid,
                status="error" if reason.get("error") else "aborted" if aborted else "success",
                finish_reason=req.finish_reason,
                prompt_tokens=len(req.prompt_ids),
                completion_tokens=len(req.output_ids),
                cached_tokens=req.cached_tokens,
                ttft=None if req.first_token_at is None else req.first_token_at - req.created,
                inter_token_latencies=[b - a for a, b in zip(times, times[1:], strict=False)],
                e2e_latency=now - req.created,
                preemptions=req.preemptions,
            )
        )

    def _fail_running(self, exc: Exception) -> None:
        for req in list(self.scheduler.running):
            try:
                self._finish(req, {"type": "abort", "message": f"internal error: {exc}", "error": True})
            except Exception:
                log.exception("could not end request %s", req.rid)

    def _abort_all(self, message: str) -> None:
        for req in [*self.scheduler.running, *self.scheduler.waiting]:
            self._finish(req, {"type": "abort", "message": message})
        while True:  # requests posted after the shutdown command
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                for req in payload:
                    self._finish(req, {"type": "abort", "message": message})
            elif kind not in ("abort", "shutdown"):
                payload[1].set_exception(RuntimeError(message))

    def _on_level(self, level: int, window: int) -> None:  # drift worker thread
        self._pending_window = window
        self._wake.set()


def _deliver(sink: Sink, chunk: dict[str, Any]) -> None:
    with contextlib.suppress(RuntimeError):  # the consumer's event loop is closed: nobody listens
        sink(chunk)


def _page_bytes(codecs: list[str], cfg: Any, page_size: int) -> int:
    from kvstrata.quant import get_codec

    total = 0
    for name in codecs:
        codec = get_codec(name)
        total += codec.page_bytes(page_size, cfg.kv_heads, cfg.head_dim, "channel")
        total += codec.page_bytes(page_size, cfg.kv_heads, cfg.head_dim, "token")
    return total


def _version() -> str:
    from kvstrata import __version__

    return __version__
