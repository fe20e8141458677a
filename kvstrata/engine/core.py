"""The engine thread: it owns the cache, the scheduler and the model runner, and runs the steps.

Everything reaches it through an inbox (`post`, or `call` for a result): requests to add, aborts,
commands (cache stats, flush, invariants), shutdown. Between steps it drains the inbox, applies the
drift monitor's current fallback window, and runs one step; a fault in a step ends the requests in
it with an error (their pages and slots come back), never the thread.
Results leave through per-request sinks (those of asyncio callers through their loop's `LoopMailbox`,
flushed once per iteration); statistics through the `StatsCollector`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from kvstrata.engine.attention import get_backend, resolve_backend
from kvstrata.engine.cuda_graph import graph_memory_bytes, graphs_wanted
from kvstrata.engine.drift import DriftJob, DriftMonitor, fallback_window, summarize_codecs
from kvstrata.engine.full_graph import decode_graphs, full_graph_memory_bytes, full_graph_unsupported
from kvstrata.engine.kvplan import plan_key_centers, raise_codecs, resolve_plan
from kvstrata.engine.loader import LoadedModel
from kvstrata.engine.memory import image_pool_need, plan_memory, weight_bytes, with_raised_pool
from kvstrata.engine.options import EngineArgs, pin_budget_bytes, resolve_vision_codec
from kvstrata.engine.request import Request, Status
from kvstrata.engine.runner import Launched, StepRunner
from kvstrata.engine.sampler import SampleOutput
from kvstrata.engine.scheduler import Scheduler, StepPlan
from kvstrata.engine.stats import RequestFinished, StatsCollector
from kvstrata.engine.trace import StepTrace
from kvstrata.radix.pool import cold_page_bytes

log = logging.getLogger("kvstrata.engine")
ResultCallback = Callable[[dict[str, Any]], None]  # receives a request's chunks and final result
NONFINITE_LOGITS = "the model produced non-finite logits (NaN or Inf) for this request"


class EngineCore:
    def __init__(self, args: EngineArgs, model: LoadedModel, attention_backend: str = "auto") -> None:
        from kvstrata.radix import CacheConfig, OutOfPages, OutOfSlots, StratifiedKVCache

        self.args = args
        self.model = model
        self.device, self.dtype = model.net.device, model.net.dtype
        if self.device.type == "cpu":
            from kvstrata.engine.malloc import tune_malloc

            tune_malloc()  # attention temporaries would page-fault on every step (see malloc.py)
        cfg = model.config
        self.max_context = cfg.max_position_embeddings
        codecs = args.resolve_layer_codecs(cfg.num_layers, self.dtype)
        codecs, self.kv_plan = resolve_plan(args, model, codecs)
        model.net.set_key_centers(plan_key_centers(args, self.kv_plan))
        scales = None
        if args.kv_scales:
            from kvstrata.quant.scales import ScalesFile

            scales = ScalesFile.load(args.kv_scales)
            scales.check_geometry(cfg.num_layers, cfg.kv_heads, cfg.head_dim)
        drift_on = args.drift_sample_rate > 0
        top_level = args.drift_max_level if drift_on else 0
        max_window = fallback_window(args.recent_window, args.page_size, top_level)
        image_codec = resolve_vision_codec(args, codecs) if model.vision is not None else None
        page_bytes = [
            cold_page_bytes(c, args.page_size, cfg.kv_heads, cfg.head_dim)
            for c in (codecs, [image_codec] * cfg.num_layers if image_codec else [])
            if c
        ]
        self.cache_config = CacheConfig(
            num_layers=cfg.num_layers,
            kv_heads=cfg.kv_heads,
            head_dim=cfg.head_dim,
            page_size=args.page_size,
            recent_window=args.recent_window,
            max_recent_window=max_window,
            layer_codecs=codecs,
            ring_dtype=args.resolve_ring_dtype(self.dtype),
            num_pages=0,  # set by the memory plan below
            max_running=args.max_running_requests,
            sinks=args.resolve_sinks(codecs),
            rotation=args.rotation,
            scales=scales,
            device=self.device,
            pin_budget_bytes=pin_budget_bytes(args, max(page_bytes)),
        )
        raised = raise_codecs(codecs, args.drift_raise_dtype) if drift_on else None
        graph_bs = args.resolve_cuda_graph_max_bs()
        graph_bytes = 0
        if graphs_wanted(model.net, args.disable_cuda_graph):
            graph_bytes = graph_memory_bytes(cfg, graph_bs, self.dtype)
            backend_name = resolve_backend(attention_backend, self.device)
            # with an image or raised pool too: their steps replay the piecewise pieces (the same pool)
            whole = full_graph_unsupported(backend_name, scales is not None)
            if args.cuda_graph_mode == "full" and whole is None:
                ring = self.cache_config.ring_tokens
                graph_bytes += full_graph_memory_bytes(cfg, graph_bs, self.max_context, args.page_size, ring)
        self.memory_plan = plan_memory(
            args,
            cfg,
            self.cache_config,
            weight_bytes(model.net),
            self.dtype,
            self.device,
            cuda_graph_bytes=graph_bytes,
            attention_kernels=resolve_backend(attention_backend, self.device) == "triton",
            cold_passes=1 + (image_codec is not None) + (raised is not None),
            image=image_pool_need(args, self.cache_config, page_bytes[-1], model.vision.max_image_tokens)
            if image_codec
            else None,
        )
        if raised is not None:
            raised_bytes = cold_page_bytes(raised, args.page_size, cfg.kv_heads, cfg.head_dim)
            self.memory_plan = with_raised_pool(self.memory_plan, raised_bytes, args.drift_raise_share)
            if self.memory_plan.raised_pages:
                self.cache_config = dataclasses.replace(
                    self.cache_config, raised_codecs=raised, raised_pages=self.memory_plan.raised_pages
                )
                log.info("drift fallback level 1 raises new text pages to %s", summarize_codecs(raised))
            else:
                log.warning("drift fallback: the cold pool is too small for a raised pool; window only")
                raised = None
        self.cache_config = dataclasses.replace(self.cache_config, num_pages=self.memory_plan.cold_pages)
        if image_codec is not None:
            self.cache_config = dataclasses.replace(
                self.cache_config,
                image_codec=image_codec,
                image_pages=self.memory_plan.image_pages,
                image_token_from=model.vision.vocab_size,
            )
        log.info("%s", self.memory_plan.table())
        self.cache = StratifiedKVCache(self.cache_config)
        backend = get_backend(attention_backend, self.cache, cfg.attn_scale)
        graphs = decode_graphs(
            model.net,
            args.disable_cuda_graph,
            graph_bs,
            args.cuda_graph_mode,
            self.cache,
            backend,
            self.max_context,
        )
        self.runner = StepRunner(model.net, self.cache, backend, self.device, graphs)
        self.scheduler = Scheduler(
            self.cache,
            args.max_running_requests,
            args.chunked_prefill_size,
            OutOfPages,
            OutOfSlots,
            self._finish,
            mixed_chunk=args.enable_mixed_chunk,
            defer_fill=args.prefill_defer_fill,
        )
        self.stats = StatsCollector()
        self.drift: DriftMonitor | None = None
        if drift_on:
            self.drift = DriftMonitor(
                model.net.dense_forward,
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
                raised_codecs=raised,
            )
        if args.seed is not None:
            torch.manual_seed(args.seed)
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self.stopping = False
        # Set by the engine thread before its final drain; from then on `post` refuses, so nothing
        # posted can wait for an answer that never comes.
        self._closed = False
        self._post_lock = threading.Lock()
        self._outbox: dict[int, Any] = {}  # mailboxes given chunks since the last flush, by id
        self.set_flush_at_sync(self.device.type == "cuda")
        self._inflight: Launched | None = None  # a launched step whose sampled ids are not read yet
        self.overlap = not args.disable_overlap_schedule and self.device.type == "cuda"
        self.deferred_steps = 0  # steps whose ids stayed on the device while the next one launched
        self.trace = StepTrace.from_env(self.device)  # KVSTRATA_STEP_TRACE: the per-step timeline
        self._iteration_start = 0.0
        if self.trace is not None:
            self.runner.on_launched = self.trace.launched
            log.info("step timeline to %s", self.trace.path)
        self._thread = threading.Thread(target=self._loop, name="kvstrata-engine", daemon=True)
        self._thread.start()

    def set_flush_at_sync(self, on: bool) -> None:
        """Where streamed chunks leave: ``on`` (the CUDA default) holds a step's chunks until the next
        step is launched and its sampler is about to wait for the device, so the event loop streams
        them while the GPU computes instead of competing for the GIL with the step's planning and
        launches (a token reaches its client one step's host time later; the step interval shrinks).
        Off (the CPU default, where the forward itself is the host's work): at the end of each step.
        """
        self.flush_at_sync = on
        self.runner.sampler.before_sync = self._flush_outbox if on else None

    # --- inbox (any thread) ---------------------------------------------------------------------
    def post(self, kind: str, payload: Any) -> None:
        with self._post_lock:
            if self._closed:
                raise RuntimeError("engine is shut down")
            self._inbox.put((kind, payload))
        self._wake.set()

    def call(self, kind: str, payload: Any = None, timeout: float = 60.0) -> Any:
        """Run a command on the engine thread and return its result (or raise its exception)."""
        if self.stopping:
            raise RuntimeError("engine is shut down")
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self.post(kind, (payload, fut))
        return fut.result(timeout=timeout)

    def stop(self) -> None:
        with contextlib.suppress(RuntimeError):  # already closed
            self.post("shutdown", None)
        self._thread.join(timeout=30)
        if self.drift is not None:
            self.drift.close()

    def release(self) -> bool:
        """After `stop`: drop this core's references to what holds device memory (the cache's pools,
        ring and sinks, the runner's CUDA graphs and workspaces, the model), so that memory can be
        freed at shutdown rather than whenever the garbage collector next meets the reference cycles
        between these objects. False, and nothing dropped, while the engine thread still runs."""
        if self._thread.is_alive():
            return False
        self._inflight = None
        self.runner = self.cache = self.scheduler = self.model = None  # type: ignore[assignment]
        return True

    # --- the engine thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        with torch.inference_mode():
            while not self.stopping:
                stepped = False
                try:
                    stepped = self._iterate()
                except Exception as exc:  # a failed step ends the requests in it, never the engine
                    log.exception("engine iteration failed")
                    self._fail(list(self.scheduler.running), exc)
                if not (stepped and self.flush_at_sync and self.scheduler.has_work()):
                    self._flush_outbox()  # else the next step's sampler flushes, before its read-back
            try:
                self._abort_all("engine shut down")
                self._flush_outbox()
            finally:  # the trace's gc callback and file close even if the shutdown work raised
                if self.trace is not None:
                    self.trace.close()

    def _iterate(self) -> bool:
        """Drain the inbox, then run one step (True when its forward pass ran) or wait for work."""
        self._iteration_start = time.perf_counter()
        self._drain_inbox()
        self.stats.queue_sizes(len(self.scheduler.running), len(self.scheduler.waiting))
        if self.stopping:
            return False
        if self.drift is not None:
            # Pulled from the monitor, not handed over: a level change can never be lost between threads.
            level = self.drift.policy.level  # read once: window and codecs of the same level
            window, raised = self.drift.window(level), self.drift.raised(level)
            if window != self.cache.recent_window:
                self.cache.set_recent_window(window)
            if raised != self.cache.raised:
                self.cache.set_raised(raised)
        self.cache.pins.expire()  # also while idle: the loop wakes at least once a second
        if self.scheduler.has_work() or self._inflight is not None:
            return self._step()
        self._flush_outbox()  # what the inbox's commands delivered goes out before the wait
        if self.trace is not None:
            self.trace.waiting()
        self._wake.wait(timeout=1.0)
        self._wake.clear()
        return False

    def _pending(self) -> Iterator[tuple[str, Any]]:
        """The inbox's messages, until it is empty."""
        while True:
            try:
                yield self._inbox.get_nowait()
            except queue.Empty:
                return

    def _drain_inbox(self) -> None:
        for kind, payload in self._pending():
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
                self.stopping = True
            else:
                arg, fut = payload
                try:
                    fut.set_result(self._command(kind, arg))
                except Exception as exc:
                    fut.set_exception(exc)

    def _command(self, kind: str, arg: Any) -> Any:
        if kind == "cache_stats":
            self.stats.queue_sizes(len(self.scheduler.running), len(self.scheduler.waiting))
            return self.cache.stats()
        if kind == "flush":
            if self.scheduler.has_work():
                return False
            self.cache.reset()
            return True
        if kind == "check":  # tests: invariants checked on the thread that owns the cache
            self.cache.check_invariants()
            return self.cache.stats()
        if kind in ("pin", "unpin", "pins"):
            return self._pin_command(kind, arg)
        raise ValueError(f"unknown command {kind!r}")

    def _pin_command(self, kind: str, arg: Any) -> Any:
        """Pins on the engine thread: ``pin`` {tokens, ttl_s, label} -> pin json; ``unpin`` id; ``pins``."""
        pins = self.cache.pins
        pins.expire()
        if kind == "pin":
            pin = pins.pin(arg["tokens"], label=arg.get("label", ""), ttl_s=arg.get("ttl_s"))
            return pins.describe(pin)
        if kind == "unpin":
            pin = pins.unpin(arg)
            return pins.describe(pin)
        return pins.to_json()

    def _pin_images(self, req: Request) -> None:
        """The prompt is computed: cache its pages and pin the prefix ending at each image span."""
        self.cache.cache_prefix(req.seq)
        req.mm.pin_spans(req.prompt_ids, self.cache.pins, self.args.pin_ttl)

    def _step(self) -> bool:
        try:
            plan = self.scheduler.schedule()
        except Exception as exc:  # planning failed (the cache rolled the step back): end what it picked
            log.exception("planning a step failed")
            self._fail(list(self.scheduler.running), exc)  # a token in flight is taken first
            return False
        self.stats.queue_sizes(len(self.scheduler.running), len(self.scheduler.waiting))
        if plan is None:
            self._settle()
            return False
        if self.trace is not None:
            self.runner.sampler.take_times()  # read-backs outside this step do not count
            decoding = [req.computed >= len(req.prompt_ids) for req in plan.reqs]
            self.trace.begin(self._iteration_start, plan.n_new, decoding)
        if not self.overlap and self._inflight is None:
            try:
                self._run(plan)
            except Exception as exc:  # the forward pass or sampling failed: end the requests of this step
                log.exception("engine step failed")
                self._fail(plan.reqs, exc)
                return False
            self._trace_end()
            return True
        before = self._inflight
        try:
            self._run_overlapped(plan)
        except Exception as exc:
            log.exception("engine step failed")
            if not plan.batch.closed:
                self.cache.cancel_step(plan.batch)
            # The step before is still in flight when this one failed to launch: `_finish` takes its
            # tokens; when reading it back failed, its requests fail too.
            lost = before.sampled if before is not None and self._inflight is None else []
            self._fail([*plan.reqs, *lost], exc)
            return False
        self._trace_end()
        return True

    def _trace_end(self) -> None:
        if self.trace is not None:
            flush_s, wait_s = self.runner.sampler.take_times()
            self.trace.end(flush_s, wait_s, deferred=self._inflight is not None)

    def _run(self, plan: StepPlan) -> None:
        sampled, out, logits = self.runner.run(plan)
        self._after_forward(plan)
        if out is None:  # no sampler ran, so nothing was flushed before the device
            self._flush_outbox()
            self.stats.step(0, len(self.scheduler.running), len(self.scheduler.waiting))
            return
        self._absorb(sampled, out, logits)

    def _run_overlapped(self, plan: StepPlan) -> None:
        """Overlap scheduling: launch ``plan`` (its pending requests read their last token on the
        device), then read back and apply the step launched before it while the device runs this
        one. A request that step finished is dropped from this one: its pages go back and its
        length stays, as if it had not run. This step's ids stay on the device when the next step
        may read them there (`_may_defer`), else they are read back now."""
        step = self.runner.launch(plan, self._inflight)
        ended: list[tuple[Request, dict[str, Any]]] = []
        self._settle(ended)
        ending = {id(req) for req, _ in ended}
        self.cache.end_step(plan.batch, [i for i, r in enumerate(plan.reqs) if id(r) in ending])
        for req, reason in ended:
            self._finish(req, reason)
        self._after_forward(plan)
        if step.sample is None:
            self._flush_outbox()
            self.stats.step(0, len(self.scheduler.running), len(self.scheduler.waiting))
            return
        live = [r for r in step.sampled if r.status is not Status.FINISHED]
        if self.overlap and live and self._may_defer(step):
            for req in live:
                req.await_token()
            self._inflight = step
            self.deferred_steps += 1
        else:
            self._absorb(step.sampled, self.runner.sampler.collect(step.sample), step.logits)

    def _may_defer(self, step: Launched) -> bool:
        """Whether the step's ids may stay on the device: no request needs them on the host before
        its next step (penalties count them, logprobs read the step's rows, and so does the drift
        monitor for the first ``drift_max_tokens`` steps of a sampled request, not after)."""
        return not any(
            r.penalties is not None or r.params.return_logprob or r.mm is not None or self._records_drift(r)
            for r in step.sampled
        )

    def _records_drift(self, req: Request) -> bool:
        """Whether the drift monitor still records ``req``'s steps' log-softmax rows (`_absorb`)."""
        return req.drift_logprobs is not None and len(req.drift_logprobs) < self.args.drift_max_tokens

    def _settle(self, ended: list[tuple[Request, dict[str, Any]]] | None = None) -> None:
        """Read back and apply the step in flight, if any (``ended``: see `_absorb`)."""
        step, self._inflight = self._inflight, None
        if step is not None and step.sample is not None:
            self._absorb(step.sampled, self.runner.sampler.collect(step.sample), step.logits, ended)

    def _after_forward(self, plan: StepPlan) -> None:
        for req in plan.reqs:
            if req.status is Status.FINISHED:
                continue
            if req.leader is None and not req.prompt_cached and req.computed >= len(req.prompt_ids):
                self.cache.cache_prefix(req.seq)  # n > 1: siblings now match the prompt's pages
                req.prompt_cached = True
            if req.mm is not None and not req.mm.pinned and req.computed >= len(req.prompt_ids):
                self._pin_images(req)

    def _absorb(
        self,
        sampled: list[Request],
        out: SampleOutput,
        logits: torch.Tensor | None,
        ended: list[tuple[Request, dict[str, Any]]] | None = None,
    ) -> None:
        """Append the sampled tokens, stream them and end the requests they finish. A request in
        the open step (overlap scheduling) is not ended here: it goes to ``ended`` for the caller."""
        now = time.perf_counter()
        taken = 0
        for i, req in enumerate(sampled):
            if req.status is Status.FINISHED:  # aborted meanwhile, or this token's step was dropped
                continue
            taken += 1
            reason: dict[str, Any] | None = None
            if out.invalid[i]:
                self.stats.nonfinite_logits()
                req.pending = False
                reason = {"type": "abort", "message": NONFINITE_LOGITS, "error": True}
            else:
                tok = out.tokens[i]
                if req.params.return_logprob:
                    req.token_logprobs.append((out.token_logprobs[i], tok))
                    req.top_logprobs.append([(lp, t) for t, lp in out.top_logprobs[i] or []])
                if self._records_drift(req):
                    assert logits is not None
                    req.drift_logprobs.append(torch.log_softmax(logits[i].float(), dim=-1).cpu())
                req.append(tok, now)
                if req.finish_reason is None and req.tokens_len >= self.max_context:
                    req.finish_reason = {"type": "length", "length": len(req.output_ids)}
                reason = req.finish_reason
            if reason is None:
                if req.stream and req.sink is not None:
                    chunk = req.delta()
                    if chunk is not None:
                        self._deliver(req.sink, chunk)
            elif ended is not None and req.seq is not None and req.seq.in_step:
                ended.append((req, reason))
            else:
                self._finish(req, reason)
        self.stats.step(taken, len(self.scheduler.running), len(self.scheduler.waiting))

    def _finish(self, req: Request, reason: dict[str, Any]) -> None:
        """End a request (any state): release its cache sequence, deliver, record stats."""
        if req.pending:  # its last token is still on the device: take it first (it may end it)
            try:
                self._settle()
            except Exception:  # the read-back failed: the request ends without that token
                log.exception("reading back the step in flight failed")
                req.pending = False
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
                self._deliver(req.sink, chunk)
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
                started=req.started,
            )
        )

    def _fail(self, reqs: list[Request], exc: Exception) -> None:
        """End ``reqs`` with an error response; their pages and ring slots go back to the cache."""
        for req in list(reqs):
            try:
                self._finish(req, {"type": "abort", "message": f"internal error: {exc}", "error": True})
            except Exception:
                log.exception("could not end request %s", req.rid)

    def _abort_all(self, message: str) -> None:
        for req in [*self.scheduler.running, *self.scheduler.waiting]:
            self._finish(req, {"type": "abort", "message": message})
        with self._post_lock:
            self._closed = True
        for kind, payload in self._pending():  # requests posted after the shutdown command
            if kind == "add":
                for req in payload:
                    self._finish(req, {"type": "abort", "message": message})
            elif kind not in ("abort", "shutdown"):
                payload[1].set_exception(RuntimeError(message))

    def _on_level(self, level: int, window: int) -> None:  # drift worker thread
        self._wake.set()  # the engine thread applies the monitor's window before its next step

    def _deliver(self, sink: ResultCallback, chunk: dict[str, Any]) -> None:
        try:  # noqa: SIM105 (contextlib.suppress builds an object per request per step)
            sink(chunk)
        except RuntimeError:  # the consumer's event loop is closed: nobody listens
            pass
        mailbox = getattr(sink, "mailbox", None)
        if mailbox is not None:
            self._outbox[id(mailbox)] = mailbox

    def _flush_outbox(self) -> None:
        """Wake each event loop that was given chunks since the last flush, once."""
        for mailbox in self._outbox.values():
            mailbox.flush()
        self._outbox.clear()
