"""The server's one door into ``kvstrata.Engine``: tokenizing, streaming a request, aborting it,
and turning the engine's stats objects into an ``EngineSnapshot``.

Every engine call the server makes lives here, so an engine API change is a change in this file.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from kvstrata.engine.detokenizer import UNICODE_TO_BYTE
from kvstrata.server.errors import APIError
from kvstrata.server.snapshot import PAGE_STATES, DriftSnapshot, EngineSnapshot, TierSnapshot

log = logging.getLogger("kvstrata.server")
KV_POOL_FULL = "kv_pool_full"


@dataclass(frozen=True)
class ImageSize:
    """An image's size, all `VisionInputs.prompt_tokens` reads of it."""

    width: int
    height: int


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Delta:
    """What one engine chunk adds to one choice."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    error: str | None = None
    # Why a "length" finish came early: "kv_pool_full" when the KV pool could not hold the sequence
    # any longer (it ran alone and still could not grow), None when max_tokens or the context ended it.
    length_cause: str | None = None


def _finish_reason(raw: Any) -> tuple[str | None, str | None]:
    """Engine finish reason (SGLang style dict or str) -> (OpenAI finish_reason, error message)."""
    if raw is None:
        return None, None
    kind = raw.get("type") if isinstance(raw, dict) else str(raw)
    if kind == "abort":
        message = raw.get("message") if isinstance(raw, dict) else None
        return "abort", message or "request aborted"
    return ("length" if kind == "length" else "stop"), None


def _logprobs(meta: dict[str, Any]) -> list[TokenLogprob]:
    chosen = meta.get("output_token_logprobs") or []
    tops = meta.get("output_top_logprobs") or []
    out = []
    for i, item in enumerate(chosen):
        top = tops[i] if i < len(tops) else []
        out.append(
            TokenLogprob(
                token_id=int(item[1]),
                logprob=float(item[0]),
                top=[(int(t[1]), float(t[0])) for t in top],
            )
        )
    return out


def to_delta(chunk: dict[str, Any]) -> Delta:
    """One engine chunk as a Delta (per streamed token: the checks for rare fields come first)."""
    meta = chunk.get("meta_info", {})
    raw_finish = meta.get("finish_reason")
    finish, error = _finish_reason(raw_finish) if raw_finish is not None else (None, None)
    return Delta(
        text=chunk.get("text", ""),
        token_ids=list(chunk.get("output_ids", [])),
        logprobs=_logprobs(meta) if meta.get("output_token_logprobs") else [],
        finish_reason=finish,
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        completion_tokens=int(meta.get("completion_tokens", 0)),
        cached_tokens=int(meta.get("cached_tokens", 0)),
        error=error,
        length_cause=_length_cause(raw_finish) if raw_finish is not None else None,
    )


def _length_cause(raw: Any) -> str | None:
    if isinstance(raw, dict) and raw.get("type") == "length" and raw.get("pool") == "full":
        return KV_POOL_FULL
    return None


class EngineRequest:
    """All choices of one API request as one engine batch: ``len(prompts) * n`` requests, choice
    index = prompt * n + sample (the engine's order). ``abort()`` (or leaving ``deltas()`` early:
    client gone, task cancelled) aborts every unfinished one; the engine returns their pages and
    ring slots."""

    def __init__(
        self,
        engine: Any,
        prompts: list[list[int]],
        params: dict[str, Any],
        images: list[list[Any]] | None = None,
    ) -> None:
        self.engine = engine
        self.id = uuid.uuid4().hex
        self.rids = [f"{self.id}-p{i}" for i in range(len(prompts))]
        self.total = len(prompts) * int(params.get("n", 1))
        self.done = 0
        self.aborted = False
        try:
            self.gen = engine.async_generate(
                input_ids=prompts, sampling_params=params, stream=True, rid=self.rids, image_data=images
            )
        except ValueError as exc:
            raise APIError(400, str(exc), code="invalid_value") from exc

    async def start(self) -> None:
        """Wait for the engine to take the request, where it answers later (the engine process):
        its ``ValueError`` becomes a 400, a gone engine a 503, before any response has started."""
        wait = getattr(self.gen, "wait_accepted", None)
        if wait is None:
            return
        from kvstrata.server.engine_process import EngineUnavailable

        try:
            await wait()
        except (ValueError, EngineUnavailable) as exc:  # refused: nothing runs in the engine
            await self.gen.aclose()
            if isinstance(exc, ValueError):
                raise APIError(400, str(exc), code="invalid_value") from exc
            raise APIError(503, str(exc), code="engine_unavailable") from exc
        except BaseException:  # cancelled (client gone) while waiting: the engine may take it later
            self.abort()
            await self.gen.aclose()
            raise

    async def deltas(self) -> AsyncIterator[tuple[int, Delta]]:
        try:
            async for chunk in self.gen:
                delta = to_delta(chunk)
                if chunk.get("finished"):
                    self.done += 1
                    delta.finish_reason = delta.finish_reason or "stop"
                yield int(chunk.get("index", 0)), delta
                if self.done == self.total:
                    return
        finally:
            self.abort()
            await self.gen.aclose()

    def abort(self) -> None:
        """Abort whatever has not finished (idempotent; a no-op once every choice is done)."""
        if self.done < self.total and not self.aborted:
            self.aborted = True
            log.info(
                "aborting request %s: %d of %d choices unfinished",
                self.id,
                self.total - self.done,
                self.total,
            )
            for rid in self.rids:
                self.engine.abort(rid)


class EngineClient:
    def __init__(self, engine: Any, served_model_name: str | None = None, context_length: int | None = None):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        info = engine.get_server_info()
        self.model_name = served_model_name or str(info["model"])
        # the engine takes prompt + output up to its context and its KV pool, whichever is smaller
        model_len = min(int(info["context_length"]), int(info["max_total_tokens"]))
        self.context_length = min(model_len, context_length) if context_length else model_len
        self.threshold = float(info.get("drift_threshold") or 0.0)
        self.vocab_size = len(self.tokenizer)
        self.recent_window = int(info["recent_window"])
        self._token_text = lru_cache(maxsize=65536)(self._decode_one)

    # --- tokens -----------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        try:
            ids = self.engine.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # a template may reject a role order (e.g. two system messages)
            raise APIError(
                400, f"messages: the chat template rejected them: {exc}", param="messages"
            ) from exc
        return self.encode(ids, add_special_tokens=False)  # the template holds the special tokens

    def _decode_one(self, token_id: int) -> tuple[str, bytes]:
        text = self.tokenizer.decode([token_id])
        piece = self.tokenizer.convert_ids_to_tokens([token_id])[0] or ""
        if piece and all(ch in UNICODE_TO_BYTE for ch in piece):  # byte-level BPE: exact bytes
            raw = bytes(UNICODE_TO_BYTE[ch] for ch in piece)
            if raw.decode("utf-8", "replace") == text:
                return text, raw
        return text, text.encode("utf-8")

    def token_text(self, token_id: int) -> str:
        """The token as text (U+FFFD where it holds part of a character)."""
        return self._token_text(token_id)[0]

    def token_bytes(self, token_id: int) -> bytes:
        """The token's exact UTF-8 bytes (a part of a multi-byte character stays as that part)."""
        return self._token_text(token_id)[1]

    # --- generation -------------------------------------------------------------------------------
    def submit(
        self, prompts: list[list[int]], params: dict[str, Any], images: list[list[Any]] | None = None
    ) -> EngineRequest:
        """Submit the choices of one API request (call on the event loop). The engine checks inputs
        at submission, so its ValueError becomes a 400 before any response has started."""
        return EngineRequest(self.engine, prompts, params, images)

    # --- images and pins --------------------------------------------------------------------------
    def _vision(self) -> Any:
        model = self.engine.model
        if model is None:  # shut down (a request that raced `Engine.shutdown`)
            raise APIError(503, "the engine is shut down", code="engine_unavailable")
        vision = model.vision
        if vision is None:
            raise APIError(
                400, f"the model {self.model_name!r} takes no images", param="messages", code="invalid_image"
            )
        return vision

    def image_token_id(self) -> int:
        return int(self._vision().image_token_id)

    def template_takes_image_parts(self) -> bool:
        from kvstrata.multimodal.chat import takes_image_parts

        return takes_image_parts(getattr(self.tokenizer, "chat_template", None))

    def image_text(self) -> str:
        """The image token as text, which the chat template and tokenizer turn back into its id."""
        return str(self.tokenizer.convert_ids_to_tokens([self.image_token_id()])[0])

    def image_extra_tokens(self, images: list[Any]) -> int:
        """Tokens ``images`` (decoded) add to the prompt beyond their image tokens: each one's spans
        (all its tiles with Idefics3 splitting) and wrap tokens, from the images' sizes (no tower run)."""
        if not images:
            return 0
        vision = self._vision()
        return sum(vision.prompt_tokens(image) - 1 for image in images)

    def image_limits(self) -> Any:
        """The `ImageLimits` images are loaded under (the engine's ``--max-image-*`` options)."""
        return self._vision().limits

    def load_image(self, url: str) -> Any:
        from kvstrata.multimodal.images import ImageError, load_image

        try:
            return load_image(url, self.image_limits())
        except ImageError as exc:
            raise APIError(400, f"image_url: {exc}", param="messages", code="invalid_image") from exc

    def pin(self, ids: list[int], images: list[Any], ttl_s: float | None, label: str) -> dict[str, Any]:
        from kvstrata.radix.errors import PinBudgetExceeded

        try:
            return self.engine.pin(input_ids=ids, image_data=images or None, ttl_s=ttl_s, label=label)
        except PinBudgetExceeded as exc:
            raise APIError(409, f"pin refused: {exc}", code="pin_budget_exceeded") from exc
        except ValueError as exc:
            raise APIError(400, str(exc), code="invalid_value") from exc

    def unpin(self, pin_id: str) -> dict[str, Any]:
        try:
            return self.engine.unpin(pin_id)
        except KeyError as exc:
            raise APIError(404, f"no pin with id {pin_id!r}", param="pin_id", code="pin_not_found") from exc

    def flush_cache(self) -> bool:
        return bool(self.engine.flush_cache())

    def subscribe(self, fn: Callable[[object], None]) -> Callable[[], None]:
        return self.engine.subscribe(fn)

    def healthy(self) -> bool:
        """False once the engine is gone (an engine process that exited): ``/health`` answers 503."""
        return True

    def step_trace(self) -> Any:
        """The engine's per-step timeline when ``KVSTRATA_STEP_TRACE`` turned it on, else None."""
        return getattr(getattr(self.engine, "core", None), "trace", None)

    # --- stats ------------------------------------------------------------------------------------
    def snapshot(self) -> EngineSnapshot:
        stats = self.engine.get_stats()
        snap = EngineSnapshot(
            # the cache's count is taken on the engine thread now; the engine's gauge is only
            # refreshed by a step, so it stays stale when an abort leaves the engine idle
            num_running=stats.cache.running if stats.cache is not None else stats.num_running_reqs,
            num_queued=stats.num_queue_reqs,
            requests_received=stats.requests_received_total,
            requests_finished=dict(stats.requests_finished_total),
            prompt_tokens=stats.prompt_tokens_total,
            generation_tokens=stats.generation_tokens_total,
            cached_tokens=stats.cached_tokens_total,
            preemptions=stats.preemptions_total,
            nonfinite_logits=stats.nonfinite_logits_total,
            # per request, at its first step (the cache's own counts include re-admissions)
            cache_hit_rate=stats.cache_hit_rate,
            gen_throughput=stats.gen_throughput,
        )
        if stats.drift is not None:
            d = stats.drift
            snap.drift = DriftSnapshot(
                drift_ewma=d.ewma,
                level=d.level,
                threshold=self.threshold,
                window=d.window,
                samples=d.samples,
                level_changes=d.level_changes,
                raised=d.raised,
            )
        fill_cache_stats(snap, stats.cache)
        # the cache's window (what steps use), not the one the drift monitor asks for
        snap.recent_window = int(stats.cache.recent_window) if stats.cache is not None else self.recent_window
        vision = self.engine.vision_stats()
        snap.vision_encoded_images, snap.vision_cached_images = (
            vision["encoded_images"],
            vision["cached_images"],
        )
        fill_layer_codecs(snap, self.engine)
        return snap


def fill_layer_codecs(snap: EngineSnapshot, engine: Any) -> None:
    """The per-layer K/V codecs of new cold pages and the load-time plan (kvstrata/engine/kvplan.py)."""
    from kvstrata.engine.kvplan import codec_bits, plan_summary
    from kvstrata.radix.pool import split_layer_codec

    snap.layer_codecs = [split_layer_codec(name) for name in engine.layer_codecs()]
    geometry = (engine.cache_config.page_size, engine.config.kv_heads, engine.config.head_dim)
    snap.layer_bits = [(codec_bits(k, *geometry), codec_bits(v, *geometry)) for k, v in snap.layer_codecs]
    snap.kv_plan = plan_summary(engine.core.kv_plan)
    snap.raised_codecs = [split_layer_codec(name) for name in engine.raised_codecs()]


def fill_cache_stats(snap: EngineSnapshot, cache: Any) -> None:
    """Copy a ``kvstrata.radix`` ``CacheStats`` into ``snap`` (tiers, pages, bytes, quantization)."""
    if cache is None:
        return
    for name, tier in cache.tiers.items():
        snap.tiers[name] = TierSnapshot(
            pages={state: tier.pages(state) for state in PAGE_STATES},
            bytes={state: tier.bytes(state) for state in PAGE_STATES},
            total_pages=tier.total,
            total_bytes=tier.total * tier.unit_bytes,
            bytes_per_token=float(tier.bytes_per_token),
            usage=float(tier.usage),
        )
    cold = cache.tiers.get("cold")
    snap.quantized_pages = cache.quantized_pages
    snap.evicted_pages = cache.evicted_pages
    snap.pinned_pages = cache.pinned_pages
    snap.pinned_bytes = cache.pinned_bytes
    snap.pin_budget_bytes = cache.pin_budget_bytes
    snap.pins_created, snap.pins_expired = cache.pins_created, cache.pins_expired
    snap.pins_refused = cache.pins_refused
    snap.pins = list(cache.pins)
    history = [t for t in (cold, *(cache.tiers.get(n) for n in ("image", "raised"))) if t is not None]
    snap.tree_pages = sum(t.cached for t in history)
    snap.in_use_pages = sum(t.used for t in history)
    denominator = cache.quantized_elements
    for kind, overflow, nonfinite in (
        ("k", cache.overflow_k, cache.nonfinite_k),
        ("v", cache.overflow_v, cache.nonfinite_v),
    ):
        for layer, count in enumerate(overflow):
            snap.overflow_ratio[(layer, kind)] = count / denominator if denominator else 0.0
        for layer, count in enumerate(nonfinite):
            snap.nonfinite[(layer, kind)] = count
        # running absmax / calibration clip: only a cache with static scales reports it
        for layer, ratio in enumerate(getattr(cache, f"absmax_ratio_{kind}", None) or []):
            snap.absmax_ratio[(layer, kind)] = float(ratio)


class RemoteEngineClient(EngineClient):
    """The same door over an engine in its own process (`EngineProcess`): tokenizing, detokenizing
    and the chat template run here, on the server's copy of the tokenizer; generation streams over the
    pipe; what reads the engine's state (stats, pins, images, the cache) runs on the engine side's own
    `EngineClient`, so its answers and errors are the in-process ones."""

    _limits: Any = None
    _image_token_id: int | None = None

    def _remote(self, method: str, *args: Any) -> Any:
        from kvstrata.server.engine_process import EngineUnavailable

        try:
            return self.engine.call(method, *args)
        except EngineUnavailable as exc:
            raise APIError(503, str(exc), code="engine_unavailable") from exc

    def healthy(self) -> bool:
        return bool(self.engine.alive)

    def image_token_id(self) -> int:
        if self._image_token_id is None:  # fixed by the model: asked once
            self._image_token_id = int(self._remote("image_token_id"))
        return self._image_token_id

    def image_extra_tokens(self, images: list[Any]) -> int:
        # the count reads only each image's size: the pixels cross the pipe once, with the request
        sizes = [ImageSize(image.width, image.height) for image in images]
        return int(self._remote("image_extra_tokens", sizes)) if sizes else 0

    def image_limits(self) -> Any:
        """Fetched once: images are then loaded here, on the server's threads."""
        if self._limits is None:
            self._limits = self._remote("image_limits")
        return self._limits

    def pin(self, ids: list[int], images: list[Any], ttl_s: float | None, label: str) -> dict[str, Any]:
        return self._remote("pin", ids, images, ttl_s, label)

    def unpin(self, pin_id: str) -> dict[str, Any]:
        return self._remote("unpin", pin_id)

    def flush_cache(self) -> bool:
        return bool(self._remote("flush_cache"))

    def step_trace(self) -> Any:
        return None  # the timeline is the engine process's (KVSTRATA_STEP_TRACE), without loop lines

    def snapshot(self) -> EngineSnapshot:
        return self._remote("snapshot")
